"""Every supported family converts to a model that is the original, with live heads at every site.

Each tiny model is built, recorded and converted once per module (``_converted``) and shared by the
tests below; tests that change a model's heads restore them.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import TINY_CASES, tiny_config, tiny_model
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from deltafy import DeltafyError, convert, load_recipe
from deltafy.architectures import ARCHITECTURES, SUPPORTED, layout_for
from deltafy.convert import build_spec, is_converted
from deltafy.modeling_deltafy import DeltaSite, apply_deltafy, delta_sites, mean_betas, set_forced_beta
from deltafy.verify import Reference, check_site_map, forced_beta, make_inputs, record_reference, self_check

NEW_TOKENS = 32
LEARNED_CASES = ["llama-tied", "gpt2", "gpt_neox-parallel", "opt-post-ln", "gemma2", "granite", "falcon-new-2ln"]


@dataclass
class Converted:
    model: torch.nn.Module
    original: dict[str, torch.Tensor]  # state_dict of the model before conversion (cloned)
    original_names: list[str]  # named_parameters before conversion
    tied: bool
    reference: Reference


@pytest.fixture(scope="module")
def _cache():
    return {}


@pytest.fixture()
def converted(_cache):
    def get(case: str, recipe: str | None = None) -> Converted:
        key = (case, recipe)
        if key not in _cache:
            model = tiny_model(case)
            original = {k: v.detach().clone() for k, v in model.state_dict().items()}
            names = [n for n, _ in model.named_parameters()]
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            reference = record_reference(model, *make_inputs(model), new_tokens=NEW_TOKENS)
            convert(model, recipe)
            _cache[key] = Converted(model, original, names, tied, reference)
        entry = _cache[key]
        assert all(site.force_beta is None for _, site in delta_sites(entry.model)), "a test leaked force_beta"
        return entry

    return get


def _logits(model, reference: Reference) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=reference.input_ids, attention_mask=reference.attention_mask).logits.float()


def _assert_self_check(entry: Converted):
    report = self_check(entry.model, entry.reference)
    assert report.beta_zero_bitwise, "beta = 0 must give bitwise the original logits"
    assert report.max_abs_dlogits <= 1e-3, report
    assert report.greedy_tokens == NEW_TOKENS
    assert report.greedy_identical, "greedy generation with the KV cache changed"
    assert report.passed


# -- every family ------------------------------------------------------------------------------


def test_self_check_passes(case, converted):
    _assert_self_check(converted(case))


def test_sites_and_original_parameters(case, converted):
    entry = converted(case)
    model = entry.model
    spec = model.config.deltafy
    layers = model.get_submodule(spec["layers"])
    n_layers = model.config.num_hidden_layers
    assert len(layers) == n_layers

    sites = list(delta_sites(model))
    assert len(sites) == n_layers * 2
    assert [s["name"] for s in spec["sites"]] == ["attn", "mlp"]
    expected_names = {f"{spec['layers']}.{i}.delta.{name}" for i in range(n_layers) for name in ("attn", "mlp")}
    assert {name for name, _ in sites} == expected_names

    # every original tensor is still there, under its name, bitwise unchanged
    state = model.state_dict()
    for key, tensor in entry.original.items():
        assert key in state, f"original tensor {key} disappeared"
        assert state[key].dtype == tensor.dtype and torch.equal(state[key], tensor), key
    # the only new tensors are the heads'
    new_keys = set(state) - set(entry.original)
    head_keys = {f"{name}.{p}" for name, site in sites for p in site.state_dict()}
    assert new_keys == head_keys
    params = dict(model.named_parameters())
    assert set(entry.original_names) <= set(params)
    assert {n for n in params if n not in entry.original_names} == {
        f"{name}.{p}" for name, site in sites for p, _ in site.named_parameters()
    }
    # tying is preserved
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == entry.tied


def test_forced_beta_one_changes_logits_at_every_site(case, converted):
    entry = converted(case)
    model, reference = entry.model, entry.reference
    scale = reference.logits.abs().max().item()
    set_forced_beta(model, 1.0)
    try:
        betas = mean_betas(model, lambda: _logits(model, reference))
        changed = _logits(model, reference)
    finally:
        set_forced_beta(model, None)
    # every site's write hook ran, exactly with the forced beta
    assert len(betas) == 2 * model.config.num_hidden_layers
    assert all(b == 1.0 for b in betas.values()), betas
    diff = (changed - reference.logits).abs().max().item()
    assert diff > 0.02 * scale, f"beta = 1 moved the logits by only {diff:.3g} (logit scale {scale:.3g})"
    # and releasing the force restores the original model
    assert (_logits(model, reference) - reference.logits).abs().max() <= 1e-3


PARALLEL_CASES = {
    "phi",
    "gptj",
    "cohere",
    "gpt_neox-parallel",
    "falcon-new-2ln",
    "falcon-new-1ln",
    "falcon-parallel",
    "stablelm-parallel",
}


def test_layout_matches_config(case):
    model_type, _ = TINY_CASES[case]
    layout = layout_for(tiny_config(case))
    assert layout.parallel == (case in PARALLEL_CASES), (case, layout)
    assert [site.name for site in layout.sites] == ["attn", "mlp"]
    assert model_type in SUPPORTED


# -- the learned recipe ------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", LEARNED_CASES)
def test_learned_recipe_passes_self_check(case_name, converted):
    entry = converted(case_name, "ddl-learned")
    spec = entry.model.config.deltafy
    assert spec["direction"] == "learned" and spec["rank"] == 16
    assert all(site.direction is not None and site.direction.rank == 16 for _, site in delta_sites(entry.model))
    _assert_self_check(entry)
    with forced_beta(entry.model, 1.0):
        changed = _logits(entry.model, entry.reference)
    assert (changed - entry.reference.logits).abs().max() > 0.02 * entry.reference.logits.abs().max()


# -- a wrong site map fails loudly -------------------------------------------------------------


def _llama_with_spec(edit):
    model = tiny_model("llama-untied")
    spec = build_spec(model.config, load_recipe())
    edit(spec)
    apply_deltafy(model, spec)
    model.config.deltafy = spec
    ids, mask = make_inputs(model)
    return model, ids, mask


def test_correct_site_map_passes_check():
    model, ids, mask = _llama_with_spec(lambda spec: None)
    check_site_map(model, ids, mask)


def _set_site(index, **changes):
    def edit(spec):
        spec["sites"][index].update(changes)

    return edit


@pytest.mark.parametrize(
    "edit, fragment",
    [
        (_set_site(0, write="self_attn.q_proj"), "layer 0 mlp stream"),
        (_set_site(1, write="post_attention_layernorm"), "layer 0 output"),
        (_set_site(1, stream="input_layernorm"), "layer 0 mlp stream"),
        (_set_site(0, scale=0.5), "layer 0 mlp stream"),
        (_set_site(1, scale=2.0), "layer 0 output"),
        (lambda spec: spec.update(parallel=True), "layer 0 mlp stream"),
    ],
    ids=[
        "attn-write-q_proj",
        "mlp-write-its-norm",
        "mlp-stream-wrong",
        "attn-wrong-scale",
        "mlp-wrong-scale",
        "parallel-on-sequential",
    ],
)
def test_wrong_site_map_fails_check(edit, fragment):
    model, ids, mask = _llama_with_spec(edit)
    with pytest.raises(DeltafyError) as excinfo:
        check_site_map(model, ids, mask)
    message = str(excinfo.value)
    assert message.startswith("site map for 'llama' does not fit this model")
    assert fragment in message and "\n" not in message


def test_parallel_map_on_parallel_model_passes_but_sequential_flag_fails():
    model = convert(tiny_model("gpt_neox-parallel"))
    ids, mask = make_inputs(model)
    check_site_map(model, ids, mask)
    model.config.deltafy["parallel"] = False
    with pytest.raises(DeltafyError, match="'gpt_neox' does not fit"):
        check_site_map(model, ids, mask)


@pytest.mark.parametrize(
    "edit",
    [_set_site(0, stream="post_attention_layernorm"), _set_site(1, write="mlp.gate_proj")],
    ids=["attn-stream-after-its-write", "mlp-write-wrong-width"],
)
def test_wrong_site_map_that_breaks_the_forward_fails_check(edit):
    model, ids, mask = _llama_with_spec(edit)
    with pytest.raises(DeltafyError, match="does not fit"):
        check_site_map(model, ids, mask)


def test_wrong_site_map_fails_self_check():
    model = tiny_model("llama-untied")
    reference = record_reference(model, *make_inputs(model), new_tokens=4)
    spec = build_spec(model.config, load_recipe())
    spec["sites"][1]["write"] = "post_attention_layernorm"
    apply_deltafy(model, spec)
    model.config.deltafy = spec
    with pytest.raises(DeltafyError, match="does not fit"):
        self_check(model, reference)
    assert all(site.force_beta is None for _, site in delta_sites(model)), "self_check leaked its forced beta"


def test_site_module_that_never_runs_fails_check():
    def edit(spec):
        spec["sites"][1]["write"] = "unused"

    model = tiny_model("llama-untied")
    for layer in model.model.layers:
        layer.unused = torch.nn.Identity()  # exists, but is not on the layer's residual path
    spec = build_spec(model.config, load_recipe())
    edit(spec)
    apply_deltafy(model, spec)
    model.config.deltafy = spec
    with pytest.raises(DeltafyError, match="layer 0 mlp h ran 0 times"):
        check_site_map(model, *make_inputs(model))


def test_nonexistent_module_fails_at_apply_time():
    model = tiny_model("llama-untied")
    spec = build_spec(model.config, load_recipe())
    spec["sites"][1]["write"] = "feed_forward"
    with pytest.raises(ValueError, match="'mlp'.*does not have") as excinfo:
        apply_deltafy(model, spec)
    assert "LlamaDecoderLayer" in str(excinfo.value)
    # nothing is left half-attached
    assert not is_converted(model)
    assert not any(m._forward_hooks for m in model.modules())


def test_nonexistent_stream_fails_at_apply_time():
    model = tiny_model("llama-untied")
    spec = build_spec(model.config, load_recipe())
    spec["sites"][0]["stream"] = "ln_1"
    with pytest.raises(ValueError, match="'attn'"):
        apply_deltafy(model, spec)


def test_missing_layer_list_fails_at_apply_time():
    model = tiny_model("llama-untied")
    spec = build_spec(model.config, load_recipe())
    spec["layers"] = "transformer.h"
    with pytest.raises(ValueError, match="transformer.h"):
        apply_deltafy(model, spec)


def test_convert_fails_cleanly_when_a_later_layer_lacks_a_site_module():
    model = tiny_model("llama-untied")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    del model.model.layers[1].mlp  # layer 0 converts, layer 1 cannot
    with pytest.raises(DeltafyError) as excinfo:
        convert(model)
    assert "'mlp'" in str(excinfo.value) and not str(excinfo.value).startswith("deltafy:")
    assert not hasattr(model.config, "deltafy")
    assert not any(m._forward_hooks for m in model.modules()), "hooks left behind"
    assert not is_converted(model), "DeltaSite heads left attached to the layers that did convert"
    assert set(model.state_dict()) <= set(before)


# -- unsupported models ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["bert", "t5"])
def test_encoder_models_are_rejected_with_the_supported_list(model_type):
    config = AutoConfig.for_model(model_type)
    with pytest.raises(DeltafyError) as excinfo:
        layout_for(config)
    message = str(excinfo.value)
    assert repr(model_type) in message
    assert "encoder" in message
    for supported in ("llama", "gpt2", "gpt_neox", "falcon", "gemma2"):
        assert supported in message
    assert "\n" not in message


@pytest.mark.parametrize("model_type", ["mamba", "bloom"])
def test_unknown_decoders_are_rejected_with_the_supported_list(model_type):
    config = AutoConfig.for_model(model_type)
    with pytest.raises(DeltafyError) as excinfo:
        layout_for(config)
    message = str(excinfo.value)
    assert repr(model_type) in message and "not supported" in message
    assert all(t in message for t in SUPPORTED)


def test_convert_rejects_unsupported_model_and_leaves_it_alone():
    config = AutoConfig.for_model("bloom", hidden_size=32, n_layer=2, n_head=4, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DeltafyError, match="'bloom'.*llama"):
        convert(model)
    assert not is_converted(model) and not hasattr(model.config, "deltafy")
    after = model.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], v) for k, v in before.items())


def test_convert_rejects_encoder_model():
    config = AutoConfig.for_model(
        "bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=64
    )
    with pytest.raises(DeltafyError, match="'bert' is an encoder"):
        convert(AutoModel.from_config(config))


def test_convert_twice_raises():
    model = convert(tiny_model("llama-tied"))
    n_sites = len(list(delta_sites(model)))
    spec = model.config.deltafy
    for recipe in (None, "ddl-learned"):
        with pytest.raises(DeltafyError, match="already a deltafy model; convert the original"):
            convert(model, recipe)
    assert len(list(delta_sites(model))) == n_sites
    assert model.config.deltafy is spec
    with pytest.raises(ValueError, match="already converted"):
        apply_deltafy(model, spec)


def test_supported_table_is_what_the_error_lists():
    assert SUPPORTED == tuple(sorted(ARCHITECTURES))
    assert {model_type for model_type, _ in TINY_CASES.values()} == set(SUPPORTED), (
        "every supported model_type needs a tiny case in conftest.TINY_CASES"
    )


# -- Granite: the correction respects residual_multiplier --------------------------------------


def test_granite_site_scale_is_the_residual_multiplier(converted):
    entry = converted("granite")
    multiplier = entry.model.config.residual_multiplier
    assert multiplier == pytest.approx(0.22)
    assert all(s["scale"] == pytest.approx(multiplier) for s in entry.model.config.deltafy["sites"])
    assert all(site.scale == pytest.approx(multiplier) for _, site in delta_sites(entry.model))


@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_granite_correction_math(direction):
    """x + m*h' == x + m*h + beta*(v - k^T x)*k with k = normalize(m*h) (sublayer) at beta = 1."""
    m, d = 0.22, 32
    site = DeltaSite(d, direction=direction, scale=m)
    gen = torch.Generator().manual_seed(0)
    x, c, h = (torch.randn(4, 6, d, generator=gen) for _ in range(3))
    with torch.no_grad():
        site.target.bias.fill_(0.8)
    site.force_beta = 1.0
    with torch.no_grad():
        new = site.correct(x, c, h)
        cn = c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-6)
        kr = m * h if direction == "sublayer" else site.direction(cn)
    k = kr / kr.norm(dim=-1, keepdim=True)
    v = 0.8 * torch.sqrt((x * x).mean(-1, keepdim=True))
    expected = x + m * h + 1.0 * (v - (k * x).sum(-1, keepdim=True)) * k
    torch.testing.assert_close(x + m * new, expected, rtol=1e-5, atol=1e-5)
    # the readout along k is overwritten with v: beta = 1 is a full delta-rule write
    torch.testing.assert_close(((x + m * (new - h)) * k).sum(-1, keepdim=True), v, rtol=1e-5, atol=1e-5)


