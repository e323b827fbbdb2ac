"""torch.compile traces the surgery as plain code: one graph (fullgraph=True, no breaks) for
prefill, for cached decoding and for a training step, matching eager with heads that matter.

DESIGN pitfall: dynamo can silently drop forward hooks; deltafy installs none, and these tests
prove the compiled model still runs every correction (its outputs differ from the disabled model's).
The aot_eager backend runs dynamo's and AOTAutograd's tracing without needing a C++ toolchain.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from helpers.models import open_gates, tiny_model
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, DynamicCache

import deltafy
from deltafy.surgery import delta_sites

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(case, recipe):
    model = deltafy.convert(tiny_model(case), recipe)
    open_gates(model)
    return model, torch.compile(model, backend="aot_eager", fullgraph=True)


def _decode(model, ids, steps=4):
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = [model(input_ids=ids, use_cache=True, **{key: cache}).logits]
        token = logits[-1][:, -1:].argmax(-1)
        for _ in range(steps):
            logits.append(model(input_ids=token, use_cache=True, **{key: cache}).logits)
            token = logits[-1][:, -1:].argmax(-1)
    return torch.cat(logits, 1)


CASES = ["llama-tied", "gpt2", "opt-post-ln", "gemma2", "gpt_neox-parallel"]
IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-learned", "ddl-scalar-logit", "ddl-expanded"])
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_cached_decode_compile_to_one_graph(case, recipe):
    model, compiled = _compiled(case, recipe)
    with torch.no_grad():
        eager = model(input_ids=IDS).logits
        with deltafy.disabled(model):
            without = model(input_ids=IDS).logits
        assert (eager - without).abs().max() > 1e-2  # the heads matter
        torch.testing.assert_close(compiled(input_ids=IDS).logits, eager, rtol=0, atol=1e-5)
    torch.testing.assert_close(_decode(compiled, IDS[:1]), _decode(model, IDS[:1]), rtol=0, atol=1e-5)


def test_compiled_model_reads_the_heads_it_has_now():
    """Parameters changed after compiling (in place, or swapped with ``param.data = t``) are
    what the compiled graph computes with: they are its inputs, not constants baked into it."""
    model, compiled = _compiled("llama-tied", "ddl-scalar")
    with torch.no_grad():
        first = compiled(input_ids=IDS).logits
        for _, site in delta_sites(model):
            site.target.bias.add_(1.0)
        torch.testing.assert_close(compiled(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=1e-5)
        for _, site in delta_sites(model):
            site.gate.weight.data = -site.gate.weight.detach().clone()
        swapped = compiled(input_ids=IDS).logits
        torch.testing.assert_close(swapped, model(input_ids=IDS).logits, rtol=0, atol=1e-5)
    assert (swapped - first).abs().max() > 1e-2


def test_a_compiled_training_step_gives_eager_head_gradients():
    model, compiled = _compiled("llama-untied", "ddl-learned")
    for name, param in model.named_parameters():
        param.requires_grad_(".delta." in name)
    model.train()

    def grads(m):
        model.zero_grad(set_to_none=True)
        m(input_ids=IDS, labels=IDS).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    eager, traced = grads(model), grads(compiled)
    assert eager.keys() == traced.keys() and len(eager) == 2 * 2 * 7  # strength, gate, target, direction
    for name, grad in eager.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(traced[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _graphs_of_layers_compiled_alone(model, layers: str) -> tuple[int, torch.Tensor]:
    """Each decoder layer compiled on its own (regional compilation; FSDP's hooks give each layer a frame
    of its own as well): the graphs dynamo made over a training step and an evaluation, and the logits."""
    torch._dynamo.reset()
    counters.clear()
    for layer in model.get_submodule(layers):
        layer.compile(backend="eager")
    model.train()
    model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=IDS, use_cache=False).logits
    return counters["stats"]["unique_graphs"], logits


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-expanded"])
@pytest.mark.parametrize("case", CASES)
def test_a_layer_compiled_alone_serves_every_layer(case, recipe, tmp_path):
    """Nothing a layer's sites do names that layer (no id of a site or a call, no count): the graph dynamo
    makes for one layer holds for the next, as the original's does. It was one graph a layer, and past
    torch's limit of 8 a frame the other layers of a deep model ran eagerly, silently."""
    stock = tiny_model(case, layers=5)
    converted = deltafy.convert(copy.deepcopy(stock), recipe)
    open_gates(converted)
    layers = converted.config.deltafy["layers"]
    original, _ = _graphs_of_layers_compiled_alone(stock, layers)
    # (training and evaluating each make one) the expanded stream's first layer tiles it and its last returns
    # the view: graphs of their own beside the middle layers'
    expected = original * (3 if recipe == "ddl-expanded" else 1)
    with torch.no_grad():
        eager = converted(input_ids=IDS, use_cache=False).logits
    deltafy.save(converted, tmp_path / "ckpt")
    # the package's surgery, and the checkpoint's class (which also counts the sites that ran)
    for model in (converted, AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)):
        graphs, logits = _graphs_of_layers_compiled_alone(model, layers)
        assert graphs == expected, f"{graphs} graphs for 5 layers, the original's {original}"
        torch.testing.assert_close(logits, eager, rtol=0, atol=1e-5)
