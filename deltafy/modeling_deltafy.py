# Deep Delta Learning residuals for pretrained Hugging Face decoders.
#
# This file is copied verbatim into every checkpoint deltafy writes, followed by a few generated
# lines that bind it to the base model class, and next to modeling_deltafy_inference.py. Both must
# import only torch and transformers.
#
# Every residual write x <- x + h becomes
#
#     x <- x + h + beta * (v - k^T x) * k        (Zhang et al., "Deep Delta Learning", 2026)
#
# k: unit direction, either the sublayer's own write (k = h / ||h||) or a learned head on c;
# v: scalar target for the readout k^T x, in units of the stream's RMS;
# beta = 2 * sigmoid(gate(c)) in (0, 2); c: the context the sublayer saw, normalized to unit length.
# The gate bias starts very negative, so a fresh conversion behaves like the original model.
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from .modeling_deltafy_inference import FEW_ROWS, InferencePaths

DELTAFY_FORMAT_VERSION = 1

# Stream/context tensors travel from the capture step to the write step of one site. They are
# kept per thread so that concurrent forwards on one model instance never see each other's.
_STASH = threading.local()


# (module-level names: one lookup each on the decode path)
_is_grad_enabled, _is_compiling, _float32 = torch.is_grad_enabled, torch.compiler.is_compiling, torch.float32


def _stash() -> dict:
    store = getattr(_STASH, "sites", None)
    if store is None:
        store = _STASH.sites = {}
    return store


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return kwargs["hidden_states"]


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
            # Start at k = normalize(c): the direction the sublayer read from.
            nn.init.eye_(self.proj.weight)
        else:
            nn.init.normal_(self.down.weight, std=self.down.in_features**-0.5)
            nn.init.normal_(self.up.weight, std=self.up.in_features**-0.5)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        # Weights may be stored in bf16; the direction is computed in c's (fp32) precision.
        if self.rank is None:
            return F.linear(c, self.proj.weight.to(c.dtype))
        return F.linear(F.linear(c, self.down.weight.to(c.dtype)), self.up.weight.to(c.dtype))


