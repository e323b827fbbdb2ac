# Deep Delta Learning residuals for pretrained Hugging Face decoders (deltafy). Copied verbatim into every checkpoint
# deltafy writes, with a few generated lines that bind it to the base family's classes; it needs only torch,
# transformers, safetensors and the standard library, and is the one implementation of the math. Every residual write
# x <- x + m h of a decoder layer (m: the layer's own scale, usually 1) becomes
#
#     x <- x + m h + alpha beta (v - k^T x) k             (Zhang et al., "Deep Delta Learning", 2026)
#
# k: a unit direction, the write m h / |m h| or a learned head on c; v: the target of the readout k^T x, in units of
# the stream's RMS; beta = 2 sigmoid(gate(c)); c: the context the sublayer read, at unit length; alpha: a zero-init
# strength (gate "strength": a fresh conversion is the original bitwise) or 1 (gate "logit", the spec's default as in
# deltafy 0.1: the logit starts at -18). The expanded state (d_v > 1 "channels") stacks d_v copies of the stream along
# the batch dimension; each sublayer reads the view sum_j r_j x_j, and every channel gets the write and its own
# correction. Sections and their public names (deltafy imports no other):
#   the spec            DeltafyError, first_line, SiteSpec, DeltaSpec, DELTAFY_FORMAT_VERSION
#   the math            ddl_reference (the formula written out), DeltaDirection, DeltaSite
#   the surgery         apply_deltafy, remove_deltafy, disabled, first_input
#   the expanded state  DeltaRead, and the call that tiles, reads and folds the stream's channels
#   checkpoints         HEADS_FILE, BaseModelError, check_heads, check_base_record, base_weight_files, sha256_files,
#                       deltafy_classes (and the heads-only loader)
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import math
import re
import threading
import weakref
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DELTAFY_FORMAT_VERSION = 1


class DeltafyError(ValueError):
    """Bad input or an unmet precondition; the message says what to do."""


def first_line(err: BaseException, with_type: bool = False) -> str:
    """The first non-empty line of ``err``'s message (else its type's name), ``with_type``: after the type."""
    line = next((line for line in str(err).strip().splitlines() if line.strip()), None)
    return type(err).__name__ if line is None else f"{type(err).__name__}: {line}" if with_type else line


