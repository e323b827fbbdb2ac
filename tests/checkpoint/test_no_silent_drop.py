"""A checkpoint's classes refuse to run when something swapped the modules its sites live on (as vLLM's
Transformers backend does: new module instances, or forwards rebound with types.MethodType), instead of
computing the stock model; the check counts the writes that ran, so every ordinary way of running the
model (generate, disabled(), the expanded stream, a training step) still works."""

from __future__ import annotations

import copy
import gc
import re
import threading
import types
import weakref

import pytest
import torch
from helpers.models import DELTAFY_FREE_PREAMBLE, fixed_ids, randomize_heads, run_deltafy_free, tiny_model
from transformers import AutoModel, AutoModelForCausalLM

import deltafy
from deltafy.modeling_deltafy import disabled

REFUSED = r"only (\d+) of this deltafy model's (\d+) residual sites ran: something replaced its modules"


def _saved(tmp_path, case="llama-untied", recipe="ddl-scalar"):
    model = deltafy.convert(tiny_model(case), recipe)
    randomize_heads(model)
    deltafy.save(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def _fresh_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A new instance with the same weights and the class's own forward: what a backend's swap leaves."""
    new = copy.deepcopy(module)
    new.__dict__.pop("forward", None)
    new.__dict__.pop("extra_repr", None)
    return new


@pytest.mark.parametrize("auto", [AutoModelForCausalLM, AutoModel])
def test_swapped_writes_are_refused(tmp_path, auto):
    _, folder = _saved(tmp_path)
    model = auto.from_pretrained(folder, trust_remote_code=True)
    ids = fixed_ids(model)
    model(input_ids=ids)  # untouched, it runs
    layers = (model.model if auto is AutoModelForCausalLM else model).layers
    for layer in layers:
        layer.mlp = _fresh_copy(layer.mlp)
    captured = []  # the context captured for a write that no longer runs: the refusal must not keep it
    layers[-1].post_attention_layernorm.register_forward_hook(lambda _, __, out: captured.append(weakref.ref(out)))
    with pytest.raises(ValueError, match=REFUSED) as err:
        model(input_ids=ids)
    assert err.type.__name__ == "DeltafyError" and err.type.__module__.startswith("transformers_modules")
    assert "2 of" in str(err.value) and "4 residual" in str(err.value)
    del err
    gc.collect()
    assert captured and captured[0]() is None, "the refused forward's captures are still held"


def test_every_module_swapped_and_rebound_is_refused(tmp_path):
    """vLLM replaces the norms and the sublayers alike, so nothing is captured and nothing written:
    deltafy's own 'write before capture' check cannot fire, the count does."""
    _, folder = _saved(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    for layer in model.model.layers:
        for name in ("self_attn", "mlp"):
            setattr(layer, name, _fresh_copy(getattr(layer, name)))
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.forward = types.MethodType(type(norm).forward, norm)  # a fused forward bound on the instance
    with pytest.raises(ValueError, match=r"only 0 of this deltafy model's 4 residual sites ran"):
        model(input_ids=fixed_ids(model))


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-expanded"])
def test_ordinary_use_is_not_refused(tmp_path, recipe):
    converted, folder = _saved(tmp_path, recipe=recipe)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids = fixed_ids(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, converted(input_ids=ids).logits)
        with disabled(model):  # the corrections off: the sites still ran
            model(input_ids=ids)
    model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    model.gradient_checkpointing_enable()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()


def test_a_deltafy_free_process_refuses_a_swap(tmp_path):
    _, folder = _saved(tmp_path)
    child = (
        DELTAFY_FREE_PREAMBLE
        + """
import copy, sys
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
for layer in model.model.layers:
    layer.mlp = copy.deepcopy(layer.mlp)
    layer.mlp.__dict__.pop("forward", None)
try:
    model(input_ids=torch.tensor([[1, 2, 3]]))
    message = ""
except Exception as err:
    message = f"{type(err).__name__}: {err}"
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"message": message, "deltafy_modules": loaded}, sys.argv[-1])
"""
    )
    got = run_deltafy_free(child, [str(folder)], tmp_path)
    assert got["message"].startswith("DeltafyError: only 2 of this deltafy model's 4 residual sites ran")


@pytest.mark.slow
def test_the_check_compiles_into_one_graph_that_is_never_recompiled(tmp_path):
    """The count's state is the same before every call (each thread's key in each call's record, from the
    start), so compiled code's guards on it hold."""
    converted, folder = _saved(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = fixed_ids(model)
    # Graphs other tests compiled in this process (a training run's, with grad on) would count as
    # recompiles of the shared transformers frames; only this test's own graphs are under test.
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        for eager in (model, converted):
            compiled = torch.compile(eager, backend="aot_eager", fullgraph=True)
            for _ in range(3):
                torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)
    torch._dynamo.reset()


def test_a_forward_leaves_the_record_of_which_sites_ran_as_it_found_it(tmp_path):
    """Compiled code may guard the record's values (torch 2.11 does; 2.13 guards only its keys): a forward that
    changed them would make the next call compile again. Both the converted model and its checkpoint class."""
    converted, folder = _saved(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    for model in (converted.eval(), loaded):
        before = [dict(call.ran) for call in model._deltafy_writes]
        with torch.no_grad():
            model(input_ids=fixed_ids(model))
        assert [dict(call.ran) for call in model._deltafy_writes] == before, type(model).__name__


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["each layer", "the model"])
def test_compiled_code_counts_the_sites_of_the_thread_that_runs_it(tmp_path, compiled):
    """Each thread has its own count, which compiled code reads as it runs (a graph traced in one thread
    and run in another would otherwise count for the first): outputs match in both threads, and a swap
    made after compiling is refused in both."""
    _, folder = _saved(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = fixed_ids(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if compiled == "the model" else model
    for layer in model.model.layers if compiled == "each layer" else ():
        layer.compile(backend="eager")
    got = {}

    def forward(name):
        try:
            with torch.no_grad():
                got[name] = run(input_ids=ids).logits
        except ValueError as err:
            got[name] = str(err)

    def in_both(tag):
        forward(f"{tag}, main")
        worker = threading.Thread(target=forward, args=(f"{tag}, thread",))
        worker.start()
        worker.join()

    in_both("as loaded")
    model.model.layers[1].mlp = _fresh_copy(model.model.layers[1].mlp)
    in_both("swapped")
    torch._dynamo.reset()
    for name in ("as loaded, main", "as loaded, thread"):
        torch.testing.assert_close(got[name], expected, rtol=0, atol=1e-6, msg=name)
    for name in ("swapped, main", "swapped, thread"):
        assert re.match(REFUSED, got[name]) and "3 of" in got[name], (name, got[name])


def test_a_converted_model_saved_with_save_pretrained_is_named_for_what_it_is(tmp_path):
    # A model converted in memory keeps its family's class and model_type, so save_pretrained writes a folder
    # that transformers loads as the original, its heads left over: deltafy names that, on load and on convert,
    # rather than calling it unconverted (and converting it again would start the heads afresh).
    from helpers.cli import assert_one_line_error
    from helpers.training import run_cli

    model = deltafy.convert(tiny_model("llama-untied"))
    randomize_heads(model)
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(deltafy.DeltafyError, match="converted in memory and saved with save_pretrained") as err:
        deltafy.load(tmp_path / "saved")
    assert "deltafy.save(model, DIR)" in str(err.value) and "\n" not in str(err.value)
    proc = run_cli("convert", tmp_path / "saved", "--out", tmp_path / "again", cwd=tmp_path)
    assert_one_line_error(proc, "converted in memory and saved with save_pretrained", "'llama'")
    assert not (tmp_path / "again").exists()
