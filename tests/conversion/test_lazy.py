"""Models run from their safetensors files one decoder layer at a time (deltafy.conversion.lazy), and the
self-check built on it (verify.layerwise_self_check): the same logits, bitwise, as the model
loaded whole, and the same verdicts as the in-memory self-check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.models import open_gates, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file, save_model
from transformers import AutoConfig, AutoModelForCausalLM

from deltafy import DeltafyError, convert, load_recipe
from deltafy.conversion.lazy import empty_model, is_head, layer_by_layer, missing_weights, safetensors_weights
from deltafy.conversion.verify import (
    LAYER_BY_LAYER,
    check_site_map,
    layerwise_self_check,
    make_inputs,
    record_reference,
    self_check,
)
from deltafy.modeling_deltafy import apply_deltafy
from deltafy.surgery import build_spec

# Checkpoints whose keys transformers remaps on load (MoE experts fused into one tensor) are not
# streamed as they are: those models are checked from a file of their own state dict instead.
REMAPPED = {"mixtral"}


def _save(case: str, root: Path, dtype=torch.float32, **save_kwargs) -> Path:
    folder = root / case
    model = tiny_model(case).to(dtype)
    model.save_pretrained(folder, **save_kwargs)
    if case in REMAPPED:
        for file in folder.glob("model*.safetensors*"):
            file.unlink()
        save_model(model, str(folder / "state.safetensors"))
    return folder


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _logits(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _converted(folder: Path, dtype=torch.float32):
    """The in-memory conversion, the path taken when the model fits: reference, convert, heads."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    reference = record_reference(model, *make_inputs(model), new_tokens=8)
    convert(model)
    heads = {name: t.detach().clone() for name, t in model.state_dict().items() if is_head(name)}
    return model, reference, heads


def _resident(model, units) -> tuple[list[list[str]], list]:
    """Hooks recording, as each of ``units`` (module paths) starts, which of them hold real weights."""
    seen = []

    def record(module, args):
        real = [
            u
            for u in units
            if any(not p.is_meta for n, p in model.get_submodule(u).named_parameters() if not is_head(n))
        ]
        seen.append(real)

    return seen, [model.get_submodule(u).register_forward_pre_hook(record) for u in units]


def test_empty_model_of_every_family(case):
    """Parameters on meta; buffers (rotary inv_freq, Gemma's embed_scale) real and equal to a real
    model's; a tied pair one tensor, as in a model built normally."""
    real = tiny_model(case)
    model = empty_model(real.config)
    assert all(p.is_meta for p in model.parameters())
    buffers = dict(real.named_buffers())
    assert dict(model.named_buffers()).keys() == buffers.keys()
    for name, buffer in model.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    tied = real.get_output_embeddings().weight is real.get_input_embeddings().weight
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) == tied


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(case, torch.float32) for case in ("llama-tied", "gpt2", "opt-post-ln", "phi", "mixtral")]
    + [("llama-untied", torch.bfloat16)],
    ids=["llama-tied", "gpt2", "opt-post-ln", "phi", "mixtral", "llama-bf16"],
)
def test_layer_by_layer_logits_are_bitwise_the_loaded_models(case, dtype, tmp_path):
    folder = _save(case, tmp_path, dtype)
    if case in REMAPPED:
        full = tiny_model(case)
        config = full.config
    else:
        full = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        config = AutoConfig.from_pretrained(folder)
    model = empty_model(config)
    assert model.dtype == dtype and all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers()), "non-persistent buffers (rotary inv_freq) must be real"
    ids, mask = make_inputs(full)
    with layer_by_layer(model, safetensors_weights(model, _files(folder))):
        lazy = _logits(model, ids, mask)
    assert torch.equal(lazy, _logits(full, ids, mask))
    assert all(p.is_meta for p in model.parameters()), "every tensor read from the files goes back to meta"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "a hook was left behind"


def test_one_decoder_layer_in_memory_at_a_time(tmp_path):
    folder = _save("llama-untied", tmp_path)
    model = empty_model(AutoConfig.from_pretrained(folder))
    units = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    done = []
    with layer_by_layer(model, safetensors_weights(model, _files(folder)), progress=lambda *a: done.append(a)):
        assert not model.model.norm.weight.is_meta, "small modules outside the layers stay real"
        assert all(p.is_meta for p in model.model.layers.parameters()), "no decoder layer is read before it runs"
        assert model.model.embed_tokens.weight.is_meta and model.lm_head.weight.is_meta
        seen, handles = _resident(model, units)
        _logits(model, *make_inputs(model))
        for handle in handles:
            handle.remove()
        assert all(p.is_meta for u in units for p in model.get_submodule(u).parameters())
    assert seen == [[unit] for unit in units], "each unit must be the only one in memory while it runs"
    assert done == [(1, 2), (2, 2)]
    assert all(p.is_meta for p in model.parameters())


