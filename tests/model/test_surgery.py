"""The surgery: a patch you can see (print), switch off (deltafy.disabled) and undo
(deltafy.unconvert), that composes with other wrappers and with peft, and survives threads,
copies, pickling and activation checkpointing."""

from __future__ import annotations

import copy
import functools
import gc
import io
import sys
import threading
import weakref

import pytest
import torch
from helpers.models import gates_at, open_gates, tiny_model
from transformers import AutoModelForCausalLM

import deltafy
from deltafy import convert, head_parameter_groups, load_recipe
from deltafy.modeling_deltafy import _stash
from deltafy.surgery import delta_sites, mean_betas


@pytest.fixture()
def llama():
    model = convert(tiny_model("llama-tied"))
    open_gates(model)
    return model


def _ids(seed=0, shape=(2, 9)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _instance_forwards(model) -> dict[str, object]:
    return {name: m.__dict__["forward"] for name, m in model.named_modules() if "forward" in m.__dict__}


# -- see, switch off, undo -----------------------------------------------------------------------


def test_print_shows_every_site(llama):
    text = repr(llama.model.layers[0])
    assert "(self_attn): LlamaAttention(\n    deltafy: write of attn" in text
    assert "(input_layernorm): LlamaRMSNorm((64,), eps=1e-06, deltafy: stream of attn)" in text
    assert "(post_attention_layernorm): LlamaRMSNorm((64,), eps=1e-06, deltafy: stream of mlp)" in text
    assert "input_layernorm -> self_attn, direction=sublayer, scale=1" in text
    assert all(repr(layer).count("deltafy: write of") == 2 for layer in llama.model.layers)
    post_ln = convert(tiny_model("opt-post-ln"))  # one module that is both stream and write of a site
    assert "deltafy: stream of attn, write of attn" in repr(post_ln.model.decoder.layers[0].self_attn)


@pytest.mark.parametrize("case", ["llama-tied", "opt-post-ln", "gpt_neox-parallel", "gemma2"])
@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-learned"])
def test_unconvert_gives_the_original_model_bitwise(case, recipe):
    original = tiny_model(case)
    ids = _ids()
    expected = _logits(original, ids)
    names, text = [n for n, _ in original.named_parameters()], repr(original)
    model = convert(tiny_model(case), recipe)
    open_gates(model)
    assert (_logits(model, ids) - expected).abs().max() > 1e-2
    assert deltafy.unconvert(model) is model
    assert torch.equal(_logits(model, ids), expected)
    assert [n for n, _ in model.named_parameters()] == names
    assert repr(model) == text
    assert not _instance_forwards(model) and not hasattr(model.config, "deltafy")
    with pytest.raises(deltafy.DeltafyError, match="not converted"):
        deltafy.unconvert(model)
    convert(model, recipe)  # and it converts again
    assert len(list(delta_sites(model))) == 2 * model.config.num_hidden_layers


def test_disabled_runs_the_original_model_and_restores(llama):
    ids = _ids(1)
    original = _logits(deltafy.unconvert(copy.deepcopy(llama)), ids)
    with_heads = _logits(llama, ids)
    assert (with_heads - original).abs().max() > 1e-2
    with deltafy.disabled(llama) as model:
        assert model is llama
        assert torch.equal(_logits(llama, ids), original)
        with deltafy.disabled(llama):  # nests
            assert torch.equal(_logits(llama, ids), original)
        assert torch.equal(_logits(llama, ids), original)
        generated = llama.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(_logits(llama, ids), with_heads)
    with pytest.raises(KeyError):
        with deltafy.disabled(llama):
            raise KeyError("boom")
    assert torch.equal(_logits(llama, ids), with_heads)
    stock = deltafy.unconvert(copy.deepcopy(llama))
    assert torch.equal(generated, stock.generate(ids[:1], max_new_tokens=5, do_sample=False, pad_token_id=0))


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-expanded"])
def test_disabled_on_a_part_of_the_model_turns_off_the_sites_inside_it(recipe):
    model = convert(tiny_model("llama-tied"), recipe)
    open_gates(model)
    ids = _ids(3)
    with_heads = _logits(model, ids)
    with deltafy.disabled(model):
        original = _logits(model, ids)
    with deltafy.disabled(model.model) as part:  # the bare decoder, inside the causal LM
        assert part is model.model
        assert torch.equal(_logits(model, ids), original)
    assert torch.equal(_logits(model, ids), with_heads)
    with deltafy.disabled(model.model.layers[1]):  # one layer: its sites off, the other layer's on
        one_off = _logits(model, ids)
    assert (one_off - original).abs().max() > 1e-2 and (one_off - with_heads).abs().max() > 1e-2
    if recipe == "ddl-scalar":  # the same as that layer's gates shut (beta = 0 exactly)
        with gates_at(model.model.layers[1].delta["attn"], 0.0), gates_at(model.model.layers[1].delta["mlp"], 0.0):
            assert torch.equal(_logits(model, ids), one_off)
    assert torch.equal(_logits(model, ids), with_heads)
    # a part of a layer holds a site's write but not its stream (or the other way round): refused
    for part in (model.model.layers[0].self_attn, model.model.layers[0].input_layernorm, tiny_model("llama-tied")):
        with pytest.raises(ValueError, match="holds no converted decoder layer; pass a converted model"):
            with deltafy.disabled(part):
                pass
    assert torch.equal(_logits(model, ids), with_heads)
    deltafy.unconvert(model)
    assert not [name for name, m in model.named_modules() if "_deltafy_calls" in m.__dict__]


# -- other wrappers and peft ----------------------------------------------------------------------


class _Count:
    """A forward-patching library's hook (accelerate's ModelHook) that counts the calls it sees."""

    def __init__(self):
        from accelerate.hooks import ModelHook

        class Hook(ModelHook):
            calls = 0

            def pre_forward(self, module, *args, **kwargs):
                Hook.calls += 1
                return args, kwargs

        self.hook = Hook()

    @property
    def calls(self):
        return type(self.hook).calls


def test_accelerate_hook_installed_before_conversion_keeps_running():
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module

    plain = convert(tiny_model("llama-tied"))
    open_gates(plain)
    base = tiny_model("llama-tied")
    norm = base.model.layers[0].input_layernorm
    count = _Count()
    add_hook_to_module(norm, count.hook)
    hooked_forward = norm.forward
    converted = convert(base)
    converted.load_state_dict(plain.state_dict())
    ids = _ids(5, (2, 7))
    assert torch.equal(_logits(converted, ids), _logits(plain, ids))
    assert count.calls == 1
    deltafy.unconvert(converted)
    assert norm.forward is hooked_forward  # ours is gone, accelerate's is back
    assert torch.equal(_logits(converted, ids), _logits(tiny_model("llama-tied"), ids)) and count.calls == 2
    remove_hook_from_module(norm)
    assert norm.forward.__func__ is type(norm).forward


def test_wrappers_installed_after_conversion_keep_working_through_unconvert():
    from accelerate.hooks import add_hook_to_module, remove_hook_from_module

    model = convert(tiny_model("llama-tied"))
    open_gates(model)
    ids = _ids(6)
    expected = _logits(model, ids)
    layer = model.model.layers[0]
    count = _Count()
    add_hook_to_module(layer.self_attn, count.hook)  # a library's patch on a write module
    seen = []
    inner = layer.mlp.forward

    @functools.wraps(inner)
    def by_hand(*args, **kwargs):  # a hand-written wrapper on the other write module
        out = inner(*args, **kwargs)
        seen.append(out.shape)
        return out

    layer.mlp.forward = by_hand
    assert torch.equal(_logits(model, ids), expected)
    assert count.calls == 1 and len(seen) == 1
    deltafy.unconvert(model)
    stock = _logits(tiny_model("llama-tied"), ids)
    assert torch.equal(_logits(model, ids), stock)  # our patches below theirs are pass-throughs now
    assert count.calls == 2 and len(seen) == 2
    remove_hook_from_module(layer.self_attn)
    assert torch.equal(_logits(model, ids), stock)


def test_peft_lora_on_modules_that_are_not_sites():
    from peft import LoraConfig, get_peft_model

    model = convert(tiny_model("llama-untied"))
    open_gates(model)
    ids = _ids(7)
    with_heads = _logits(model, ids)
    original = _logits(tiny_model("llama-untied"), ids)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    assert torch.equal(_logits(peft_model, ids), with_heads)  # LoRA's B starts at zero
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=torch.Generator().manual_seed(len(name)))
    both = _logits(peft_model, ids)
    with peft_model.disable_adapter():
        assert torch.equal(_logits(peft_model, ids), with_heads)
        with deltafy.disabled(peft_model.base_model.model):
            assert torch.equal(_logits(peft_model, ids), original)
    with deltafy.disabled(peft_model.base_model.model):
        lora_only = _logits(peft_model, ids)
    assert (both - lora_only).abs().max() > 1e-2 and (lora_only - original).abs().max() > 1e-2
    merged = peft_model.merge_and_unload()
    torch.testing.assert_close(_logits(merged, ids), both, rtol=0, atol=1e-5)
    deltafy.unconvert(merged)
    torch.testing.assert_close(_logits(merged, ids), lora_only, rtol=0, atol=1e-5)


