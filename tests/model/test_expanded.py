"""The expanded state (recipe ddl-expanded, d_v channels): the original model at init in every family,
a genuinely d x d_v stream once trained, and cached decoding equal to full forwards."""

from __future__ import annotations

import pytest
import torch
from helpers.models import open_gates, tiny_model

import deltafy
from deltafy.conversion.verify import make_inputs, record_reference, self_check
from deltafy.modeling_deltafy import DeltaRead, DeltaSpec
from deltafy.surgery import delta_sites, delta_tensors, head_parameter_groups, summarize

NEW_TOKENS = 32


def _expanded(case: str, dtype=torch.float32, seed: int = 0):
    model = tiny_model(case, seed=seed).to(dtype)
    reference = record_reference(model, *make_inputs(model), new_tokens=NEW_TOKENS)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return deltafy.convert(model, "ddl-expanded"), reference, original


def _open(model, seed: int = 0) -> None:
    """Heads with a visible effect, and read weights that differ from their init."""
    open_gates(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DeltaRead):
                module.weight.copy_(torch.rand(module.weight.shape, generator=gen) / module.channels)


def test_every_family_converts_to_the_original_bitwise(case):
    model, reference, original = _expanded(case)
    report = self_check(model, reference)
    assert report.passed and report.beta_zero_bitwise, report
    assert report.max_abs_dlogits == 0.0  # a zero strength: not close, the same
    assert report.greedy_identical and report.greedy_tokens == NEW_TOKENS
    # every pretrained tensor is there unchanged; the new ones are the heads and the reads
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in original.items())
    added = set(state) - set(original)
    assert added == set(delta_tensors(model)) and all(".delta." in k for k in added)
    layers = model.get_submodule(model.config.deltafy["layers"])
    assert isinstance(layers[-1].delta["final"], DeltaRead)
    for _, site in delta_sites(model):
        assert site.target.out_features == 4 and site.channels == 4


def test_every_family_decodes_from_its_cache_as_a_full_forward_computes(case):
    """With open heads and moved reads (so the channels differ and every read matters), the logits of
    greedy decoding with the KV cache equal those of full forwards over the generated text."""
    model, reference, _ = _expanded(case)
    _open(model)
    ids, mask = reference.input_ids[:1], reference.attention_mask[:1]
    prompt = int(mask.sum())
    ids = ids[:, :prompt]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        cached = torch.stack(out.logits, 1)
        full = model(input_ids=out.sequences, use_cache=False).logits[:, prompt - 1 : -1]
        with deltafy.disabled(model):
            stock = model(input_ids=out.sequences, use_cache=False).logits[:, prompt - 1 : -1]
    scale = stock.abs().max()
    assert (full - stock).abs().max() > 0.02 * scale, "the heads had no effect; the comparison would be trivial"
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_conversion_is_the_original_bitwise(case, dtype):
    model, reference, _ = _expanded(case, dtype)
    report = self_check(model, reference)
    assert report.passed and report.beta_zero_bitwise and report.max_abs_dlogits == 0.0, report
    assert next(model.parameters()).dtype == dtype


def _channels(model, ids) -> torch.Tensor:
    """The stream's channels after the first layer, shaped (d_v, batch, seq, d)."""
    seen = []
    layer = model.get_submodule(model.config.deltafy["layers"])[0]
    handle = layer.register_forward_hook(lambda m, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        handle.remove()
    return seen[0].unflatten(0, (model.config.deltafy["channels"], -1))


def _train_heads(model, ids, steps=6):
    for p in model.parameters():
        p.requires_grad_(False)
    groups = head_parameter_groups(model)
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    optimizer = torch.optim.AdamW(groups)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    return loss.item()


def test_training_makes_the_channels_differ_and_leaves_the_pretrained_tensors_alone():
    model, _, original = _expanded("llama-untied")
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    assert all(torch.equal(c, _channels(model, ids)[0]) for c in _channels(model, ids))  # copies at init
    reads = {n: p.detach().clone() for n, p in model.named_parameters() if "read" in n or "final" in n}
    _train_heads(model, ids, steps=20)
    channels = _channels(model, ids)
    spread = (channels - channels[0]).abs().amax()  # 1.9e-3 of the stream after 20 steps
    assert spread > 1e-3 * channels.abs().amax(), "the channels are still copies: the state never expanded"
    assert _target_spread(model) > 0.3  # each channel's target head its own (0.40-0.62 here)
    # a read per sublayer's stream module (2 layers) and the final one; all of them train but the
    # first layer's first, which reads d_v copies of the embedding (its gradient is exactly zero)
    assert len(reads) == 2 * 2 + 1
    moved = sorted(n for n, p in model.named_parameters() if n in reads and not torch.equal(p, reads[n]))
    assert moved == sorted(set(reads) - {"model.layers.0.delta.attn.read.weight"})
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in original.items()), "heads-only training moved a pretrained tensor"


