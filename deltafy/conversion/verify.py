"""The conversion self-check: the site map is right, and the converted model is the original.

Two proofs run on real activations:

1. *Residual algebra*: the stream each site reads, the write each site makes (after its
   correction) and each layer's output must satisfy ``x_next = x + scale*h`` (sequential),
   ``out = x + scale*sum(h)`` (parallel) or ``x_next = norm(x + h)`` (post-LN). A table entry that
   names the wrong module breaks this identity, so conversion fails instead of going ahead.
2. *Invariant*: with every correction off (deltafy.disabled) the logits are bitwise the original's;
   the default init stays within ``logit_tolerance`` of them; greedy generation with the KV cache
   is token-for-token the same.

Both compare in the model's own dtype: fp32, bf16 and fp16 checkpoints convert as they are.
``layerwise_self_check`` runs the same proofs on a model too big to load, one decoder layer in
memory at a time (deltafy.conversion.lazy), all but greedy generation, which would read the whole model once
per token.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace

import torch
from torch import nn

from ..errors import DeltafyError, first_line
from ..modeling_deltafy import apply_deltafy, disabled, first_input
from ..options import SELF_CHECK_TOLERANCE
from ..placement import input_device

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Deep learning models are trained by",
)


@dataclass
class Reference:
    """What the original model produced, recorded before surgery."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits: torch.Tensor
    generated: torch.Tensor | None  # None: no generation recorded, and none compared


FULL, LAYER_BY_LAYER = "full", "layer by layer"


@dataclass
class CheckReport:
    max_abs_dlogits: float
    beta_zero_bitwise: bool
    greedy_tokens: int
    greedy_identical: bool | None  # None: not checked (layer by layer, see layerwise_self_check)
    tolerance: float  # the one applied: see logit_tolerance
    layout: str
    dtype: str = "float32"  # the precision the model was converted and checked in
    mode: str = FULL  # how the model was run: whole in memory, or one decoder layer at a time

    @property
    def passed(self) -> bool:
        """Every check that ran passed; a check that did not run (greedy_identical None) is no failure."""
        return self.beta_zero_bitwise and self.greedy_identical is not False and self.max_abs_dlogits <= self.tolerance

    def to_dict(self) -> dict:
        unchecked = {"not_checked": ["greedy generation"]} if self.greedy_identical is None else {}
        return asdict(self) | unchecked | {"passed": self.passed}


def make_inputs(model: nn.Module, tokenizer=None, prompts=PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """A small left-padded batch: real prompts when a tokenizer is at hand, random ids otherwise.
    Where its input embeddings compute, or the CPU for a model on the meta device (run by deltafy.conversion.lazy)."""
    device = input_device(model)
    if device.type == "meta":
        device = torch.device("cpu")
    if tokenizer is not None:
        tok = tokenizer
        pad_side, pad_token = tok.padding_side, tok.pad_token
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        try:
            batch = tok(list(prompts), return_tensors="pt", padding=True)
        finally:
            tok.padding_side, tok.pad_token = pad_side, pad_token
        return batch["input_ids"].to(device), batch["attention_mask"].to(device)
    vocab = model.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (len(prompts), 12), generator=gen)
    return ids.to(device), torch.ones_like(ids)


