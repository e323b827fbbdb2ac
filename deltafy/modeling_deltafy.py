# Deep Delta Learning residuals for pretrained Hugging Face decoders.
#
# This file is copied verbatim into every checkpoint deltafy writes, followed by a few generated
# lines that bind it to the base model class. It imports only torch and transformers, and it is
# the one implementation of the math: training, evaluation, decoding and torch.compile all run it.
#
# Every residual write x <- x + m*h (m: the layer's own scale on the write, usually 1) becomes
#
#     x <- x + m*h + beta * (v - k^T x) * k        (Zhang et al., "Deep Delta Learning", 2026)
#
# k: unit direction, the sublayer's own write (k = m h / |m h|) or a learned head on c;
# v: scalar target for the readout k^T x, in units of the stream's RMS;
# beta = 2 * sigmoid(gate(c)) in (0, 2); c: the context the sublayer saw, normalized to unit length.
# The gate bias starts very negative, so a fresh conversion behaves like the original model.
from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

DELTAFY_FORMAT_VERSION = 1


# -- the spec: everything the surgery needs, stored as the "deltafy" section of the config -------
@dataclass(frozen=True)
class SiteSpec:
    """One residual write ``x <- x + scale * h`` of a decoder layer."""

    name: str  # "attn" or "mlp"
    write: str  # the module whose output is h (the last module before the addition)
    stream: str = ""  # the module whose first input is the stream x ("" = the layer itself)
    context: str = "output"  # c is the stream module's output (pre-norm) or its "input" x
    scale: float = 1.0  # the layer adds scale * h (Granite's residual_multiplier)
    norm_after: str | None = None  # post-LN: the norm applied to x + h (read by the self-check)


@dataclass(frozen=True)
class DeltaSpec:
    """The conversion: which writes of which layers become DDL writes, and how the heads start."""

    layers: str  # path of the decoder layer list, e.g. "model.layers"
    hidden_size: int
    sites: tuple[SiteSpec, ...]
    direction: str = "sublayer"  # k = the sublayer's normalized write (paper), or "learned" from c
    rank: int | None = None  # rank of a learned direction (None: a full d x d matrix)
    gate_bias: float = -18.0  # initial gate logit: beta = 2 sigmoid(-18) = 3e-8
    eps: float = 1e-6  # k = kr / sqrt(|kr|^2 + eps^2)

    def __post_init__(self):
        if self.direction not in ("sublayer", "learned"):
            raise ValueError(f"deltafy: direction must be 'sublayer' or 'learned', got {self.direction!r}")
        if self.rank is not None and self.direction != "learned":
            raise ValueError("deltafy: rank applies only to a learned direction")
        object.__setattr__(self, "sites", tuple(s if isinstance(s, SiteSpec) else SiteSpec(**s) for s in self.sites))

    @classmethod
    def from_dict(cls, section: dict) -> DeltaSpec:
        """The spec in a config's ``deltafy`` section (which also holds the recipe and provenance)."""
        return cls(**{f.name: section[f.name] for f in fields(cls) if f.name in section})

    def to_dict(self) -> dict:
        return asdict(self) | {"sites": [{k: v for k, v in asdict(s).items() if v is not None} for s in self.sites]}