def test_granite_layer_applies_correction_with_residual_multiplier(converted):
    """On the live model: each layer's stream moves by exactly m*h + (v - k^T x)k at beta = 1."""
    entry = converted("granite")
    model, reference = entry.model, entry.reference
    m = model.config.residual_multiplier
    layer = model.model.layers[0]
    seen = {}
    hooks = [
        layer.input_layernorm.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x", args[0])),
        layer.input_layernorm.register_forward_hook(lambda mod, args, out: seen.__setitem__("c", out)),
        # the raw write h: the attention's output projection, before the site corrects it
        layer.self_attn.o_proj.register_forward_hook(lambda mod, args, out: seen.__setitem__("h", out)),
        layer.post_attention_layernorm.register_forward_pre_hook(lambda mod, args: seen.__setitem__("x1", args[0])),
    ]
    site = layer.delta["attn"]
    try:
        with torch.no_grad():
            site.target.bias.fill_(0.5)
        with forced_beta(model, 1.0):
            _logits(model, reference)
    finally:
        with torch.no_grad():
            site.target.bias.zero_()
        for hook in hooks:
            hook.remove()
    x, c, h, x1 = (seen[k].double() for k in ("x", "c", "h", "x1"))
    k = m * h / (m * h).norm(dim=-1, keepdim=True)
    v = 0.5 * torch.sqrt((x * x).mean(-1, keepdim=True))
    expected = x + m * h + (v - (k * x).sum(-1, keepdim=True)) * k
    torch.testing.assert_close(x1, expected, rtol=1e-4, atol=1e-4)
    # a correction that ignored the multiplier (x + m*h + m*(v - k^T x)k) would be far off
    wrong = x + m * h + m * (v - (k * x).sum(-1, keepdim=True)) * k
    assert (x1 - wrong).abs().max() > 1e-2
    assert c.shape == x.shape