def test_a_model_transformers_loaded_keeps_its_sites_through_train_and_eval(tmp_path):
    # transformers >= 5.25 loads with its kernels library on, which takes over the forward of every norm at each
    # train()/eval() switch: the conversion turns it off, else the stream captures would be dropped
    tiny_model("llama-tied").save_pretrained(tmp_path)
    model = convert(AutoModelForCausalLM.from_pretrained(tmp_path))
    open_gates(model)
    ids = _ids(8)
    expected, forwards = _logits(model, ids), _instance_forwards(model)
    model.train()
    model.eval()
    assert _instance_forwards(model) == forwards
    assert torch.equal(_logits(model, ids), expected)


# -- threads, copies, pickling ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 9), (1, 1)], ids=["prefill", "one-token"])
def test_concurrent_forwards_match_sequential(llama, shape):
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, 128, shape, generator=gen) for _ in range(2)]
    expected = [_logits(llama, ids) for ids in inputs]
    n_iter = 40
    results: list[list] = [[], []]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def worker(i):
        try:
            barrier.wait()
            for _ in range(n_iter):
                results[i].append(_logits(llama, inputs[i]))
        except BaseException as err:  # surfaced in the main thread below
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible to provoke interleaving
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    for i in range(2):
        assert len(results[i]) == n_iter
        for got in results[i]:
            torch.testing.assert_close(got, expected[i], rtol=0, atol=1e-6)