@torch.no_grad()
def record_reference(model, input_ids, attention_mask, new_tokens: int = 32) -> Reference:
    """The original's logits on the batch and, unless ``new_tokens`` is 0, its greedy continuation
    of the first prompt."""
    was_training = model.training
    model.eval()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    generated = None
    if new_tokens:
        generated = model.generate(
            input_ids=input_ids[:1, attention_mask[0].bool()],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    model.train(was_training)
    return Reference(input_ids, attention_mask, logits, generated)


@torch.no_grad()
def check_site_map(model: nn.Module, input_ids: torch.Tensor, attention_mask=None, ulps: float = 4.0) -> torch.Tensor:
    """Prove on real activations that every site reads the stream and writes what is added to it.

    Returns the logits (fp32) of the forward that proved it: the model's logits as converted. Only
    tensors recorded during that forward are read afterwards, never a module, so a model run one
    layer at a time (deltafy.conversion.lazy) is proved the same way."""
    spec = model.config.deltafy
    layers = model.get_submodule(spec["layers"])
    seen: dict[tuple[int, str], list] = {}
    handles = []

    # Copies, not references: some layers add in place into what a write returned (Falcon's
    # ``mlp_output += attention_output``).
    def recorder(key, kind):
        def pre(module, args, kwargs):
            seen.setdefault(key + (kind,), []).append(first_input(args, kwargs).clone())

        def post(module, args, output):
            seen.setdefault(key + (kind,), []).append((output[0] if isinstance(output, tuple) else output).clone())

        return pre, post

    channels = spec.get("channels", 1)
    for i, layer in enumerate(layers):
        pre, post = recorder((i, ""), "in")
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        pre, post = recorder((i, ""), "out")
        if channels > 1 and i == len(layers) - 1:  # the stream's channels, before the final read's view
            handles.append(layer.delta["final"].register_forward_pre_hook(pre, with_kwargs=True))
        else:
            handles.append(layer.register_forward_hook(post))
        for site in spec["sites"]:
            stream = layer.get_submodule(site["stream"]) if site.get("stream") else layer
            pre, _ = recorder((i, site["name"]), "x")
            handles.append(stream.register_forward_pre_hook(pre, with_kwargs=True))
            _, post = recorder((i, site["name"]), "h")
            # the write after its correction: what the layer adds
            handles.append(layer.get_submodule(site["write"]).register_forward_hook(post))
            if site.get("norm_after"):  # post-LN: what the norm read (x + h, rounded) and what it made
                norm = layer.get_submodule(site["norm_after"])
                pre, post = recorder((i, site["name"]), "sum")
                handles.append(norm.register_forward_pre_hook(pre, with_kwargs=True))
                pre, post = recorder((i, site["name"]), "normed")
                handles.append(norm.register_forward_hook(post))
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    except RuntimeError as err:  # a write before its stream, or a write of the wrong width
        raise DeltafyError(
            f"site map for {spec['base_model_type']!r} does not fit this model: {first_line(err)}"
        ) from err
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()

    def one(i, name, kind):
        values = seen.get((i, name, kind), [])
        if len(values) != 1:
            raise DeltafyError(
                f"site map for {spec['base_model_type']!r} does not fit this model: layer {i} "
                f"{name or 'output'} {kind} ran {len(values)} times per forward (expected once)"
            )
        return values[0].float().reshape(-1, values[0].shape[-1])

    # One unit in the last place of the model's dtype, relative: the rounding of one addition there.
    dtype = next(model.parameters()).dtype
    ulp = torch.finfo(dtype).eps

    def expect(actual, expected, magnitude, what):
        """``actual`` (the model's tensor) equals ``expected`` (recomputed in fp32 from the recorded
        terms) up to ``ulps`` roundings of ``magnitude``, the sum of the terms' absolute values."""
        err = (actual - expected).abs()
        allowed = ulps * ulp * magnitude + torch.finfo(torch.float32).tiny
        if not (err <= allowed).all():
            worst = (err - allowed).argmax()
            raise DeltafyError(
                f"site map for {spec['base_model_type']!r} does not fit this model: {what} is off "
                f"by {err.flatten()[worst].item():.3g} (rounding allows {allowed.flatten()[worst].item():.2g}); "
                f"deltafy will not convert a model whose residual writes it cannot find"
            )

    for i in range(len(layers)):
        x_in, out = one(i, "", "in"), one(i, "", "out")
        if i == 0 and channels > 1:  # the stream's channels start as copies of the first layer's input
            x_in = x_in.repeat(channels, 1)
        sites = spec["sites"]
        if spec["parallel"]:
            total, magnitude = x_in.clone(), x_in.abs()
            for site in sites:
                expect(one(i, site["name"], "x"), x_in, x_in.abs(), f"layer {i} {site['name']} stream")
                write = site["scale"] * one(i, site["name"], "h")
                total, magnitude = total + write, magnitude + write.abs()
            expect(out, total, magnitude, f"layer {i} output")
            continue
        expect(one(i, sites[0]["name"], "x"), x_in, x_in.abs(), f"layer {i} {sites[0]['name']} stream")
        for j, site in enumerate(sites):
            x, h = one(i, site["name"], "x"), one(i, site["name"], "h")
            nxt = x + site["scale"] * h
            magnitude = x.abs() + (site["scale"] * h).abs()
            if site.get("norm_after"):  # the norm reads x + h; what follows reads the norm's output
                expect(one(i, site["name"], "sum"), nxt, magnitude, f"layer {i} {site['norm_after']} input")
                nxt = one(i, site["name"], "normed")
                magnitude = nxt.abs()
            if j + 1 < len(sites):
                expect(one(i, sites[j + 1]["name"], "x"), nxt, magnitude, f"layer {i} {sites[j + 1]['name']} stream")
            else:
                expect(out, nxt, magnitude, f"layer {i} output")
    return logits


# In bf16/fp16 a correction below half an ulp of h rounds away (the default init is bitwise the
# original there), but once one element rounds the other way the change spreads through the network:
# SmolLM2-135M's logits then move by 1.6-2.7 eps*max|logits| (both dtypes, gate logits -16 to -12,
# where fp32 moves them by < 0.01). The dtype itself is 4.7 (bf16) and 8.1 (fp16) eps*max|logits|
# away from fp32. So below 4 eps*max|logits| a change is rounding, not behaviour.
LOGIT_ULPS = 4.0


def logit_tolerance(
    dtype: torch.dtype, reference_logits: torch.Tensor, tolerance: float = SELF_CHECK_TOLERANCE
) -> float:
    """The largest |Δlogits| the self-check accepts: ``tolerance`` in fp32 (and wider types); in
    bf16/fp16, whose logits are themselves rounded at eps*|logit| (a bf16 logit of 32 moves in steps
    of 0.25), at least LOGIT_ULPS * eps * max|reference logits|."""
    eps = torch.finfo(dtype).eps
    if eps <= torch.finfo(torch.float32).eps:
        return tolerance
    return max(tolerance, LOGIT_ULPS * eps * reference_logits.abs().max().item())


@torch.no_grad()
def self_check(model, reference: Reference, tolerance: float = SELF_CHECK_TOLERANCE) -> CheckReport:
    """Compare a freshly converted ``model`` with the original's recorded ``reference``.

    ``tolerance`` bounds max |Δlogits| in fp32; bf16/fp16 models get at least their logits' own
    rounding (logit_tolerance). The report records the bound applied and the dtype. Greedy
    generation is compared when the reference recorded one (``greedy_identical`` None otherwise).
    """
    dtype = next(model.parameters()).dtype
    was_training = model.training
    model.eval()
    n_new, greedy_identical = 0, None
    try:
        # the site map's forward is the converted model's (its logits equal a plain forward's), so
        # a model run from disk is read twice here, not three times
        logits = check_site_map(model, reference.input_ids, reference.attention_mask)
        with disabled(model):
            zero = model(input_ids=reference.input_ids, attention_mask=reference.attention_mask).logits.float()
        if reference.generated is not None:
            n_new = reference.generated.shape[1] - int(reference.attention_mask[0].sum())
            generated = model.generate(
                input_ids=reference.generated[:, : reference.generated.shape[1] - n_new],
                max_new_tokens=n_new,
                min_new_tokens=n_new,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
            greedy_identical = torch.equal(generated, reference.generated)
    finally:
        model.train(was_training)
    return CheckReport(
        max_abs_dlogits=(logits - reference.logits).abs().max().item(),
        beta_zero_bitwise=torch.equal(zero, reference.logits),
        greedy_tokens=n_new,
        greedy_identical=greedy_identical,
        tolerance=logit_tolerance(dtype, reference.logits, tolerance),
        layout=model.config.deltafy["layout"],
        dtype=str(dtype).removeprefix("torch."),
    )


def layerwise_self_check(
    config,
    spec: dict,
    heads: Mapping[str, torch.Tensor],
    weights,
    tokenizer=None,
    tolerance: float = SELF_CHECK_TOLERANCE,
    progress: Callable[[int, int], None] | None = None,
    dtype: torch.dtype | None = None,
) -> CheckReport:
    """self_check for a model that is never whole in memory: one decoder layer at a time.

    ``config``: the stock model's transformers config; ``spec``: the converted config's ``deltafy``
    section; ``heads``: the DDL heads' tensors by state-dict name, as the converted model holds
    them; ``weights``: the original's tensors on disk (see deltafy.conversion.lazy.layer_by_layer); ``dtype``:
    the one to check in (default the config's). The stock model's logits are recorded, the heads
    attached, then the site map, β = 0 bitwise and max |Δlogits| at the init gate are proved as in
    memory. Greedy generation is not compared (it would read the whole model once per token): the
    report says so (``mode`` "layer by layer", ``greedy_identical`` None).
    ``progress(done, total)`` counts decoder layers run, over the three forwards.
    """
    from .lazy import assign, empty_model, is_head, layer_by_layer

    model = empty_model(copy.deepcopy(config), dtype)
    n_layers = len(model.get_submodule(spec["layers"]))
    steps = 0

    def step(done, total):
        nonlocal steps
        steps += 1
        if progress is not None:
            progress(steps, 3 * n_layers)  # the reference, the site map's forward, and β = 0

    inputs = make_inputs(model, tokenizer)
    with torch.no_grad(), layer_by_layer(model, weights, layers=spec["layers"], progress=step):
        reference = record_reference(model, *inputs, new_tokens=0)
    apply_deltafy(model, spec)
    model.config.deltafy = spec
    slots = {name: t for name, t in model.state_dict(keep_vars=True).items() if is_head(name)}
    if unknown := sorted(set(heads) - set(slots)):
        raise DeltafyError(f"{unknown[0]} is not a DDL head of this model ({len(unknown)} such names)")
    with torch.no_grad():
        for name, tensor in heads.items():
            assign(model, name, tensor.detach().to(device="cpu", dtype=slots[name].dtype, copy=True))
    with layer_by_layer(model, weights, layers=spec["layers"], progress=step):
        report = self_check(model, reference, tolerance)
    return replace(report, mode=LAYER_BY_LAYER)