class DeltaSite(InferencePaths, nn.Module):
    """The DDL heads of one residual write (one site): gate beta, target v, optional direction k.

    Attached to the decoder layer as ``layer.delta[site]``; its two steps run inside the layer's
    own modules (see _SiteCall): the capture of x and c after the module whose input is the stream
    x, ``correct`` after the module whose output h is added to the stream.
    """

    def __init__(
        self,
        hidden_size: int,
        direction: str = "sublayer",
        rank: int | None = None,
        gate_bias: float = -18.0,
        eps: float = 1e-6,
        scale: float = 1.0,
        context: str = "output",
    ):
        super().__init__()
        if direction not in ("sublayer", "learned"):
            raise ValueError(f"direction must be 'sublayer' or 'learned', got {direction!r}")
        self.hidden_size = hidden_size
        self.direction_kind = direction
        self.gate_bias_init = float(gate_bias)
        self.eps = float(eps)
        self.scale = float(scale)  # the layer adds scale * h (Granite's residual_multiplier)
        self.context = context  # "output": c = stream module's output; "input": c = x
        self.gate = nn.Linear(hidden_size, 1)
        self.target = nn.Linear(hidden_size, 1)
        self.direction = DeltaDirection(hidden_size, rank) if direction == "learned" else None
        self.force_beta: float | None = None  # set by tests and the self-check
        self.beta_log: list | None = None  # when a list, each forward appends its mean beta
        self._decode = None  # what the decode path reads (InferencePaths._decode_heads), built on first use
        self.reset_parameters()
        # Our own init is final: transformers must not re-initialize these as missing weights.
        for module in self.modules():
            module._is_hf_initialized = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, self.gate_bias_init)
        nn.init.zeros_(self.target.weight)
        nn.init.zeros_(self.target.bias)
        if self.direction is not None:
            self.direction.reset_parameters()

    # The decode path reads the heads' memory (numpy views, kernel pointers); these replace the tensors.
    def _apply(self, *args, **kwargs):
        self._decode = None
        return super()._apply(*args, **kwargs)

    def _load_from_state_dict(self, *args, **kwargs):
        self._decode = None
        return super()._load_from_state_dict(*args, **kwargs)

    def __getstate__(self):  # a copy (deepcopy, pickle) must view its own tensors
        return {**super().__getstate__(), "_decode": None}

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, direction={self.direction_kind}, scale={self.scale}"

    # -- math --------------------------------------------------------------------------------
    def correct(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Return h' such that the layer's ``x + scale * h'`` equals x + scale*h + beta(v - k^T x)k."""
        # Without autograd, the paths of modeling_deltafy_inference.py do the same math with less
        # work. (Under torch.compile the tensor path below fuses instead; scalars would break the graph.)
        # Decoding on CPU comes first and checks least: it is bound by per-call overhead.
        decode = self._decode
        if decode is None and not _is_compiling():
            decode = self._decode = self._decode_heads()
        if (
            decode
            and h.is_cpu
            and h.dtype is _float32
            and not _is_grad_enabled()
            and not _is_compiling()
            and not x.requires_grad  # (an input leaf may require grad under no_grad)
        ):
            d, n = decode[4], h.numel()
            if n <= FEW_ROWS * d:
                native = decode[7]
                if (
                    native is not None
                    and self.force_beta is None
                    and self.beta_log is None
                    and x.numel() == n == c.numel()
                    and x.dtype is c.dtype is _float32
                    and x.is_cpu
                    and c.is_cpu
                    and h.is_contiguous()
                    and x.is_contiguous()
                    and c.is_contiguous()
                ):  # the compiled kernel of modeling_deltafy_native.py: one call, into the output
                    out = torch.empty_like(h)
                    native(c.data_ptr(), x.data_ptr(), h.data_ptr(), out.data_ptr(), n // d)
                    return out
                if n == d:  # one token in Python: a single torch op, the write
                    gain = self._row_gain(c.numpy().reshape(d), x.numpy().reshape(d), h.numpy().reshape(d), decode)
                    return torch.add(h, h, alpha=gain)
                return self._correct_rows(x, c, h, decode)
        device = "cpu" if h.is_cpu else h.device.type  # (h.device costs more than the check itself)
        if torch.is_autocast_enabled(device):
            # Autocast would run the heads and the Gram matmuls in bf16/fp16; the correction stays fp32.
            with torch.autocast(device, enabled=False):
                return self.correct(x, c, h)
        if not _is_grad_enabled() and not _is_compiling():
            if self.direction is None:
                return self._correct_tokens(x, c, h).view(h.shape).to(h.dtype)
            if self.direction.rank is not None:
                if h.is_cpu and h.numel() == h.shape[-1] and h.dim() in (2, 3):
                    return self._correct_learned_token(x, c, h)
                return self._correct_learned_tokens(x, c, h).view(h.shape).to(h.dtype)
        dtype = h.dtype
        if dtype != torch.float32:
            x, c, h = x.float(), c.float(), h.float()
        inv_d = 1.0 / x.shape[-1]
        weight = torch.cat((self.gate.weight, self.target.weight)).float()
        bias = torch.cat((self.gate.bias, self.target.bias)).float()
        # The heads read the unit-length context c/|c|: an Adam step of size lr on every weight then
        # moves a head's output by at most lr*sqrt(d), whatever the model's width or norm gains.
        # Both heads run as one matmul, and dividing by |c| afterwards normalizes c for free.
        inv_norm_c = torch.rsqrt(torch.linalg.vecdot(c, c) + 1e-6)
        g, v = torch.addcmul(bias, F.linear(c, weight), inv_norm_c.unsqueeze(-1)).unbind(-1)
        if self.force_beta is None:
            beta = torch.sigmoid(g) * 2.0
        else:
            beta = torch.full_like(g, self.force_beta)
        if self.beta_log is not None:
            self.beta_log.append(beta.detach().mean())
        # The target lives in the stream's units (rms of x), so one lr fits models of any scale.
        # (clamped: sqrt's gradient at an all-zero stream row, e.g. a zero pad embedding, is inf)
        v = v * torch.sqrt(torch.linalg.vecdot(x, x).clamp_min(1e-30) * inv_d)
        m = self.scale
        if self.direction is None:
            # k = m h / n with n = sqrt(|m h|^2 + eps^2): the correction is a per-token gain on h.
            hh = torch.linalg.vecdot(h, h)
            n = torch.sqrt((hh * (m * m) if m != 1.0 else hh) + self.eps**2)
            gain = beta * torch.addcdiv(v, torch.linalg.vecdot(h, x), n, value=-m) / n
            out = torch.addcmul(h, h, gain.unsqueeze(-1))
        else:
            kr = self.direction(c * inv_norm_c.unsqueeze(-1))
            k = kr * torch.rsqrt(torch.linalg.vecdot(kr, kr) + self.eps**2).unsqueeze(-1)
            coef = beta * (v - torch.linalg.vecdot(k, x))
            out = torch.addcmul(h, k, (coef / m if m != 1.0 else coef).unsqueeze(-1))
        return out.to(dtype)


class _SiteCall:
    """The ``forward`` deltafy installs on a module that takes part in a site: the module's own
    forward, then the capture step of every site whose stream it is (x and c kept for the write)
    and the write step of every site whose write it is (h replaced by ``site.correct(x, c, h)``);
    OPT's post-LN attention is both.

    An instance attribute rather than forward hooks: a hooked call takes torch's slow call path
    (~4 us of Python per call, twice per site, which shows at decode time), while a module whose
    ``forward`` is replaced keeps the fast path; the correction is also plain code that
    torch.compile traces.
    """

    def __init__(self, module: nn.Module):
        self.module = module
        # A wrapper someone installed before us (accelerate's device hooks) keeps running inside.
        self.inner = module.__dict__.get("forward")
        self.captures: list[DeltaSite] = []
        self.writes: list[DeltaSite] = []

    def __call__(self, *args, **kwargs):
        if self.inner is None:
            output = type(self.module).forward(self.module, *args, **kwargs)
        else:
            output = self.inner(*args, **kwargs)
        # (written out in this one frame: at decode time every Python call shows)
        try:
            stash = _STASH.sites
        except AttributeError:
            stash = _stash()
        if self.captures:  # stash (x, c) for the write
            x = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            for site in self.captures:
                stash[id(site)] = (x, x if site.context == "input" else out)
        if self.writes:  # h' = correct(x, c, h) in place of h
            for site in self.writes:
                try:
                    x, c = stash.pop(id(site))
                except KeyError:
                    raise RuntimeError(
                        "deltafy: a residual write ran before its stream was captured; the site map does "
                        "not match this model's layer code"
                    ) from None
                if isinstance(output, tuple):
                    output = (site.correct(x, c, output[0]),) + output[1:]
                else:
                    output = site.correct(x, c, output)
        return output


# -- surgery ------------------------------------------------------------------------------------
def _layers(model: nn.Module, spec: dict) -> nn.ModuleList:
    try:
        layers = model.get_submodule(spec["layers"])
    except AttributeError:
        raise ValueError(f"deltafy: this model has no decoder layers at {spec['layers']!r}") from None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"deltafy: {spec['layers']!r} is not a non-empty list of decoder layers")
    return layers


def apply_deltafy(model: nn.Module, spec: dict) -> nn.Module:
    """Attach DDL heads to every site of every decoder layer of ``model``, in place.

    ``spec`` is the ``deltafy`` section of a converted config: ``layers`` (path of the decoder
    layer list), ``hidden_size``, ``sites`` (per site: ``name``, ``stream``, ``write``, ``context``, ``scale``),
    ``direction``, ``rank``, ``gate_bias`` and ``eps``.
    """
    if getattr(model, "_deltafy_calls", None):
        raise ValueError("deltafy: this model is already converted")
    ref = next(model.parameters())
    # Resolve every module first, so a map that does not fit leaves the model untouched.
    plan = []
    for layer in _layers(model, spec):
        for site in spec["sites"]:
            try:
                stream = layer.get_submodule(site["stream"]) if site.get("stream") else layer
                write = layer.get_submodule(site["write"])
            except AttributeError as err:
                raise ValueError(
                    f"deltafy: site {site['name']!r} names a module that {type(layer).__name__} does not have ({err})"
                ) from None
            plan.append((layer, site, stream, write))
    calls: dict[int, _SiteCall] = {}

    def call_of(module: nn.Module) -> _SiteCall:
        if id(module) not in calls:
            calls[id(module)] = _SiteCall(module)
        return calls[id(module)]

    for layer, site, stream, write in plan:
        delta = DeltaSite(
            hidden_size=spec["hidden_size"],
            direction=spec.get("direction", "sublayer"),
            rank=spec.get("rank"),
            gate_bias=spec.get("gate_bias", -18.0),
            eps=spec.get("eps", 1e-6),
            scale=site.get("scale", 1.0),
            context=site.get("context", "output"),
        ).to(device=ref.device, dtype=ref.dtype)
        if not hasattr(layer, "delta"):
            layer.delta = nn.ModuleDict()
        layer.delta[site["name"]] = delta
        call_of(stream).captures.append(delta)
        call_of(write).writes.append(delta)
    for call in calls.values():
        call.module.forward = call
    model._deltafy_calls = list(calls.values())
    return model


def delta_sites(model: nn.Module):
    """Yield (qualified name, DeltaSite) for every site of a converted model."""
    for name, module in model.named_modules():
        if isinstance(module, DeltaSite):
            yield name, module


def set_forced_beta(model: nn.Module, value: float | None) -> None:
    """Pin beta at ``value`` on every site (``None`` restores the learned gates)."""
    for _, site in delta_sites(model):
        site.force_beta = value


def mean_betas(model: nn.Module, run) -> dict[str, float]:
    """Mean beta per site (qualified name) over whatever forwards ``run()`` performs."""
    sites = dict(delta_sites(model))
    for site in sites.values():
        site.beta_log = []
    try:
        run()
        return {
            name: float(torch.stack(site.beta_log).mean()) if site.beta_log else float("nan")
            for name, site in sites.items()
        }
    finally:
        for site in sites.values():
            site.beta_log = None


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