# -- the math ------------------------------------------------------------------------------------
class DeltaDirection(nn.Module):
    """Learned direction head k = normalize(W_k c), W_k full or factored as up @ down (rank r)."""

    def __init__(self, hidden_size: int, rank: int | None):
        super().__init__()
        self.rank = rank
        if rank is None:
            self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        else:
            self.down = nn.Linear(hidden_size, rank, bias=False)
            self.up = nn.Linear(rank, hidden_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.rank is None:
            nn.init.eye_(self.proj.weight)  # start at k = normalize(c): the direction the sublayer read from
        else:
            nn.init.normal_(self.down.weight, std=self.down.in_features**-0.5)
            nn.init.normal_(self.up.weight, std=self.up.in_features**-0.5)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        if self.rank is None:
            return F.linear(c, _like(self.proj.weight, c))
        return F.linear(F.linear(c, _like(self.down.weight, c)), _like(self.up.weight, c))


class DeltaSite(nn.Module):
    """The DDL heads of one residual write (a site): gate beta, target v, optional direction k.

    Attached to its decoder layer as ``layer.delta[name]``. ``forward(x, c, h)`` returns the write
    h' that the layer adds in place of h; the surgery (_SiteCall) calls it with the stream x, the
    context c and the write h of the layer's own modules.
    """

    def __init__(
        self,
        hidden_size: int,
        direction: str = DeltaSpec.direction,  # (the defaults are the spec's: one place holds them)
        rank: int | None = DeltaSpec.rank,
        gate_bias: float = DeltaSpec.gate_bias,
        eps: float = DeltaSpec.eps,
        scale: float = SiteSpec.scale,
        context: str = SiteSpec.context,
    ):
        super().__init__()
        if direction not in ("sublayer", "learned"):
            raise ValueError(f"deltafy: direction must be 'sublayer' or 'learned', got {direction!r}")
        if not scale > 0:
            raise ValueError(f"deltafy: the scale on a residual write must be positive, got {scale}")
        self.hidden_size = hidden_size
        self.gate_bias_init = float(gate_bias)
        self.eps = float(eps)
        self.scale = float(scale)
        self.context = context
        self.gate = nn.Linear(hidden_size, 1)
        self.target = nn.Linear(hidden_size, 1)
        self.direction = DeltaDirection(hidden_size, rank) if direction == "learned" else None
        self.name, self.where = "", ""  # the site's name and "stream -> write", set by apply_deltafy
        self.reset_parameters()
        for module in self.modules():  # our init is final: transformers must not re-initialize these
            module._is_hf_initialized = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, self.gate_bias_init)
        nn.init.zeros_(self.target.weight)
        nn.init.zeros_(self.target.bias)
        if self.direction is not None:
            self.direction.reset_parameters()

    def extra_repr(self) -> str:
        kind = "sublayer" if self.direction is None else f"learned (rank {self.direction.rank or 'full'})"
        return f"{self.where}, direction={kind}, scale={self.scale:g}"

    def heads(self, c: torch.Tensor):
        """Gate logit g and target u per token (shaped like c without its last dim): beta = 2 sigmoid(g),
        and the target v = u rms(x) is in units of the stream's rms, so one learning rate fits models of
        any scale. Both read the unit-length context c/|c| (an Adam step of size lr then moves them by at
        most lr*sqrt(d), whatever the model's norms); dividing the dot products by |c| normalizes c for
        free. Returns (g, u, 1/|c|) in c's precision (the caller's: fp32 or wider)."""
        gate, target, dot = self.gate, self.target, torch.linalg.vecdot
        inv_norm_c = torch.rsqrt(dot(c, c) + 1e-6)
        g = torch.addcmul(_like(gate.bias, c), dot(c, _like(gate.weight, c)), inv_norm_c)
        u = torch.addcmul(_like(target.bias, c), dot(c, _like(target.weight, c)), inv_norm_c)
        return g, u, inv_norm_c

    def forward(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h' such that the layer's ``x + m h'`` is ``x + m h + beta (v - k^T x) k``, computed in fp32
        (or in h's precision where that is wider) and cast back to h's dtype.

        Per token this is a few dot products and scalars, written as vecdots and fused multiply-adds
        (no matmuls, no dtype calls that do nothing): decoding one token costs about a dispatch per
        op, so the number of ops is the cost."""
        if torch.is_autocast_enabled(h.device.type):  # autocast would run the heads in bf16/fp16
            with torch.autocast(h.device.type, enabled=False):
                return self.forward(x, c, h)
        dtype = h.dtype
        work = torch.promote_types(dtype, torch.float32)
        if not x.dtype == c.dtype == dtype == work:
            x, c, h = x.to(work), c.to(work), h.to(work)
        dot = torch.linalg.vecdot
        g, u, inv_norm_c = self.heads(c)
        # k = kr / n with n = sqrt(|kr|^2 + eps^2): the sublayer's own write (kr = h, with the
        # layer's scale m on it folded into eps) or a learned head on the unit context.
        if self.direction is None:
            kr, eps = h, self.eps / self.scale
        else:
            kr, eps = self.direction(c * inv_norm_c.unsqueeze(-1)), self.eps
        inv_n = torch.rsqrt(dot(kr, kr) + eps * eps)
        # k.x - v, where v = u rms(x) = u |x| / sqrt(d)
        x_norm = torch.linalg.vector_norm(x, dim=-1)
        miss = torch.addcmul(dot(kr, x) * inv_n, u, x_norm, value=-(self.hidden_size**-0.5))
        # x + m h' = x + m h + beta (v - k.x) k  <=>  h' = h - (2 sigmoid(g) / m) (k.x - v) kr / n
        out = torch.addcmul(h, kr, (torch.sigmoid(g) * miss * inv_n).unsqueeze(-1), value=-2.0 / self.scale)
        return out if out.dtype == dtype else out.to(dtype)


def _like(param: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``param`` in x's precision (the heads of a bf16 model are bf16; the math runs in fp32).
    A Python check, not ``type_as``: on the decode path every dispatched call costs microseconds."""
    return param if param.dtype == x.dtype else param.to(x.dtype)


# -- the surgery ---------------------------------------------------------------------------------
# Stream and context travel from a site's capture to its write. They are kept per thread, so that
# concurrent forwards on one model never see each other's.
_STASH = threading.local()


def _stash() -> dict:
    try:
        return _STASH.sites
    except AttributeError:
        _STASH.sites = {}
        return _STASH.sites


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args and isinstance(args[0], torch.Tensor) else kwargs["hidden_states"]


class _SiteCall:
    """The ``forward`` deltafy installs on a module that takes part in a site: the module's own
    forward (or the wrapper someone installed before us), then the capture of x and c for every
    site whose stream it is, and the write ``h <- site(x, c, h)`` of every site whose write it is
    (OPT's post-LN attention is both).

    An instance attribute rather than forward hooks: torch.compile traces it as plain code, and a
    module without hooks keeps torch's fast call path. ``enabled`` False (deltafy.disabled) makes
    it a pass-through; so does an empty site list (deltafy.unconvert under someone else's wrapper).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.inner = module.__dict__.get("forward")  # e.g. accelerate's hooks; they keep running inside
        self.captures: list[DeltaSite] = []
        self.writes: list[DeltaSite] = []
        self.enabled = True

    def __call__(self, *args, **kwargs):
        if self.inner is None:
            output = type(self.module).forward(self.module, *args, **kwargs)
        else:
            output = self.inner(*args, **kwargs)
        if not self.enabled:
            return output
        stash = _stash()
        for site in self.captures:
            x = _first_tensor(args, kwargs)
            stash[id(site)] = (x, x if site.context == "input" else output[0] if isinstance(output, tuple) else output)
        for site in self.writes:
            try:
                x, c = stash.pop(id(site))
            except KeyError:
                raise RuntimeError(
                    "deltafy: a residual write ran before its stream was captured; the site map does "
                    "not match this model's layer code"
                ) from None
            if isinstance(output, tuple):
                output = (site(x, c, output[0]),) + output[1:]
            else:
                output = site(x, c, output)
        return output

    def extra_repr(self) -> str:
        """The module's own extra_repr plus the sites it carries: print(model) shows the surgery."""
        roles = [f"stream of {s.name}" for s in self.captures] + [f"write of {s.name}" for s in self.writes]
        own = type(self.module).extra_repr(self.module)
        return ", ".join(filter(None, (own, "deltafy: " + ", ".join(roles) if roles else "")))


def _layers(model: nn.Module, path: str) -> nn.ModuleList:
    try:
        layers = model.get_submodule(path)
    except AttributeError as err:
        raise ValueError(f"deltafy: this model has no decoder layers at {path!r}") from err
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"deltafy: {path!r} is not a non-empty list of decoder layers")
    return layers


def apply_deltafy(model: nn.Module, spec: DeltaSpec | dict) -> nn.Module:
    """Attach DDL heads to every site of every decoder layer of ``model``, in place.

    ``spec`` is a DeltaSpec or the ``deltafy`` section of a converted config. Every module is
    resolved before anything is attached, so a map that does not fit leaves the model untouched.
    """
    if not isinstance(spec, DeltaSpec):
        spec = DeltaSpec.from_dict(spec)
    if getattr(model, "_deltafy_calls", None):
        raise ValueError("deltafy: this model is already converted")
    plan = []
    for layer in _layers(model, spec.layers):
        for site in spec.sites:
            try:
                stream = layer.get_submodule(site.stream) if site.stream else layer
                write = layer.get_submodule(site.write)
            except AttributeError as err:
                raise ValueError(
                    f"deltafy: site {site.name!r} names a module that {type(layer).__name__} does not have ({err})"
                ) from err
            plan.append((layer, site, stream, write))
    ref = next(model.parameters())
    calls: dict[int, _SiteCall] = {}
    for layer, site, stream, write in plan:
        delta = DeltaSite(
            spec.hidden_size, spec.direction, spec.rank, spec.gate_bias, spec.eps, site.scale, site.context
        ).to(device=ref.device, dtype=ref.dtype)
        delta.name, delta.where = site.name, f"{site.stream or '(layer)'} -> {site.write}"
        if not hasattr(layer, "delta"):
            layer.delta = nn.ModuleDict()
        layer.delta[site.name] = delta
        calls.setdefault(id(stream), _SiteCall(stream)).captures.append(delta)
        calls.setdefault(id(write), _SiteCall(write)).writes.append(delta)
    for call in calls.values():
        call.module.forward = call
        call.module.extra_repr = call.extra_repr
    model._deltafy_calls = list(calls.values())
    return model


def remove_deltafy(model: nn.Module) -> nn.Module:
    """Undo apply_deltafy in place: the original forwards back, the heads gone (see deltafy.unconvert)."""
    calls = model.__dict__.pop("_deltafy_calls", None)
    if not calls:
        raise ValueError("deltafy: this model is not converted")
    for call in calls:
        module = call.module
        module.__dict__.pop("extra_repr", None)
        if module.__dict__.get("forward") is call:
            del module.forward
            if call.inner is not None:
                module.forward = call.inner
        else:  # a wrapper installed after ours still calls it: leave it there as a pass-through
            call.captures, call.writes = [], []
    for module in model.modules():
        if isinstance(getattr(module, "delta", None), nn.ModuleDict):
            del module.delta
    return model


@contextlib.contextmanager
def disabled(model: nn.Module):
    """Run ``model`` with every DDL correction off (beta = 0 exactly), like peft's disable_adapter()."""
    calls = getattr(model, "_deltafy_calls", None) or []
    previous = [call.enabled for call in calls]
    for call in calls:
        call.enabled = False
    try:
        yield model
    finally:
        for call, enabled in zip(calls, previous, strict=True):
            call.enabled = enabled


def delta_sites(model: nn.Module):
    """Yield (qualified name, DeltaSite) for every site of a converted model."""
    for name, module in model.named_modules():
        if isinstance(module, DeltaSite):
            yield name, module


def mean_betas(model: nn.Module, run) -> dict[str, float]:
    """Mean beta per site (qualified name) over whatever forwards ``run()`` performs."""
    betas: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, site in delta_sites(model):
        betas[name] = []

        def record(site, args, log=betas[name]):
            c = args[1].to(torch.promote_types(args[1].dtype, torch.float32))
            log.append(2.0 * torch.sigmoid(site.heads(c)[0].detach()).float().mean())

        handles.append(site.register_forward_pre_hook(record))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: float(torch.stack(log).mean()) if log else float("nan") for name, log in betas.items()}


def deltafy_classes(base_config_class: type, base_model_class: type) -> tuple[type, type]:
    """Config and model classes of a converted checkpoint, derived from its base family.

    Subclassing keeps every original tensor name, generation, tied weights and device maps
    exactly as transformers implements them for the base family.
    """

    class DeltafyConfig(base_config_class):
        model_type = "deltafy"

    class DeltafyForCausalLM(base_model_class):
        config_class = DeltafyConfig

        def __init__(self, config, *args, **kwargs):
            super().__init__(config, *args, **kwargs)
            apply_deltafy(self, config.deltafy)

    for cls in (DeltafyConfig, DeltafyForCausalLM):
        cls.__qualname__ = cls.__name__
        cls.__module__ = __name__
    return DeltafyConfig, DeltafyForCausalLM