def test_stash_is_empty_after_a_forward(llama):
    _logits(llama, _ids(shape=(1, 5)))
    assert not _stash(), "a forward left tensors in the stash"


def test_a_write_without_its_capture_fails_loudly(llama):
    """A site map that does not match the layer code (the write module runs, its stream module
    did not) must raise, never correct with another forward's stream."""
    with pytest.raises(RuntimeError, match="ran before its stream was captured"):
        llama.model.layers[0].mlp(torch.randn(1, 3, llama.config.hidden_size))


def _out_of_memory(*_):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize(
    ("where", "recipe"), [("converted", "ddl-scalar"), ("loaded", "ddl-scalar"), ("converted", "ddl-expanded")]
)
def test_a_forward_that_fails_halfway_holds_nothing_of_it(tmp_path, where, recipe):
    """An out-of-memory error inside a sublayer, between a site's capture and its write: the captured stream
    and context (and, in training, their autograd graph, which holds the weights) must not stay in the stash,
    where a notebook that deletes the model to free the GPU would find its memory still taken. The next
    forward runs as if none had failed. Both the package's surgery and a checkpoint loaded without deltafy."""
    model = convert(tiny_model("llama-tied"), recipe)
    open_gates(model)
    if where == "loaded":
        deltafy.save(model, tmp_path / "ckpt")
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)
    ids = _ids(5, (2, 9))
    expected = _logits(model, ids)
    layer = model.model.layers[1]
    captured = []  # the mlp site's context, which its write never reads
    layer.post_attention_layernorm.register_forward_hook(lambda _, __, out: captured.append(weakref.ref(out)))
    failing = layer.mlp.down_proj.register_forward_pre_hook(_out_of_memory)
    model.train()
    with pytest.raises(torch.OutOfMemoryError):
        model(input_ids=ids, labels=ids)
    failing.remove()
    gc.collect()  # (the exception's traceback holds its frames in a cycle)
    assert captured and captured[0]() is None, "a failed forward's capture is still held"
    model.eval()
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=0)
    layer.mlp.down_proj.register_forward_pre_hook(_out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        model(input_ids=ids, labels=ids)
    weights = [weakref.ref(p) for p in model.parameters()]
    del model, layer
    gc.collect()
    assert [w for w in weights if w() is not None] == [], "a failed forward keeps the model's weights alive"


def test_deepcopy_is_independent(llama):
    ids = _ids(2, (2, 8))
    base = _logits(llama, ids)
    clone = copy.deepcopy(llama)
    assert torch.equal(_logits(clone, ids), base)
    assert {id(s) for _, s in delta_sites(clone)}.isdisjoint({id(s) for _, s in delta_sites(llama)})
    # switching the copy's corrections off changes the copy only: its patches call the copy's heads
    with deltafy.disabled(clone):
        assert (_logits(clone, ids) - base).abs().max() > 1e-2
        assert torch.equal(_logits(llama, ids), base)
    # changing the copy's heads leaves the original alone, and the other way round
    with torch.no_grad():
        for _, site in delta_sites(clone):
            site.target.bias.fill_(-2.0)
    changed = _logits(clone, ids)
    assert (changed - base).abs().max() > 1e-2
    assert torch.equal(_logits(llama, ids), base)
    with gates_at(llama, 0.0):
        assert (_logits(llama, ids) - base).abs().max() > 1e-2
        assert torch.equal(_logits(clone, ids), changed)
    # every site of the copy still runs once per forward, and unconverting the copy is its own
    betas = mean_betas(clone, lambda: _logits(clone, ids))
    assert len(betas) == 4 and all(b == b for b in betas.values())  # no NaN: no site was skipped
    deltafy.unconvert(clone)
    assert torch.equal(_logits(llama, ids), base)


def test_pickled_model_round_trips(llama):
    ids = _ids(4, (2, 8))
    buffer = io.BytesIO()
    torch.save(llama, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    assert torch.equal(_logits(restored, ids), _logits(llama, ids))
    with deltafy.disabled(restored):  # the restored patches call the restored heads
        assert (_logits(restored, ids) - _logits(llama, ids)).abs().max() > 1e-2
    assert "deltafy: write of attn" in repr(restored)


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-expanded"])
def test_a_dropped_model_is_freed_without_the_garbage_collector(recipe):
    """A module holds its site call as its forward, so the call holds the module weakly: both ways strong,
    a dropped model's modules were a cycle that stayed in memory (the GPU's too) until the garbage
    collector ran. A deep copy's (or a pickled model's) calls hold the copy's modules."""
    model = convert(tiny_model("llama-tied"), recipe)
    open_gates(model)
    ids = _ids(4, (2, 8))
    copied = copy.deepcopy(model)
    assert torch.equal(_logits(copied, ids), _logits(model, ids))
    owners = {name: getattr(m.__dict__.get("forward"), "__self__", None) for name, m in copied.named_modules()}
    calls = {name: call for name, call in owners.items() if hasattr(call, "captures")}  # (forward: its bound __call__)
    assert len(calls) >= 2 * 4 and all(call.module is copied.get_submodule(name) for name, call in calls.items())
    weights = [weakref.ref(p) for p in model.parameters()]
    gc.disable()
    try:
        del model
        assert [w for w in weights if w() is not None] == []
    finally:
        gc.enable()
    replaced = convert(tiny_model("llama-tied"), recipe)
    replaced.model.layers[0].mlp = type(replaced.model.layers[0].mlp)(replaced.config)  # the hooked one is freed
    deltafy.unconvert(replaced)  # undoes the rest
    assert "deltafy" not in repr(replaced) and not any(m.__dict__.get("forward") for m in replaced.modules())


def test_mean_betas_reads_the_gates():
    model = convert(tiny_model("llama-tied"), "ddl-scalar-logit")
    ids = _ids(3)
    at_init = mean_betas(model, lambda: _logits(model, ids))
    assert sorted(at_init) == [f"model.layers.{i}.delta.{s}" for i in range(2) for s in ("attn", "mlp")]
    assert all(b == pytest.approx(2 * torch.sigmoid(torch.tensor(-18.0)).item()) for b in at_init.values())
    strength = convert(tiny_model("llama-tied"))  # the default: alpha * beta, alpha = 0 at init
    assert set(mean_betas(strength, lambda: _logits(strength, ids)).values()) == {0.0}
    with gates_at(model, 1.0):
        assert all(b == 1.0 for b in mean_betas(model, lambda: _logits(model, ids)).values())
    assert not any(site._forward_pre_hooks for _, site in delta_sites(model))


# -- training mechanics ---------------------------------------------------------------------------


def _freeze_base(model):
    for name, param in model.named_parameters():
        param.requires_grad_(".delta." in name)


def test_zero_embedding_token_keeps_head_gradients_finite():
    model = convert(tiny_model("gemma"))  # pad_token_id = 0: embedding row 0 is zero, and so is its stream
    _freeze_base(model)
    model.train()
    ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    for name, site in delta_sites(model):
        for pname, param in site.named_parameters():
            assert torch.isfinite(param.grad).all(), f"{name}.{pname}"


def _head_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {f"{n}.{pn}": p.grad.clone() for n, s in delta_sites(model) for pn, p in s.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_head_gradients(reentrant):
    model = convert(tiny_model("llama-untied"), "ddl-learned")
    open_gates(model)
    _freeze_base(model)
    model.train()
    ids = _ids(3, (2, 12))
    plain = _head_grads(model, ids)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # older transformers
        model.gradient_checkpointing_enable(kwargs)
    model.enable_input_require_grads()  # a frozen base gives the checkpointed layers no input needing grad
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    calls = []
    handle = layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        checkpointed = _head_grads(model, ids)
    finally:
        handle.remove()
    assert len(calls) == 2, "the layer was not recomputed in backward: checkpointing is not active"
    assert not _stash(), "the recompute left stream tensors behind"
    assert set(plain) == set(checkpointed) and len(plain) == 4 * 7  # strength, gate (2), target (2), direction (2)
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, f"no gradient reaches {name}"
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)
    assert all(p.grad is None for n, p in model.named_parameters() if ".delta." not in n)


@pytest.mark.parametrize(
    "recipe_name", ["ddl-scalar", "ddl-scalar-logit", "ddl-learned", "ddl-expanded", "ddl-write-only"]
)
def test_head_parameter_groups(recipe_name):
    model = tiny_model("llama-untied")
    pretrained = {id(p) for p in model.parameters()}
    convert(model, recipe_name)
    recipe = load_recipe(recipe_name)
    by_name = {g["name"]: g for g in head_parameter_groups(model)}
    assert set(by_name) == {"gate", "heads"}
    assert by_name["gate"]["lr"] == pytest.approx(recipe.training.lr * recipe.training.gate_lr_scale)
    assert by_name["heads"]["lr"] == pytest.approx(recipe.training.lr)
    assert by_name["gate"]["weight_decay"] == 0.0
    gate_ids = [id(p) for p in by_name["gate"]["params"]]
    head_ids = [id(p) for p in by_name["heads"]["params"]]
    site_params = [p for _, s in delta_sites(model) for p in s.parameters()]
    assert len(gate_ids) == len(set(gate_ids)) and len(head_ids) == len(set(head_ids))
    # alpha (gate: strength) moves with the gate: both set how strongly the correction acts
    strengths = {id(s.strength) for _, s in delta_sites(model) if s.strength is not None}
    assert bool(strengths) == (recipe.gate == "strength")
    assert set(gate_ids) == {id(p) for _, s in delta_sites(model) for p in s.gate.parameters()} | strengths
    assert set(gate_ids).isdisjoint(head_ids)
    final_reads = {id(p) for n, p in model.named_parameters() if n.endswith("delta.final.weight")}
    assert bool(final_reads) == (recipe.channels > 1)  # an expanded stream's final read trains with the heads
    assert set(gate_ids) | set(head_ids) == {id(p) for p in site_params} | final_reads
    assert not (set(gate_ids) | set(head_ids)) & pretrained
    if recipe_name == "ddl-learned":
        direction_ids = {id(p) for _, s in delta_sites(model) for p in s.direction.parameters()}
        assert direction_ids and direction_ids <= set(head_ids)
    torch.optim.AdamW(list(by_name.values()))  # the groups are valid optimizer input


def test_head_parameter_groups_use_the_given_recipe():
    model = convert(tiny_model("llama-untied"))
    training = load_recipe().training.model_copy(update={"lr": 2e-4, "gate_lr_scale": 7.0, "weight_decay": 0.01})
    by_name = {
        g["name"]: g for g in head_parameter_groups(model, load_recipe().model_copy(update={"training": training}))
    }
    assert by_name["gate"]["lr"] == pytest.approx(2e-4 * 7.0)
    assert by_name["heads"]["lr"] == pytest.approx(2e-4)
    assert by_name["heads"]["weight_decay"] == 0.01
    assert by_name["gate"]["weight_decay"] == 0.0


@pytest.mark.parametrize("field, value", [("direction", "random"), ("gate", "sigmoid")])
def test_spec_and_site_refuse_an_unknown_direction_or_gate(field, value):
    from deltafy.modeling_deltafy import DeltaSpec

    with pytest.raises(ValueError, match=f"{field} must be .* got '{value}'"):
        DeltaSpec(layers="model.layers", hidden_size=8, sites=(), **{field: value})
    with pytest.raises(ValueError, match=f"{field} must be .* got '{value}'"):  # a site is made from a spec
        DeltaSpec.from_dict({"layers": "model.layers", "hidden_size": 8, "sites": [SITE], field: value})


SITE = {"name": "attn", "write": "self_attn", "stream": "input_layernorm"}


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(eps=float("nan")), "eps must be a finite number > 0, got nan"),
        (dict(eps=float("inf")), "eps must be a finite number > 0, got inf"),
        (dict(eps=0.0), "eps must be a finite number > 0, got 0.0"),
        (dict(eps="1e-6"), "eps must be a finite number > 0, got '1e-6'"),
        (dict(gate_bias=float("-inf")), "gate_bias must be a finite number, got -inf"),
        (dict(channels=0), "channels must be a positive integer, got 0"),
        (dict(channels=1.5), "channels must be a positive integer, got 1.5"),
        (dict(channels=True), "channels must be a positive integer, got True"),
        (dict(direction="learned", rank=-1), "rank must be a positive integer or null, got -1"),
        (dict(direction="learned", rank=4.0), "rank must be a positive integer or null, got 4.0"),
        (dict(hidden_size=0), "hidden_size must be a positive integer, got 0"),
        (dict(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
        (dict(layers=""), "layers must be a non-empty string, got ''"),
        (dict(sites="attn"), "sites must be a list of sites, got 'attn'"),
        (dict(sites=["attn"]), "every site must be an object, got 'attn'"),
        (dict(sites=[{"name": "attn"}]), "site 'attn': 'write' is missing"),
        (dict(sites=[SITE | {"norm": "x"}]), "site 'attn': 'norm' is unknown"),
        (dict(sites=[SITE | {"scale": float("nan")}]), "site 'attn': scale must be a finite number > 0, got nan"),
        (dict(sites=[SITE | {"scale": float("inf")}]), "site 'attn': scale must be a finite number > 0, got inf"),
        (dict(sites=[SITE | {"scale": -1}]), "site 'attn': scale must be a finite number > 0, got -1"),
        (dict(sites=[SITE | {"name": 3}]), "a site's name must be a non-empty string, got 3"),
        (dict(sites=[SITE | {"write": None}]), "site 'attn': write must be a non-empty string, got None"),
        (dict(sites=[SITE | {"stream": 0}]), "site 'attn': stream must be a string, got 0"),
        (dict(sites=[SITE | {"context": "both"}]), "site 'attn': context must be 'output' or 'input', got 'both'"),
        (dict(sites=[SITE, SITE | {"write": "mlp"}]), "two sites are named 'attn'"),
    ],
)
def test_spec_read_from_a_config_is_checked_as_when_it_was_written(change, words):
    from deltafy.modeling_deltafy import DeltaSpec

    section = {"layers": "model.layers", "hidden_size": 8, "sites": [SITE], "format_version": 1} | change
    with pytest.raises(ValueError) as err:
        DeltaSpec.from_dict(section)
    assert str(err.value) == words
    with pytest.raises(ValueError, match="the config's deltafy section has no 'hidden_size'"):
        DeltaSpec.from_dict({"layers": "model.layers", "sites": []})
    assert DeltaSpec.from_dict({"layers": "model.layers", "hidden_size": 8, "sites": [SITE], "eps": 1}).eps == 1