def test_a_forward_that_fails_inside_a_layer_leaves_nothing_behind(tmp_path):
    folder = _save("llama-untied", tmp_path)
    model = empty_model(AutoConfig.from_pretrained(folder))
    weights = safetensors_weights(model, _files(folder))
    ids, mask = make_inputs(model)

    def fail(module, args, kwargs):
        raise RuntimeError("failed inside the layer")

    with layer_by_layer(model, weights):
        handle = model.model.layers[0].self_attn.register_forward_pre_hook(fail, with_kwargs=True)
        with pytest.raises(RuntimeError, match="failed inside"):
            _logits(model, ids, mask)
        assert all(p.is_meta for p in model.model.layers.parameters()), "the failed layer stayed in memory"
        handle.remove()
        first = _logits(model, ids, mask)  # and the next forward runs as if nothing happened
    assert all(p.is_meta for p in model.parameters())
    with layer_by_layer(model, weights):  # the model can be run again
        assert torch.equal(_logits(model, ids, mask), first)


def test_sharded_checkpoint(tmp_path):
    folder = _save("llama-untied", tmp_path, max_shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2, "the save is not sharded"
    weights = {name: (folder / file, name) for name, file in index["weight_map"].items()}
    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = empty_model(full.config)
    ids, mask = make_inputs(full)
    with layer_by_layer(model, weights):
        assert torch.equal(_logits(model, ids, mask), _logits(full, ids, mask))


def test_checkpoint_of_the_bare_model_keys_without_prefix(tmp_path):
    """GPT-2's own checkpoints store ``h.0.attn.c_attn.weight`` for ``transformer.h.0.attn.c_attn.weight``."""
    folder = _save("gpt2", tmp_path)
    file = folder / "model.safetensors"
    with safe_open(file, framework="pt") as handle:
        tensors = {key.removeprefix("transformer."): handle.get_tensor(key) for key in handle.keys()}
    assert "h.0.attn.c_attn.weight" in tensors and "lm_head.weight" not in tensors
    save_file(tensors, file, metadata={"format": "pt"})
    full = AutoModelForCausalLM.from_pretrained(folder).eval()
    model = empty_model(full.config)
    weights = safetensors_weights(model, [file])
    assert weights["transformer.h.0.attn.c_attn.weight"] == (file, "h.0.attn.c_attn.weight")
    assert "lm_head.weight" not in weights  # tied to wte
    ids, mask = make_inputs(full)
    with layer_by_layer(model, weights):
        assert torch.equal(_logits(model, ids, mask), _logits(full, ids, mask))
    assert model.lm_head.weight is model.transformer.wte.weight, "the tie must hold after the block"


def test_keys_that_transformers_remaps_on_load_are_named(tmp_path):
    """Mixtral's save_pretrained stores each expert apart; the model holds them fused in one tensor."""
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    lazy = empty_model(model.config)
    missing = missing_weights(lazy, safetensors_weights(lazy, _files(tmp_path)))
    assert "model.layers.0.mlp.experts.gate_up_proj" in missing
    with pytest.raises(DeltafyError, match=r"no weights for model\.layers\.0\.mlp\.gate\.weight, .* and \d+ more"):
        with layer_by_layer(lazy, safetensors_weights(lazy, _files(tmp_path))):
            pass


def test_a_tied_pair_stored_under_the_output_name(tmp_path):
    """A tied pair is stored once, under either name: here lm_head's, not the embeddings'."""
    model = tiny_model("llama-tied")
    save_model(model, str(tmp_path / "tied.safetensors"))
    lazy = empty_model(model.config)
    weights = safetensors_weights(lazy, [tmp_path / "tied.safetensors"])
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" not in weights
    ids, mask = make_inputs(model)
    with layer_by_layer(lazy, weights):
        assert torch.equal(_logits(lazy, ids, mask), _logits(model, ids, mask))


def test_a_mapping_that_does_not_fit_is_one_clear_error(tmp_path):
    folder = _save("llama-untied", tmp_path)
    model = empty_model(AutoConfig.from_pretrained(folder))
    weights = safetensors_weights(model, _files(folder))
    file = folder / "model.safetensors"
    missing = {k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"}
    assert missing_weights(model, weights) == []
    assert missing_weights(model, missing) == ["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(DeltafyError, match=r"no weights for model\.layers\.1\.mlp\.up_proj\.weight"):
        with layer_by_layer(model, missing):
            pass
    wrong = weights | {"model.layers.0.mlp.up_proj.weight": (file, "model.layers.0.mlp.down_proj.weight")}
    with pytest.raises(DeltafyError, match=r"down_proj.weight' has shape \[64, 128\], the model's .*up_proj"):
        with layer_by_layer(model, wrong):
            pass
    with pytest.raises(DeltafyError, match="no tensor 'nope'"):
        with layer_by_layer(model, weights | {"lm_head.weight": (file, "nope")}):
            pass
    assert all(p.is_meta for p in model.parameters())


# -- the self-check, layer by layer ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "dtype"),
    [("llama-tied", torch.float32), ("opt-post-ln", torch.float32), ("llama-untied", torch.bfloat16)],
    ids=["llama-tied", "opt-post-ln", "llama-bf16"],
)
def test_layerwise_self_check_matches_the_in_memory_one(case, dtype, tmp_path):
    folder = _save(case, tmp_path, dtype=dtype)
    config = AutoConfig.from_pretrained(folder)
    assert config.dtype == dtype  # a real checkpoint's config names its dtype; the check runs in it
    model, reference, heads = _converted(folder, dtype)
    in_memory = self_check(model, reference)
    done = []
    lazy = layerwise_self_check(
        config,
        model.config.deltafy,
        heads,
        safetensors_weights(model, _files(folder)),
        progress=lambda *a: done.append(a),
    )
    assert lazy.passed and in_memory.passed
    assert lazy.max_abs_dlogits == in_memory.max_abs_dlogits and lazy.tolerance == in_memory.tolerance
    assert lazy.beta_zero_bitwise and lazy.dtype == str(dtype).removeprefix("torch.")
    assert lazy.mode == LAYER_BY_LAYER and lazy.greedy_identical is None and lazy.greedy_tokens == 0
    assert lazy.to_dict()["not_checked"] == ["greedy generation"] and lazy.to_dict()["passed"]
    assert in_memory.greedy_identical and in_memory.mode == "full" and "not_checked" not in in_memory.to_dict()
    assert done == [(i, 3 * 2) for i in range(1, 7)]


def test_layerwise_self_check_fails_where_the_heads_change_the_model(tmp_path):
    folder = _save("llama-untied", tmp_path)
    model, reference, _ = _converted(folder)
    open_gates(model)
    heads = {name: t for name, t in model.state_dict().items() if is_head(name)}
    in_memory = self_check(model, reference)
    lazy = layerwise_self_check(
        AutoConfig.from_pretrained(folder), model.config.deltafy, heads, safetensors_weights(model, _files(folder))
    )
    assert lazy.max_abs_dlogits == in_memory.max_abs_dlogits > lazy.tolerance
    assert not lazy.passed and lazy.beta_zero_bitwise


@pytest.mark.parametrize(
    ("case", "site", "field", "module"),
    [("llama-untied", 1, "write", "post_attention_layernorm"), ("opt-post-ln", 0, "norm_after", "final_layer_norm")],
    ids=["mlp-write-is-a-norm", "post-ln-attn-norm-is-the-mlp-one"],
)
def test_a_wrong_site_map_fails_in_memory_and_layer_by_layer(case, site, field, module, tmp_path):
    folder = _save(case, tmp_path)
    config = AutoConfig.from_pretrained(folder)
    spec = build_spec(config, load_recipe())
    spec["sites"][site][field] = module
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    apply_deltafy(model, spec)
    model.config.deltafy = spec
    with pytest.raises(DeltafyError, match="does not fit") as in_memory:
        check_site_map(model, *make_inputs(model))
    heads = {name: t for name, t in model.state_dict().items() if is_head(name)}
    with pytest.raises(DeltafyError, match="does not fit") as lazy:
        layerwise_self_check(config, spec, heads, safetensors_weights(model, _files(folder)))
    assert str(lazy.value) == str(in_memory.value)


def test_layerwise_self_check_needs_every_head(tmp_path):
    folder = _save("llama-untied", tmp_path)
    config = AutoConfig.from_pretrained(folder)
    weights = safetensors_weights(empty_model(config), _files(folder))
    with pytest.raises(DeltafyError, match="not a DDL head"):
        layerwise_self_check(
            config, build_spec(config, load_recipe()), {"model.layers.0.mlp.weight": torch.ones(1)}, weights
        )