def test_equal_read_weights_would_keep_the_channels_copies():
    """Why the reads start distinct: equal weights hand every channel the same gradient, so training
    keeps the d_v channels identical and the expanded state is the scalar one at d_v times the cost."""
    model, _, _ = _expanded("llama-untied")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DeltaRead):
                module.weight.fill_(1 / module.channels)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    _train_heads(model, ids, steps=20)
    channels = _channels(model, ids)  # equal but for rounding (2e-7 of the stream)
    assert (channels - channels[0]).abs().amax() <= 1e-5 * channels.abs().amax()


def _target_spread(model) -> float:
    """How far the channels' target heads are apart: min over channels j > 0 of |w_j - w_0| / |w_j|,
    at the second layer's attention site (where the gradients are well above Adam's eps)."""
    weight = model.get_submodule(model.config.deltafy["layers"])[1].delta["attn"].target.weight
    return ((weight[1:] - weight[0]).norm(dim=1) / weight[1:].norm(dim=1)).min().item()


def test_the_same_weights_at_every_read_keep_the_targets_in_lockstep():
    """Why each read starts one place further round: with the same weights at every read, channel
    j's gradient is r_j times a common one, and Adam takes the same step for every channel."""
    model, _, _ = _expanded("llama-untied")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, DeltaRead):
                module.offset = 0
                module.reset_parameters()
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))
    _train_heads(model, ids, steps=20)
    assert _target_spread(model) < 0.1  # 0.045-0.053: the same step but for Adam's eps


def test_reads_start_distinct_and_sum_to_one():
    read = DeltaRead(4)
    weights = torch.cat([1 - read.weight.sum(0, keepdim=True), read.weight.detach()])
    assert torch.equal(weights, torch.tensor([1, 3, 5, 7]) / 16)
    # each read of a model one place further round than the last
    model, _, _ = _expanded("llama-untied")
    reads = [m for m in model.modules() if isinstance(m, DeltaRead)]
    assert [m.offset for m in reads] == list(range(5))
    assert torch.equal(reads[1].weight.detach(), torch.tensor([1, 3, 5]) / 16)  # (7, 1, 3, 5) / 16
    # the view of agreeing channels is that stream, bitwise, whatever the weights
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        read.weight.copy_(torch.tensor([0.31, -0.7, 0.123]))
    assert torch.equal(read(x.expand(4, 3, 5, 8)), x)
    # and otherwise the weighted sum of the channels
    channels = torch.randn(4, 3, 5, 8)
    expected = torch.einsum("j,j...->...", torch.cat([1 - read.weight.sum(0, keepdim=True), read.weight]), channels)
    torch.testing.assert_close(read(channels), expected.detach())


def test_summary_counts_the_reads_and_the_extra_stream():
    model, _, _ = _expanded("llama-untied")
    summary = summarize(model)
    d = model.config.hidden_size
    assert summary.channels == 4 and summary.extra_stream_values == 3 * d
    sites = 2 * model.config.num_hidden_layers
    reads = 2 * model.config.num_hidden_layers * 3 + 3  # a read per site and the final one, 3 weights each
    # per site: the gate (d + 1), the target (4 (d + 1)) and the strength
    assert summary.params_added == sites * ((d + 1) + 4 * (d + 1) + 1) + reads


def test_spec_refuses_a_bad_channel_count():
    with pytest.raises(ValueError, match="channels must be a positive integer"):
        DeltaSpec(layers="model.layers", hidden_size=8, sites=(), channels=0)


def test_saved_checkpoint_says_what_the_stream_carries(tmp_path):
    model, _, _ = _expanded("llama-tied")
    deltafy.save(model, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "expanded state: the residual stream carries 4 channels (4 × 64 values per token)" in card
    assert deltafy.load_recipe(str(tmp_path / "out" / "recipe.yaml")).channels == 4


def test_a_site_read_at_the_layer_input_is_refused_before_anything_is_attached():
    from dataclasses import replace

    from deltafy.modeling_deltafy import apply_deltafy
    from deltafy.surgery import build_spec

    model = tiny_model("llama-untied")
    spec = DeltaSpec.from_dict(build_spec(model.config, deltafy.load_recipe("ddl-expanded")))
    spec = replace(spec, sites=(replace(spec.sites[0], stream=""), *spec.sites[1:]))
    before = dict(model.state_dict())
    with pytest.raises(ValueError, match="every site's stream to be a module inside the layer"):
        apply_deltafy(model, spec)
    assert model.state_dict().keys() == before.keys() and not getattr(model, "_deltafy_calls", None)
