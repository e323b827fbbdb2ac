"""The conversion self-check: the site map is right, and the converted model is the original.

Two proofs run on real activations:

1. *Residual algebra*: with every beta pinned to 0, the stream each site reads, the write each
   site makes and each layer's output must satisfy ``x_next = x + scale*h`` (sequential),
   ``out = x + scale*sum(h)`` (parallel) or ``x_next = norm(x + h)`` (post-LN). A table entry that
   names the wrong module breaks this identity, so conversion fails instead of going ahead.
2. *Invariant* (DESIGN §3): beta = 0 gives bitwise the original logits; the default init stays
   within ``tolerance`` of them; greedy generation with the KV cache is token-for-token the same.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from .errors import DeltafyError
from .modeling_deltafy import _first_tensor, _stash, delta_sites, set_forced_beta

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
    generated: torch.Tensor


@dataclass
class CheckReport:
    max_abs_dlogits: float
    beta_zero_bitwise: bool
    greedy_tokens: int
    greedy_identical: bool
    tolerance: float
    layout: str

    @property
    def passed(self) -> bool:
        return self.beta_zero_bitwise and self.greedy_identical and self.max_abs_dlogits <= self.tolerance

    def to_dict(self) -> dict:
        return asdict(self) | {"passed": self.passed}


@contextmanager
def forced_beta(model: nn.Module, value: float | None):
    previous = [site.force_beta for _, site in delta_sites(model)]
    set_forced_beta(model, value)
    try:
        yield
    finally:
        for (_, site), old in zip(delta_sites(model), previous, strict=True):
            site.force_beta = old


def make_inputs(model: nn.Module, tokenizer=None, prompts=PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """A small left-padded batch: real prompts when a tokenizer is at hand, random ids otherwise."""
    device = next(model.parameters()).device
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
    was_training = model.training
    model.eval()
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
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
def check_site_map(model: nn.Module, input_ids: torch.Tensor, attention_mask=None, rtol: float = 1e-3) -> None:
    """Prove on real activations that every site reads the stream and writes what is added to it."""
    spec = model.config.deltafy
    layers = model.get_submodule(spec["layers"])
    seen: dict[tuple[int, str], list] = {}
    handles = []

    # Copies, not references: some layers add in place into what a write returned (Falcon's
    # ``mlp_output += attention_output``).
    def recorder(key, kind):
        def pre(module, args, kwargs):
            seen.setdefault(key + (kind,), []).append(_first_tensor(args, kwargs).clone())

        def post(module, args, output):
            seen.setdefault(key + (kind,), []).append((output[0] if isinstance(output, tuple) else output).clone())

        return pre, post

    for i, layer in enumerate(layers):
        pre, post = recorder((i, ""), "in")
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        pre, post = recorder((i, ""), "out")
        handles.append(layer.register_forward_hook(post))
        for site in spec["sites"]:
            stream = layer.get_submodule(site["stream"]) if site.get("stream") else layer
            pre, _ = recorder((i, site["name"]), "x")
            handles.append(stream.register_forward_pre_hook(pre, with_kwargs=True))
            _, post = recorder((i, site["name"]), "h")
            # the write after the correction, which is exactly h at beta=0
            handles.append(layer.get_submodule(site["write"]).register_forward_hook(post))
    was_training = model.training
    model.eval()
    try:
        with forced_beta(model, 0.0):
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    except RuntimeError as err:  # a write before its stream, or a write of the wrong width
        _stash().clear()
        raise DeltafyError(
            f"site map for {spec['base_model_type']!r} does not fit this model: "
            f"{str(err).removeprefix('deltafy: ').splitlines()[0]}"
        ) from None
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

    def expect(actual, expected, what):
        err = (actual - expected).abs().max().item()
        scale = expected.abs().max().item() + 1.0
        if not err <= rtol * scale:
            raise DeltafyError(
                f"site map for {spec['base_model_type']!r} does not fit this model: {what} is off "
                f"by {err:.3g}; deltafy will not convert a model whose residual writes it cannot find"
            )

    for i, layer in enumerate(layers):
        x_in, out = one(i, "", "in"), one(i, "", "out")
        sites = spec["sites"]
        if spec["parallel"]:
            total = x_in.clone()
            for site in sites:
                expect(one(i, site["name"], "x"), x_in, f"layer {i} {site['name']} stream")
                total = total + site["scale"] * one(i, site["name"], "h")
            expect(out, total, f"layer {i} output")
            continue
        expect(one(i, sites[0]["name"], "x"), x_in, f"layer {i} {sites[0]['name']} stream")
        for j, site in enumerate(sites):
            x, h = one(i, site["name"], "x"), one(i, site["name"], "h")
            nxt = x + site["scale"] * h
            if site.get("norm_after"):
                nxt = layer.get_submodule(site["norm_after"])(nxt.to(out.dtype)).float()
            if j + 1 < len(sites):
                expect(one(i, sites[j + 1]["name"], "x"), nxt, f"layer {i} {sites[j + 1]['name']} stream")
            else:
                expect(out, nxt, f"layer {i} output")


@torch.no_grad()
def self_check(model, reference: Reference, tolerance: float = 1e-3) -> CheckReport:
    """Compare a freshly converted ``model`` with the original's recorded ``reference``."""
    was_training = model.training
    model.eval()
    try:
        check_site_map(model, reference.input_ids, reference.attention_mask)
        kwargs = dict(input_ids=reference.input_ids, attention_mask=reference.attention_mask)
        with forced_beta(model, 0.0):
            zero = model(**kwargs).logits.float()
        logits = model(**kwargs).logits.float()
        n_new = reference.generated.shape[1] - int(reference.attention_mask[0].sum())
        generated = model.generate(
            input_ids=reference.generated[:, : reference.generated.shape[1] - n_new],
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
    finally:
        model.train(was_training)
    return CheckReport(
        max_abs_dlogits=(logits - reference.logits).abs().max().item(),
        beta_zero_bitwise=torch.equal(zero, reference.logits),
        greedy_tokens=n_new,
        greedy_identical=torch.equal(generated, reference.generated),
        tolerance=tolerance,
        layout=model.config.deltafy["layout"],
    )