# -- the spec: what the surgery needs, stored as the "deltafy" section of the config ---------------
# A config is text anyone can edit, so it is checked as when deltafy wrote it (a NaN eps would load and run, and every
# loss would be NaN). A rule is (test, what the value must be).
_finite = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
_TEXT = (lambda v: isinstance(v, str) and v != "", "a non-empty string")
_COUNT = (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a positive integer")
_POSITIVE = (lambda v: _finite(v) and v > 0, "a finite number > 0")
_HEX = lambda n: lambda v: isinstance(v, str) and re.fullmatch(f"[0-9a-f]{{{n}}}", v) is not None  # noqa: E731
_OBJECT = (lambda v: isinstance(v, dict), "an object")
_one_of = lambda *choices: (lambda v: v in choices, " or ".join(map(repr, choices)))  # noqa: E731
_SITE_RULES = {"write": _TEXT, "stream": (lambda v: isinstance(v, str), "a string"), "scale": _POSITIVE}
_SITE_RULES |= {"context": _one_of("output", "input"), "norm_after": (lambda v: v is None or _TEXT[0](v), _TEXT[1])}
_SPEC_RULES = {"layers": _TEXT, "hidden_size": _COUNT, "direction": _one_of("sublayer", "learned"), "channels": _COUNT}
_SPEC_RULES |= {"gate": _one_of("logit", "strength"), "gate_bias": (_finite, "a finite number"), "eps": _POSITIVE}
_SPEC_RULES |= {"erase": (lambda v: isinstance(v, bool), "true or false")}
_SPEC_RULES |= {"rank": (lambda v: v is None or _COUNT[0](v), "a positive integer or null")}
_SPEC_RULES |= {"sites": (lambda v: isinstance(v, (list, tuple)), "a list of sites")}
_missing = lambda cls, got: [f.name for f in fields(cls) if f.default is MISSING and f.name not in got]  # noqa: E731


def _need(field: str, rule: tuple, value) -> None:
    if not rule[0](value):
        raise DeltafyError(f"{field} must be {rule[1]}, got {value!r}")


@dataclass(frozen=True)
class SiteSpec:
    """One residual write ``x <- x + scale * h`` of a decoder layer."""

    name: str  # "attn" or "mlp"
    write: str  # the module whose output is h (the last module before the addition)
    stream: str = ""  # the module whose first input is the stream x ("" = the layer itself)
    context: str = "output"  # c is the stream module's output (pre-norm) or its "input" x
    scale: float = 1.0  # the layer adds scale * h (Granite's residual_multiplier)
    norm_after: str | None = None  # post-LN: the norm applied to x + h (read by the self-check)

    def __post_init__(self):
        _need("a site's name", _TEXT, self.name)
        for field, rule in _SITE_RULES.items():
            _need(f"site {self.name!r}: {field}", rule, getattr(self, field))


@dataclass(frozen=True)
class DeltaSpec:
    """The conversion: which writes of which layers become DDL writes, and how the heads start."""

    layers: str  # path of the decoder layer list, e.g. "model.layers"
    hidden_size: int
    sites: tuple[SiteSpec, ...]
    direction: str = "sublayer"  # k = the sublayer's normalized write (the paper's), or "learned" from c
    rank: int | None = None  # rank of a learned direction (None: a full d x d matrix)
    gate_bias: float = -18.0  # the initial gate logit: beta = 2 sigmoid(-18) = 3e-8
    eps: float = 1e-6  # k = kr / sqrt(|kr|^2 + eps^2)
    gate: str = "logit"  # "strength": alpha = 0 at init turns the correction off, as LoRA's B = 0 does
    channels: int = 1  # d_v: the stream's channels (1: the scalar DDL; > 1: the paper's expanded state)
    erase: bool = True  # False: the write-only control x + m h + alpha beta v k, without DDL's erase term -k^T x

    def __post_init__(self):
        for field, rule in _SPEC_RULES.items():
            _need(field, rule, getattr(self, field))
        if self.rank is not None and self.direction != "learned":
            raise DeltafyError("rank applies only to a learned direction")
        object.__setattr__(self, "sites", tuple(map(_site, self.sites)))
        names = [site.name for site in self.sites]  # (a layer's heads, and its captures, go by the site's name)
        if twice := next((name for name in names if names.count(name) > 1), None):
            raise DeltafyError(f"two sites are named {twice!r}")

    @classmethod
    def from_dict(cls, section: dict) -> DeltaSpec:
        """The spec in a config's ``deltafy`` section (which also holds the recipe and provenance)."""
        _need("the config's deltafy section", _OBJECT, section)
        if missing := _missing(cls, section):
            raise DeltafyError(f"the config's deltafy section has no {missing[0]!r}")
        return cls(**{f.name: section[f.name] for f in fields(cls) if f.name in section})

    def to_dict(self) -> dict:
        return asdict(self) | {"sites": [{k: v for k, v in asdict(s).items() if v is not None} for s in self.sites]}


def _site(site) -> SiteSpec:
    if isinstance(site, SiteSpec):
        return site
    _need("every site", _OBJECT, site)
    unknown, missing = sorted(site.keys() - {f.name for f in fields(SiteSpec)}), _missing(SiteSpec, site)
    if unknown or missing:
        what = f"{unknown[0]!r} is unknown" if unknown else f"{missing[0]!r} is missing"
        raise DeltafyError(f"site {site.get('name')!r}: {what}")
    return SiteSpec(**site)


# -- the math ------------------------------------------------------------------------------------
def ddl_reference(site: DeltaSite, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The stream after ``site``'s write, plainly in float64: what DeltaSite.formula computes fused. With d_v
    channels x is (d_v, ...): each gets h and its own target v_j."""
    w = {name: p.detach().double() for name, p in site.named_parameters()}
    x, c, h, m = x.double(), c.double(), h.double(), site.scale
    c = c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-6)  # the heads read the unit context
    beta = 2 * torch.sigmoid(c @ w["gate.weight"].T + w["gate.bias"]) * w.get("strength", 1.0)
    if site.direction is None:
        kr = m * h
    elif site.direction.rank is None:
        kr = c @ w["direction.proj.weight"].T
    else:
        kr = c @ w["direction.down.weight"].T @ w["direction.up.weight"].T
    k = kr / torch.sqrt((kr * kr).sum(-1, keepdim=True) + site.eps**2)
    xs = x if site.channels > 1 else x.unsqueeze(0)  # (d_v, ..., d): one channel for the scalar DDL
    rms = torch.sqrt((xs * xs).mean(-1, keepdim=True))
    v = (c @ w["target.weight"].T + w["target.bias"]).movedim(-1, 0).unsqueeze(-1) * rms  # v_j per channel
    kx = (k * xs).sum(-1, keepdim=True) if site.erase else 0.0
    out = xs + m * h + beta * (v - kx) * k
    return out if site.channels > 1 else out[0]


# a Python check, not type_as: on the decode path every dispatched call costs microseconds
_like = lambda param, x: param if param.dtype == x.dtype else param.to(x.dtype)  # noqa: E731


class DeltaDirection(nn.Module):
    """Learned direction head k = normalize(W_k c), W_k full or factored as up @ down (rank r)."""

    def __init__(self, hidden_size: int, rank: int | None):
        super().__init__()
        self.rank = rank
        if rank is None:
            self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        else:
            self.down, self.up = nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, hidden_size, bias=False)
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
    """The DDL heads of one write, ``layer.delta[site.name]``: gate, target (per channel), optional direction, alpha."""

    # The one seam for a fast path: where supported, deltafy.fused sets on an instance a function (site, x, c, h) -> h'
    # equal to formula(x, c, h), which reads the parameters on every call.
    fused = None

    def __init__(self, spec: DeltaSpec, site: SiteSpec):
        super().__init__()
        d = self.hidden_size = spec.hidden_size
        self.name, self.where = site.name, f"{site.stream or '(layer)'} -> {site.write}"
        self.eps, self.gate_bias_init, self.channels = float(spec.eps), float(spec.gate_bias), spec.channels
        self.scale, self.context, self.erase = float(site.scale), site.context, spec.erase
        self.gate, self.target = nn.Linear(d, 1), nn.Linear(d, spec.channels)
        self.direction = DeltaDirection(d, spec.rank) if spec.direction == "learned" else None
        # alpha: one element, not a 0-d tensor (FSDP2 shards only parameters of at least one dimension)
        self.strength = nn.Parameter(torch.zeros(1)) if spec.gate == "strength" else None
        self.reset_parameters()
        for module in self.modules():  # our init is final: transformers must not re-initialize these
            module._is_hf_initialized = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.constant_(self.gate.bias, self.gate_bias_init)
        for part in (self.gate.weight, self.target.weight, self.target.bias, self.strength):
            if part is not None:
                nn.init.zeros_(part)
        if self.direction is not None:
            self.direction.reset_parameters()
        if not self.erase:  # alpha beta v k at alpha = v = 0 has no gradient (LoRA at A = B = 0): v = rms(x)
            nn.init.ones_(self.target.bias)

    def extra_repr(self) -> str:
        kind = "sublayer" if self.direction is None else f"learned (rank {self.direction.rank or 'full'})"
        extra = [", gate=strength"] * (self.strength is not None) + [", write-only"] * (not self.erase)
        extra += [f", channels={self.channels}"] * (self.channels > 1)
        return f"{self.where}, direction={kind}, scale={self.scale:g}{''.join(extra)}"

    def heads(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(g, u, 1/|c|) per token in c's precision: gate logit (beta = 2 sigmoid(g)), target (v = u rms(x),
        channels first). Both read the unit context, so an Adam step lr moves them by at most lr sqrt(d) at any
        model's norms; v in RMS units lets one lr fit every scale. Dot products (a matmul of the stacked heads
        costs 8 us more a site on CPU, measured) that promote bf16 weights as they read them (a cast: a kernel)."""
        gate, target = self.gate, self.target
        inv_norm_c = torch.rsqrt(torch.linalg.vecdot(c, c) + 1e-6)
        g = torch.addcmul(gate.bias, (c * gate.weight).sum(-1), inv_norm_c)
        if self.channels == 1:
            return g, torch.addcmul(target.bias, (c * target.weight).sum(-1), inv_norm_c), inv_norm_c
        u = torch.addcmul(target.bias, F.linear(c, _like(target.weight, c)), inv_norm_c.unsqueeze(-1))
        return g, u.movedim(-1, 0), inv_norm_c

    def forward(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The write h' that the layer adds in place of its own h: the fused path where set, else the formula."""
        return self.formula(x, c, h) if self.fused is None else self.fused(self, x, c, h)

    def formula(self, x: torch.Tensor, c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """h' such that ``x + m h'`` is ddl_reference's (x, h': (d_v, ...) with channels), in fp32 or h's wider dtype,
        returned in h's. Dot products, fused multiply-adds, no cast an op does as it reads: decoding pays per op."""
        if torch.is_autocast_enabled(h.device.type):  # autocast would run the heads in bf16/fp16
            with torch.autocast(h.device.type, enabled=False):
                return self.formula(x, c, h)
        dtype, work = h.dtype, torch.promote_types(torch.promote_types(h.dtype, x.dtype), torch.float32)
        if not c.dtype == dtype == work:  # (x is read where the ops reading it promote it: its norm, k.x)
            c, h = c.to(work), h.to(work)
        g, u, inv_norm_c = self.heads(c)
        # k = kr / sqrt(|kr|^2 + eps^2): the sublayer's write (kr = h, m folded into eps) or a learned head
        if self.direction is None:
            kr, eps = h, self.eps / self.scale
        else:
            kr, eps = self.direction(c * inv_norm_c.unsqueeze(-1)), self.eps
        inv_n = torch.rsqrt(torch.linalg.vecdot(kr, kr) + eps * eps)
        # k.x - v, where v = u rms(x) = u |x| / sqrt(d)
        norm_x = torch.linalg.vector_norm(x, dim=-1, dtype=work)
        kx = (kr * x).sum(-1) * inv_n if self.erase else torch.zeros_like(norm_x)  # (write-only: no readout to erase)
        miss = torch.addcmul(kx, u, norm_x, value=-(self.hidden_size**-0.5))
        # x + m h' = x + m h + beta (v - k.x) k  <=>  h' = h - (2 sigmoid(g) / m) (k.x - v) kr / n
        coef = torch.sigmoid(g) * miss * inv_n
        if self.strength is not None:  # alpha = 0 at init: h' = h bitwise
            coef = coef * self.strength
        out = torch.addcmul(h, kr, coef.unsqueeze(-1), value=-2.0 / self.scale)
        return out if out.dtype == dtype else out.to(dtype)


# -- the surgery ---------------------------------------------------------------------------------
# A site's stream and context travel from its capture to its write under the site's name, per thread so that
# concurrent forwards never see each other's. A forward leaves the stash as it found it, and nothing a layer does
# names that layer (no id, no count): torch.compile's guards hold, and a layer compiled alone serves every layer.
class _Stash(threading.local):
    def __init__(self):
        self.sites, self.thread = {}, threading.get_ident()  # (each thread's own, made on its first use)


_STASH = _Stash()
_stash = lambda: _STASH.sites  # noqa: E731
# a module's output is h or a tuple (h, ...)
_output = lambda output: output[0] if isinstance(output, tuple) else output  # noqa: E731
_with_output = lambda output, h: (h, *output[1:]) if isinstance(output, tuple) else h  # noqa: E731


def first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The tensor a module's call received first: the stream, for a decoder layer or a norm."""
    return args[0] if args and isinstance(args[0], torch.Tensor) else kwargs["hidden_states"]


class _SiteCall:
    """The ``forward`` deltafy sets on a module of a site: its own forward (or the wrapper set before ours, e.g.
    accelerate's), then the capture of x and c for the sites whose stream it is and the write h <- site(x, c, h)
    of those whose write it is (OPT's post-LN attention is both). An instance attribute, not hooks: torch.compile
    traces plain code, and a module without hooks keeps torch's fast call path."""

    def __init__(self, module: nn.Module):
        # the module holds this call (its forward): a strong reference back would make a cycle, which only the
        # garbage collector breaks, and a dropped model's weights would stay in (GPU) memory until it ran
        self._module, self.inner = weakref.ref(module), module.__dict__.get("forward")
        self.captures, self.writes, self.enabled = [], [], True  # the sites whose stream, and whose write, it is
        # thread -> it ran in the checkpoint class's forward (a backend that swaps modules skips it); this thread's key
        # from the start and for good, as a compiled graph guards the keys. True, as every call leaves it: a graph
        # that guards the value too (torch 2.11's) holds from its first call (the checkpoint class's forward sets
        # it False before each check)
        self.ran = {_STASH.thread: True}

    module = property(lambda self: self._module())

    def __getstate__(self) -> dict:  # pickle and deepcopy: the module itself, whose copy the copy calls
        return {**self.__dict__, "_module": self.module}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _module=weakref.ref(state["_module"]))

    def _forward(self, *args, **kwargs):
        if self.inner is None:
            module = self.module  # (one dereference of the weak reference a call)
            return type(module).forward(module, *args, **kwargs)
        return self.inner(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self._ran()
        try:
            return self._call(args, kwargs)
        except BaseException:  # a forward that failed halfway (a GPU out of memory) keeps nothing it captured: a
            _stash().clear()  # capture's autograd graph holds the weights, which would outlive the model if kept
            raise

    def _call(self, args: tuple, kwargs: dict):
        output = self._forward(*args, **kwargs)
        return self._sites(args, kwargs, output) if self.enabled else output

    def _ran(self) -> None:  # the checkpoint class's forward, which sets it False first, checks that every write ran
        if self.writes and _STASH.thread in self.ran:  # (a thread's key is made by that forward)
            self.ran[_STASH.thread] = True

    def _sites(self, args: tuple, kwargs: dict, output, channels: torch.Tensor | None = None):
        stash = _stash()
        for site in self.captures:
            x = first_input(args, kwargs)  # (of an expanded stream: the view its channels were read as)
            stash[site.name] = (x if channels is None else channels, x if site.context == "input" else _output(output))
        for site in self.writes:
            if site.name not in stash:
                raise RuntimeError(
                    "a residual write ran before its stream was captured; the site map does not match this "
                    "model's layer code"
                )
            h = site(*stash.pop(site.name), _output(output))
            output = _with_output(output, h.flatten(0, 1) if site.channels > 1 else h)
        return output

    def roles(self) -> list[str]:
        return [f"stream of {s.name}" for s in self.captures] + [f"write of {s.name}" for s in self.writes]

    def extra_repr(self) -> str:  # the module's own and its roles in the sites: print(model) shows the surgery
        roles, own = self.roles(), type(self.module).extra_repr(self.module)
        return ", ".join(filter(None, (own, "deltafy: " + ", ".join(roles) if roles else "")))


def _site_modules(layer: nn.Module, site: SiteSpec) -> tuple[nn.Module, nn.Module]:
    try:
        return (layer.get_submodule(site.stream) if site.stream else layer), layer.get_submodule(site.write)
    except AttributeError as err:
        what = f"site {site.name!r} names a module that {type(layer).__name__} does not have"
        raise DeltafyError(f"{what} ({err})") from err


def apply_deltafy(model: nn.Module, spec: DeltaSpec | dict) -> nn.Module:
    """Attach DDL heads to every site of every decoder layer of ``model`` in place (``spec``: a DeltaSpec or a
    ``deltafy`` config section). All modules are resolved first: a map that does not fit leaves it untouched."""
    spec = spec if isinstance(spec, DeltaSpec) else DeltaSpec.from_dict(spec)
    if getattr(model, "_deltafy_calls", None):
        raise DeltafyError("this model is already converted")
    if spec.channels > 1 and any(site.stream == "" for site in spec.sites):
        raise DeltafyError("an expanded stream needs every site's stream to be a module inside the layer")
    path = spec.layers  # the causal LM's; the bare model (AutoModel) holds the layers below its base_model_prefix
    if getattr(model, "base_model", None) is model:
        path = path.removeprefix(getattr(model, "base_model_prefix", "") + ".")
    try:
        layers = model.get_submodule(path)
    except AttributeError as err:
        raise DeltafyError(f"this model has no decoder layers at {path!r}") from err
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise DeltafyError(f"{path!r} is not a non-empty list of decoder layers")
    plan = [(layer, site, *_site_modules(layer, site)) for layer in layers for site in spec.sites]
    # transformers (>= 5.25) hands the forward of its norms to the kernels library, which would drop ours (at load,
    # and at every train()/eval()): a converted model runs the forwards its modules have now, kernels off
    if getattr(model, "use_kernels", False):
        model.use_kernels = False
    # A model built on the meta device outside a loading context (a streaming conversion) gets real heads,
    # whose init values the conversion writes; inside transformers' loading context they are meta, and loaded.
    ref = next(model.parameters())
    place = {"device": None if ref.is_meta else ref.device, "dtype": ref.dtype}
    make = _SiteCall if spec.channels == 1 else functools.partial(_ExpandedCall, channels=spec.channels)
    calls: dict[int, _SiteCall] = {}

    def call(module: nn.Module, layer: nn.Module) -> _SiteCall:
        if id(module) not in calls:  # each layer lists its calls, for disabled() on a part of the model
            calls[id(module)] = make(module)
            layer.__dict__.setdefault("_deltafy_calls", []).append(calls[id(module)])
        return calls[id(module)]

    for layer, site, stream, write in plan:
        if not hasattr(layer, "delta"):
            layer.delta = nn.ModuleDict()
        delta = layer.delta[site.name] = DeltaSite(spec, site).to(**place)
        call(stream, layer).captures.append(delta)
        call(write, layer).writes.append(delta)
    if spec.channels > 1:
        _expand(layers, [(layer.delta[site.name], call(stream, layer)) for layer, site, stream, _ in plan], call, place)
    for site_call in calls.values():
        # bound: the module's forward is then a method, which torch.compile does not guard by identity
        site_call.module.forward, site_call.module.extra_repr = site_call.__call__, site_call.extra_repr
    model._deltafy_calls = list(calls.values())
    model._deltafy_writes = tuple(site_call for site_call in calls.values() if site_call.writes)
    return model


def remove_deltafy(model: nn.Module) -> nn.Module:
    """Undo apply_deltafy in place: the original forwards back, the heads gone."""
    calls = model.__dict__.pop("_deltafy_calls", None)
    if not calls:
        raise DeltafyError("this model is not converted")
    model.__dict__.pop("_deltafy_writes", None)
    for call in calls:
        if (module := call.module) is None:  # replaced since, and freed
            continue
        module.__dict__.pop("extra_repr", None)
        if getattr(module.__dict__.get("forward"), "__self__", None) is not call:  # a later wrapper still calls ours
            call.__dict__.update(captures=[], writes=[], expand=False, read=None, final=None)  # a pass-through now
        elif call.inner is None:
            del module.forward
        else:
            module.forward = call.inner
    for module in model.modules():
        if isinstance(getattr(module, "delta", None), nn.ModuleDict):
            del module.delta
            module.__dict__.pop("_deltafy_calls", None)
    return model


@contextlib.contextmanager
def disabled(model: nn.Module):
    """Run ``model`` with every DDL correction off (beta = 0 exactly), as peft's disable_adapter() does. ``model``
    may be a part of a converted model that holds whole decoder layers (the decoder, a layer)."""
    calls = list({id(c): c for module in model.modules() for c in module.__dict__.get("_deltafy_calls", ())}.values())
    if not calls:
        raise DeltafyError(
            f"this {type(model).__name__} holds no converted decoder layer; pass a converted model, "
            f"its decoder or one of its layers"
        )
    previous = [call.enabled for call in calls]
    for call in calls:
        call.enabled = False
    try:
        yield model
    finally:
        for call, enabled in zip(calls, previous, strict=True):
            call.enabled = enabled


# -- the expanded state --------------------------------------------------------------------------
class DeltaRead(nn.Module):
    """The view ``sum_j r_j x_j`` of an expanded stream's channels (d_v along dim 0). The weights sum to 1, which
    keeps the scale the pretrained layers were trained on; computed as ``x_0 + sum_{j>0} r_j (x_j - x_0)``,
    channels that agree read as exactly that stream. The weights start distinct, r_j = (2j + 1) / d_v^2 rolled
    ``offset`` places (one more at each read): equal weights would hand the equal channels proportional
    gradients, which Adam turns into identical steps, and the channels would stay copies."""

    def __init__(self, channels: int, offset: int = 0):
        super().__init__()
        if channels < 2:
            raise DeltafyError(f"an expanded stream has at least 2 channels, got {channels}")
        self.channels, self.offset = channels, offset
        self.weight = nn.Parameter(torch.empty(channels - 1))  # r_1 .. r_{d_v-1}; r_0 is the rest
        self.reset_parameters()
        self._is_hf_initialized = True

    @torch.no_grad()
    def reset_parameters(self) -> None:
        r = torch.arange(1, 2 * self.channels, 2, dtype=torch.float64) / self.channels**2
        self.weight.copy_(torch.roll(r, self.offset)[1:])

    def extra_repr(self) -> str:
        return f"channels={self.channels}, offset={self.offset}"

    def forward(self, channels: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(channels.device.type):
            with torch.autocast(channels.device.type, enabled=False):
                return self.forward(channels)
        first = channels[0].to(torch.promote_types(channels.dtype, torch.float32))
        view = first + torch.tensordot(_like(self.weight, first), channels[1:].to(first.dtype) - first, dims=1)
        return view.to(channels.dtype)


_tile = lambda x, channels: x.repeat(channels, *(1,) * (x.dim() - 1))  # noqa: E731


class _ExpandedCall(_SiteCall):
    """A _SiteCall on an expanded stream, whose channels travel stacked on dim 0: the first layer's input becomes
    d_v copies (``expand``), a stream module runs on the view of its ``read`` while its sites see the channels, a
    switched-off write reaches every channel as it is, and the last layer returns the ``final`` view."""

    def __init__(self, module: nn.Module, channels: int):
        super().__init__(module)
        self.channels, self.expand, self.read, self.final = channels, False, None, None

    def _call(self, args: tuple, kwargs: dict):
        channels = None  # the channels, where this module runs on their view
        if self.expand or self.read is not None:
            x = first_input(args, kwargs)
            if self.expand:
                x = _tile(x, self.channels)
            else:
                channels = x.unflatten(0, (self.channels, -1))
                x = self.read(channels)
            if args and isinstance(args[0], torch.Tensor):
                args = (x, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": x}
        output = self._forward(*args, **kwargs)
        if self.enabled:
            output = self._sites(args, kwargs, output, channels)
        elif self.writes:  # switched off: every channel receives the write as it is
            output = _with_output(output, _tile(_output(output), self.channels))
        if self.final is not None:
            output = _with_output(output, self.final(_output(output).unflatten(0, (self.channels, -1))))
        return output

    def roles(self) -> list[str]:
        roles = ["expands the stream"] * self.expand + ["reads the view"] * (self.read is not None)
        return super().roles() + roles + ["final view"] * (self.final is not None)


def _expand(layers: nn.ModuleList, sites: list, call, place: dict) -> None:
    """An expanded stream over converted layers (``sites``: each DeltaSite and its stream's call): the first site to
    read a stream module holds the read weights of its view (parallel sublayers read one view), each read starting
    one place further round than the last; the first layer tiles the stream, the last returns the final view."""
    reads = 0
    for delta, stream in sites:
        if stream.read is None:
            stream.read = delta.read = DeltaRead(stream.channels, reads).to(**place)
            reads += 1
    call(layers[0], layers[0]).expand = True
    last = call(layers[-1], layers[-1])
    last.final = layers[-1].delta["final"] = DeltaRead(last.channels, reads).to(**place)


# -- the checkpoint's classes --------------------------------------------------------------------
# A heads-only (delta) checkpoint stores only the heads, in HEADS_FILE, and names its base in the config's deltafy
# section: {"id", "revision"} on the Hub, or {"path", "sha256"} on disk (a folder or a .gguf file, the path relative
# to the checkpoint folder, the hashes of its weight files). Loaded, it is a full model whose config names no base:
# the record, and where the base was found, are its ``deltafy_base``.
HEADS_FILE = "deltafy_heads.safetensors"
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "proxies", "token")
_PASS_BASE = "--base PATH (deltafy_base=PATH in Python)"  # deltafy's command line, and from_pretrained's keyword


class BaseModelError(DeltafyError, OSError):
    """The base model of a heads-only checkpoint is missing or is not the one it was made from."""


def _not_base(location, why: str) -> BaseModelError:
    return BaseModelError(f"{location} is not the base model this checkpoint was made from: {why}")


def _misfit(source: str, missing: list[str], unexpected: list[str]) -> None:
    if missing or unexpected:
        what = f"lacks the head {missing[0]}" if missing else f"holds {unexpected[0]}, which is not a head"
        raise DeltafyError(f"{source} {what} of this model ({len(missing)} missing, {len(unexpected)} unexpected)")


def check_heads(stored: dict, heads: dict, source: str) -> None:
    """Refuse ``stored`` heads unless they match ``heads`` by name, shape and being floats (any precision: cast),
    before any copy_, which would broadcast a (1,) target over a row of 64 and make floats of integers."""
    _misfit(source, sorted(heads.keys() - stored.keys()), sorted(stored.keys() - heads.keys()))
    for name in sorted(heads):
        got, want = stored[name], heads[name]
        if not got.dtype.is_floating_point:
            raise DeltafyError(f"{name} in {source} holds {got.dtype}, not floats")
        if got.shape != want.shape:
            raise DeltafyError(f"{name} in {source} has shape {tuple(got.shape)}, the model's is {tuple(want.shape)}")


def check_base_record(record) -> dict:
    """The config's record of a heads-only checkpoint's base, refused unless it is a Hub model pinned to a commit or a
    local one with the SHA-256 of its weight files (else any folder at that path would do)."""
    forms = '{"id", "revision"} (a Hub model) or {"path", "sha256"} (a local one)'
    _need("deltafy.base", (lambda v: isinstance(v, dict) and ("id" in v or "path" in v), forms), record)
    if "id" in record:
        _need("deltafy.base.id", _TEXT, record["id"])
        if "revision" not in record:
            raise DeltafyError(f"deltafy.base names the Hub model {record['id']} but no revision to pin it to")
        _need("deltafy.base.revision", (_HEX(40), "a commit (40 hex digits)"), record["revision"])
        return record
    _need("deltafy.base.path", _TEXT, record["path"])
    if "sha256" not in record:
        raise DeltafyError(
            f"deltafy.base names the local model {record['path']} but no sha256 of its weight files, "
            f"which prove it is the base the heads were trained on"
        )
    hashes = record["sha256"]
    if not (isinstance(hashes, dict) and hashes and all(_TEXT[0](k) and _HEX(64)(v) for k, v in hashes.items())):
        raise DeltafyError(
            f"deltafy.base.sha256 must map each weight file's name to its SHA-256 (64 hex digits), got {hashes!r}"
        )
    return record


def base_weight_files(location: Path) -> list[Path]:
    """The files whose hashes pin a local base: a .gguf file itself, or a folder's weight files."""
    if location.is_file():
        return [location]
    weights = (p for p in location.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json"))
    return sorted(p for p in weights if p.is_file())


def sha256_files(paths: list[Path]) -> dict[str, str]:
    hashes = {}
    for path in paths:
        digest = hashlib.sha256()
        with path.open("rb") as fh:
            while block := fh.read(1 << 22):
                digest.update(block)
        hashes[path.name] = digest.hexdigest()
    return hashes


def _base_location(record: dict, folder: Path | None, given) -> tuple[Path | None, str, dict]:
    """The local base (None for the Hub), what to pass from_pretrained and the kwargs that pin it; a local base is
    hash-checked. ``given``: where the user said it is (deltafy_base), or None."""
    if "id" in record and given is None:
        return None, record["id"], {"revision": record["revision"]}
    location = Path(str(given if given is not None else record["path"])).expanduser()
    if given is None and not location.is_absolute() and folder is not None:
        location = folder / location
    if given is None and not location.exists() and record.get("package"):  # a bundled alias's GGUF, in its package
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            files = importlib.metadata.distribution(record["package"]).files or ()
            name = Path(record["path"]).name
            location = next((Path(f.locate()) for f in files if f.name == name), location)
    want = record.get("sha256", {})  # (a local copy of a Hub base has none: _from_base checks what it loads)
    if not location.exists():
        if given is not None:
            raise BaseModelError(f"the base model given for this heads-only checkpoint is not there: {location}")
        raise BaseModelError(
            f"the base model of this heads-only checkpoint was not found at {location} (expected "
            f"{', '.join(want) or record.get('id')}); pass its location with {_PASS_BASE}"
        )
    got = sha256_files(base_weight_files(location)) if want else {}
    show = lambda hashes, name, gone: f"sha256 {hashes[name][:12]}" if name in hashes else gone  # noqa: E731
    for name in sorted(want.keys() | got.keys()):
        if want.get(name) != got.get(name):
            found, expected = show(got, name, "missing"), show(want, name, "no such file")
            raise _not_base(location, f"{name} is {found}, expected {expected}")
    location = location.resolve()
    if location.is_file():  # a .gguf file: transformers dequantizes it
        return location, str(location.parent), {"gguf_file": location.name}
    return location, str(location), {}


def _unloadable(record: dict, location: str, pin: dict, hub: dict, err: BaseException) -> BaseModelError:
    from transformers.utils.hub import is_offline_mode, try_to_load_from_cache

    revision = pin.get("revision")
    pinned = f" at revision {revision}" if revision else ""
    if revision and (hub.get("local_files_only") or is_offline_mode()):
        offline = "local_files_only=True" if hub.get("local_files_only") else "HF_HUB_OFFLINE is set"
        cached = try_to_load_from_cache(location, "config.json", cache_dir=hub.get("cache_dir"), revision=revision)
        if not isinstance(cached, str):  # (None, or a marker that the file is known not to exist)
            return BaseModelError(
                f"the base model {location}{pinned} is not in the local Hugging Face cache and the Hub is offline "
                f"({offline}): go online once to download it, or pass its local folder with {_PASS_BASE}"
            )
    return BaseModelError(
        f"could not load the base model {record.get('id') or location}{pinned} that this heads-only "
        f"checkpoint needs ({first_line(err)})"
    )


def _from_base(cls, stock_class: type, path, config, kwargs: dict):
    """A heads-only checkpoint: the stock base (transformers' own loading, key renames and all), surgery, heads."""
    from safetensors.torch import load_file
    from transformers import GenerationConfig
    from transformers.utils.hub import cached_file, extract_commit_hash

    DeltaSpec.from_dict(config.deltafy)  # a spec that cannot be applied is refused before the base is read
    record = check_base_record(config.deltafy["base"])
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    # the checkpoint's, not the base's (AutoModel passes the checkpoint's revision on as adapter_kwargs)
    own = {k: kwargs.pop(k) for k in ("revision", "subfolder", "adapter_kwargs") if k in kwargs}
    folder = Path(path) if Path(path).is_dir() else None
    local, location, pin = _base_location(record, folder, kwargs.pop("deltafy_base", None))
    with_info = kwargs.pop("output_loading_info", False)
    kwargs.pop("trust_remote_code", None)
    if kwargs.get("dtype", kwargs.get("torch_dtype")) in (None, "auto"):
        kwargs.pop("torch_dtype", None)
        kwargs["dtype"] = config.dtype or "auto"  # the dtype the full checkpoint would load in
    config.model_type = config.deltafy["base_model_type"]  # so transformers applies the family's key renames
    try:
        model, info = stock_class.from_pretrained(location, config=config, output_loading_info=True, **pin, **kwargs)
    except (OSError, ValueError) as err:
        raise _unloadable(record, location, pin, hub, err) from err
    finally:
        config.__dict__.pop("model_type", None)
    model.config.__dict__.pop("model_type", None)
    # none missing (transformers would make it up), none left over in a local copy of a Hub base (it has no hashes)
    if odd := sorted({*info["missing_keys"], *(info["unexpected_keys"] if "id" in record and local else ())}):
        raise _not_base(location, f"{len(odd)} tensors missing or left over (e.g. {odd[0]})")
    if pin.get("revision"):  # the Hub may answer for a pinned commit with another: see where the files landed
        revision = extract_commit_hash(cached_file(location, "config.json", revision=pin["revision"], **hub), None)
        if revision != pin["revision"]:
            raise BaseModelError(f"the base model {location} is at revision {revision}, expected {pin['revision']}")
    if "gguf_file" in pin:  # a .gguf base is fully dequantized: nothing of it is quantized any more
        model.hf_quantizer, model.is_quantized = None, False
    model.__class__ = cls
    apply_deltafy(model, model.config.deltafy)
    # (save_pretrained, a Trainer's save_model, writes it whole; a heads-only save finds the base where this did)
    model.config.deltafy = {k: v for k, v in model.config.deltafy.items() if k != "base"}
    model.deltafy_base = record if local is None else {**record, "location": str(local)}
    stored = load_file(cached_file(str(path), HEADS_FILE, **hub, **own))
    if model.base_model is model:  # the bare model: its names lack the causal LM's prefix
        stored = {k.removeprefix(model.base_model_prefix + "."): v for k, v in stored.items()}
    heads = {name: tensor for name, tensor in model.state_dict().items() if ".delta." in name}
    check_heads(stored, heads, HEADS_FILE)
    with torch.no_grad():
        for name, tensor in heads.items():
            tensor.copy_(stored[name])
    model.config._name_or_path = str(path)
    if model.can_generate():
        with contextlib.suppress(OSError):  # none in the checkpoint: keep the base's
            model.generation_config = GenerationConfig.from_pretrained(str(path), **hub, **own)
    return (model, info) if with_info else model


def deltafy_classes(base_config_class: type, base_model_class: type, bare_model_class: type) -> tuple[type, type, type]:
    """Config, causal-LM and bare-model (AutoModel) classes of a checkpoint, subclassing its base family's: every
    tensor name, generation, tied weights and device maps exactly as transformers does them for it."""

    class DeltafyConfig(base_config_class):
        model_type = "deltafy"

    def _deltafy_class(stock_class: type, name: str) -> type:
        def __init__(self, config, *args, **kwargs):
            stock_class.__init__(self, config, *args, **kwargs)
            apply_deltafy(self, config.deltafy)

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, **kwargs):
            if kwargs.get("use_kernels"):
                raise DeltafyError(
                    "use_kernels=True would replace the forwards of the modules a deltafy model's sites are on "
                    "(its norms): load it without use_kernels"
                )
            kwargs["use_kernels"] = False  # (transformers >= 5.25 turns them on by default: see apply_deltafy)
            if not isinstance(config, base_config_class):
                hub = {k: kwargs[k] for k in (*_HUB_KWARGS, "revision", "subfolder") if k in kwargs}
                config = DeltafyConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
            if "base" in config.deltafy:
                return _from_base(cls, stock_class, pretrained_model_name_or_path, config, kwargs)
            with_info = kwargs.pop("output_loading_info", False)
            model, info = stock_class.from_pretrained.__func__(  # a full checkpoint: the base family's own loading
                cls, pretrained_model_name_or_path, *args, config=config, output_loading_info=True, **kwargs
            )
            # transformers would leave a missing head uninitialized (it is marked initialized) and drop an extra one
            missing, unexpected = (
                [k for k in sorted(info[kind]) if ".delta." in k] for kind in ("missing_keys", "unexpected_keys")
            )
            _misfit(f"the checkpoint {pretrained_model_name_or_path}", missing, unexpected)
            return (model, info) if with_info else model

        def save_pretrained(self, save_directory, *args, **kwargs):
            # the tensors under the names they have here: a family's original names (Mixtral's experts one by one)
            # are not mapped back when a deltafy class loads them
            kwargs.setdefault("save_original_format", False)
            return stock_class.save_pretrained(self, save_directory, *args, **kwargs)

        @functools.wraps(stock_class.forward)  # (generate reads its signature)
        def forward(self, *args, **kwargs):
            calls, thread = self.__dict__.get("_deltafy_writes", ()), _STASH.thread
            for call in calls:
                call.ran[thread] = False
            output = stock_class.forward(self, *args, **kwargs)
            if missed := sum(len(call.writes) for call in calls if not call.ran[thread]):
                # its modules were replaced or bypassed: this was the stock model's forward
                _stash().clear()  # (the captures of the writes that did not run)
                sites = sum(len(call.writes) for call in calls)
                raise DeltafyError(
                    f"only {sites - missed} of this deltafy model's {sites} residual sites ran: something "
                    f"replaced its modules (vLLM's Transformers backend does); run it with transformers "
                    f"(trust_remote_code=True) or vLLM with deltafy's plugin"
                )
            return output

        body = dict(
            config_class=DeltafyConfig,
            __init__=__init__,
            from_pretrained=from_pretrained,
            save_pretrained=save_pretrained,
            forward=forward,
        )
        # transformers picks a class's attention and expert kernels by reading its module's source: not this file,
        # ask the family (else a full MoE checkpoint would run its experts eagerly, rounding unlike grouped_mm)
        for probe in ("_can_set_attn_implementation", "_can_set_experts_implementation"):
            if hasattr(stock_class, probe):
                body[probe] = classmethod(lambda cls, probe=probe: getattr(stock_class, probe)())
        return type(name, (stock_class,), body)

    made = (_deltafy_class(base_model_class, "DeltafyForCausalLM"), _deltafy_class(bare_model_class, "DeltafyModel"))
    for cls in (DeltafyConfig, *made):
        cls.__qualname__, cls.__module__ = cls.__name__, __name__
    return (DeltafyConfig, *made)
