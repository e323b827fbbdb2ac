"""gate: strength — the correction scaled by a zero-initialized per-site strength α (as LoRA's B = 0)
instead of kept off by a gate logit of -18: exactly the original at init, a gradient from step one."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.models import DELTAFY_FREE_PREAMBLE, fixed_ids, run_deltafy_free, tiny_model

import deltafy
from deltafy.modeling_deltafy import DeltaSpec
from deltafy.recipe import Recipe
from deltafy.surgery import delta_sites

RECIPE = "ddl-scalar"  # the default recipe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["llama-untied", "gpt2", "opt-post-ln", "phi"])
def test_the_converted_model_is_the_original_bitwise(case, dtype):
    stock = tiny_model(case).to(dtype)
    model = deltafy.convert(tiny_model(case).to(dtype), RECIPE)
    ids = fixed_ids(stock)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock(input_ids=ids).logits)
    assert all(site.strength.dtype == dtype and site.strength.item() == 0 for _, site in delta_sites(model))
    assert all(site.gate.bias.item() == 0.0 for _, site in delta_sites(model))  # beta = 1: no hack needed


def test_strength_gets_the_gradient_at_once_and_the_heads_follow(tmp_path):
    model = deltafy.convert(tiny_model("llama-untied"), RECIPE)
    ids = fixed_ids(model)
    model(input_ids=ids, labels=ids).loss.backward()
    sites = [site for _, site in delta_sites(model)]
    assert all(site.strength.grad.abs() > 0 for site in sites)
    assert all(site.gate.weight.grad.abs().sum() == 0 for site in sites)  # scaled by alpha = 0, as B = 0 in LoRA
    groups = deltafy.head_parameter_groups(model)
    gate_group = next(g for g in groups if g["name"] == "gate")
    assert all(any(p is site.strength for p in gate_group["params"]) for site in sites)
    optimizer = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in groups])
    for _ in range(2):
        optimizer.step()
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
    assert all(site.strength.item() != 0 and site.gate.weight.grad.abs().sum() > 0 for site in sites)

    # Saved and loaded without deltafy: the same logits, bitwise, with alpha in the checkpoint.
    full = deltafy.save(model, tmp_path / "full")
    assert json.loads((full / "config.json").read_text())["deltafy"]["gate"] == "strength"
    child = (
        DELTAFY_FREE_PREAMBLE
        + r"""
import torch
from transformers import AutoModelForCausalLM
path, ids, result_file = sys.argv[1], torch.tensor(eval(sys.argv[2])), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(input_ids=ids).logits
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"logits": logits, "deltafy_modules": loaded}, result_file)
"""
    )
    got = run_deltafy_free(child, [str(full), repr(ids.tolist())], tmp_path)
    with torch.no_grad():
        assert torch.equal(got["logits"], model.eval()(input_ids=ids).logits)


def test_recipes_name_the_gate():
    assert Recipe.model_validate({"name": "x", "gate": "strength", "gate_bias": 0.0}).gate == "strength"
    with pytest.raises(ValueError, match=r"gate_bias\s+Value error, must be at most -4 with gate: logit"):
        Recipe.model_validate({"name": "x", "gate_bias": 0.0})
    # A checkpoint written before the option existed has no "gate": it is the logit gate.
    assert DeltaSpec.from_dict({"layers": "model.layers", "hidden_size": 8, "sites": []}).gate == "logit"
    assert deltafy.load_recipe().gate == "strength" and deltafy.load_recipe("ddl-scalar-logit").gate == "logit"
