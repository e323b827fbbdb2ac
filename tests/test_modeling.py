"""The DDL math of DeltaSite and the mechanics of the surgery (threads, copies, compile, training)."""

from __future__ import annotations

import copy
import functools
import io
import sys
import threading

import pytest
import torch
from conftest import tiny_model

from deltafy import convert, head_parameter_groups, load_recipe, modeling_deltafy_native
from deltafy.modeling_deltafy import DeltaDirection, DeltaSite, delta_sites, mean_betas, set_forced_beta
from deltafy.modeling_deltafy_native import decode_kernel
from deltafy.verify import forced_beta

D = 16


def _tensors(seed: int = 0, shape=(3, 5, D), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=gen)
    c = torch.randn(shape, generator=gen)
    h = torch.randn(shape, generator=gen)
    return x.to(dtype), c.to(dtype), h.to(dtype)


def _site(direction="sublayer", rank=None, scale=1.0, seed=0, random_heads=True, target_bias=0.7):
    torch.manual_seed(seed)
    site = DeltaSite(D, direction=direction, rank=rank, scale=scale)
    with torch.no_grad():
        if random_heads:
            site.gate.weight.normal_()
            site.gate.bias.fill_(0.3)
            site.target.weight.zero_()
            site.target.bias.fill_(target_bias)
            if site.direction is not None and rank is None:
                site.direction.proj.weight.normal_()
    return site


def _rms(t: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    return torch.sqrt((t * t).mean(-1, keepdim=True) + eps)


def _unit_context(c: torch.Tensor) -> torch.Tensor:
    """The heads read the context normalized to unit length: c / sqrt(|c|^2 + 1e-6)."""
    return c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-6)


def _reference_stream(site: DeltaSite, x, c, h) -> torch.Tensor:
    """x + m*h + beta*(v - k^T x)*k in float64, written from the paper, not from the code."""
    x, c, h = x.double(), c.double(), h.double()
    cn = _unit_context(c)
    g = cn @ site.gate.weight.double().T + site.gate.bias.double()
    beta = 2.0 * torch.sigmoid(g) if site.force_beta is None else torch.full_like(g, site.force_beta)
    v = (cn @ site.target.weight.double().T + site.target.bias.double()) * _rms(x)
    m = site.scale
    if site.direction is None:
        kr = m * h
    elif site.direction.rank is None:
        kr = cn @ site.direction.proj.weight.double().T
    else:
        kr = (cn @ site.direction.down.weight.double().T) @ site.direction.up.weight.double().T
    k = kr / kr.norm(dim=-1, keepdim=True)
    return x + m * h + beta * (v - (k * x).sum(-1, keepdim=True)) * k


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=-1, keepdim=True)


def _readout(k, t):
    return (k * t).sum(-1)


# -- the math: sublayer direction ------------------------------------------------------------


def test_sublayer_beta_one_overwrites_readout_with_v():
    site = _site("sublayer", target_bias=0.7)
    x, c, h = _tensors()
    site.force_beta = 1.0
    with torch.no_grad():
        new = site.correct(x, c, h)
    k = _unit(h)
    v = 0.7 * _rms(x).squeeze(-1)
    delta = new - h
    # the correction is along k only, and it sets k^T x to v exactly
    torch.testing.assert_close(_readout(k, x + delta), v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta, _readout(k, delta).unsqueeze(-1) * k, rtol=1e-5, atol=1e-5)
    # the rest of the stream is untouched: x + delta differs from x only along k
    rest = (x + delta) - x
    torch.testing.assert_close(rest - _readout(k, rest).unsqueeze(-1) * k, torch.zeros_like(x), atol=1e-5, rtol=0)


def test_sublayer_beta_two_reflects_readout():
    site = _site("sublayer", target_bias=-0.4)
    x, c, h = _tensors(1)
    site.force_beta = 2.0
    with torch.no_grad():
        new = site.correct(x, c, h)
    k = _unit(h)
    v = -0.4 * _rms(x).squeeze(-1)
    torch.testing.assert_close(_readout(k, x + new - h), 2 * v - _readout(k, x), rtol=1e-5, atol=1e-5)


def test_sublayer_beta_zero_is_bitwise_identity():
    site = _site("sublayer")
    x, c, h = _tensors(2)
    site.force_beta = 0.0
    with torch.no_grad():
        assert torch.equal(site.correct(x, c, h), h)
        assert torch.equal(site.correct(x.bfloat16(), c.bfloat16(), h.bfloat16()), h.bfloat16())


def test_v_is_in_units_of_stream_rms():
    """Scaling the stream by s scales the target v (and so the new readout) by s."""
    site = _site("sublayer", target_bias=0.5)
    x, c, h = _tensors(3)
    site.force_beta = 1.0
    k = _unit(h)
    with torch.no_grad():
        for s in (1.0, 10.0, 1000.0):
            readout = _readout(k, s * x + site.correct(s * x, c, h) - h)
            torch.testing.assert_close(readout, 0.5 * s * _rms(x).squeeze(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("force", [None, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("scale", [1.0, 0.22])
def test_sublayer_matches_reference(force, scale):
    site = _site("sublayer", scale=scale)
    with torch.no_grad():
        site.target.weight.normal_()  # v depends on the context too
    site.force_beta = force
    x, c, h = _tensors(4)
    with torch.no_grad():
        got = x + scale * site.correct(x, c, h)
    torch.testing.assert_close(got.double(), _reference_stream(site, x, c, h), rtol=1e-5, atol=1e-5)


def test_default_init_is_nearly_identity():
    site = DeltaSite(D)
    assert site.force_beta is None
    x, c, h = _tensors(5)
    with torch.no_grad():
        out = site.correct(x, c, h)
    beta = 2 * torch.sigmoid(torch.tensor(site.gate_bias_init))
    assert 0 < (out - h).abs().max() <= 10 * beta * x.abs().max()


# -- the math: learned direction -------------------------------------------------------------


@pytest.mark.parametrize("rank", [None, 4], ids=["full-rank", "rank-4"])
def test_learned_beta_one_overwrites_readout_along_learned_k(rank):
    site = _site("learned", rank=rank, target_bias=1.3)
    x, c, h = _tensors(6)
    site.force_beta = 1.0
    with torch.no_grad():
        new = site.correct(x, c, h)
        cn = _unit_context(c)
        k = _unit(site.direction(cn))
    v = 1.3 * _rms(x).squeeze(-1)
    delta = new - h
    torch.testing.assert_close(_readout(k, x + delta), v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta, _readout(k, delta).unsqueeze(-1) * k, rtol=1e-5, atol=1e-5)
    # k is not the sublayer's direction: the learned head really picks its own
    assert (_readout(k, _unit(h)).abs() < 0.99).all()


@pytest.mark.parametrize("rank", [None, 4], ids=["full-rank", "rank-4"])
def test_learned_beta_two_and_zero(rank):
    site = _site("learned", rank=rank, target_bias=0.2)
    x, c, h = _tensors(7)
    with torch.no_grad():
        k = _unit(site.direction(_unit_context(c)))
        site.force_beta = 2.0
        reflected = _readout(k, x + site.correct(x, c, h) - h)
        site.force_beta = 0.0
        assert torch.equal(site.correct(x, c, h), h)
    v = 0.2 * _rms(x).squeeze(-1)
    torch.testing.assert_close(reflected, 2 * v - _readout(k, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rank", [None, 3], ids=["full-rank", "rank-3"])
@pytest.mark.parametrize("scale", [1.0, 0.22])
@pytest.mark.parametrize("force", [None, 1.0])
def test_learned_matches_reference(rank, scale, force):
    site = _site("learned", rank=rank, scale=scale)
    with torch.no_grad():
        site.target.weight.normal_()
    site.force_beta = force
    x, c, h = _tensors(8)
    with torch.no_grad():
        got = x + scale * site.correct(x, c, h)
    torch.testing.assert_close(got.double(), _reference_stream(site, x, c, h), rtol=1e-5, atol=1e-5)


def test_learned_full_rank_starts_at_normalized_context():
    site = DeltaSite(D, direction="learned")
    assert torch.equal(site.direction.proj.weight, torch.eye(D))
    x, c, h = _tensors(9)
    with torch.no_grad():
        k = _unit(site.direction(_unit_context(c)))
    torch.testing.assert_close(k, _unit(c))


def test_learned_rank_has_factored_shapes():
    direction = DeltaDirection(D, rank=5)
    assert direction.down.weight.shape == (5, D)
    assert direction.up.weight.shape == (D, 5)
    assert not hasattr(direction, "proj")
    assert sum(p.numel() for p in direction.parameters()) == 2 * 5 * D


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        DeltaSite(D, direction="foo")


# -- precision --------------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_bf16_tensors_compute_in_fp32(direction):
    site = _site(direction).to(torch.bfloat16)
    site.force_beta = 1.0
    x, c, h = _tensors(10, dtype=torch.bfloat16)
    with torch.no_grad():
        out = site.correct(x, c, h)
    assert out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # the bf16 result is the fp32 result rounded once, not bf16 arithmetic throughout
    fp32 = _site(direction)
    fp32.load_state_dict({k: v.float() for k, v in site.state_dict().items()})
    fp32.force_beta = 1.0
    with torch.no_grad():
        ref = fp32.correct(x.float(), c.float(), h.float())
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=2e-2)


def test_fp16_large_stream_does_not_overflow():
    """|x| ~ 1e3 over d = 16 has a sum of squares above fp16's range; the heads must still be finite."""
    site = _site("sublayer", target_bias=0.0).half()
    site.force_beta = 1.0
    x, c, h = _tensors(11, dtype=torch.float16)
    x = (x.float() * 300).half()
    with torch.no_grad():
        out = site.correct(x, c, h)
    assert out.dtype == torch.float16
    assert torch.isfinite(out).all()


# -- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("direction, rank", [("sublayer", None), ("learned", None), ("learned", 4)])
def test_gradients_reach_every_head_at_default_init(direction, rank):
    site = DeltaSite(D, direction=direction, rank=rank)  # default init: beta ~ 2e-7, target 0
    x, c, h = _tensors(12)
    x.requires_grad_(True)
    h.requires_grad_(True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (site.correct(x, c, h) * probe).sum().backward()
    names = dict(site.named_parameters())
    expected = {"gate.weight", "gate.bias", "target.weight", "target.bias"}
    if direction == "learned":
        expected |= {"direction.proj.weight"} if rank is None else {"direction.down.weight", "direction.up.weight"}
    assert set(names) == expected
    for name, param in names.items():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, f"no gradient reaches {name}"
    assert torch.isfinite(x.grad).all() and torch.isfinite(h.grad).all()


def test_forced_beta_stops_gate_gradient():
    site = _site("sublayer")
    site.force_beta = 1.0
    x, c, h = _tensors(13)
    site.correct(x, c, h).sum().backward()
    assert site.gate.weight.grad is None or not site.gate.weight.grad.any()
    assert site.target.bias.grad is not None and site.target.bias.grad.abs() > 0


@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_zero_stream_row_gives_finite_gradients(direction):
    site = DeltaSite(D, direction=direction)
    x, c, h = _tensors(14)
    x = x.clone()
    x[0, 0] = 0.0  # e.g. a token whose embedding row is zero (padding_idx rows are zero at init)
    x.requires_grad_(True)
    site.correct(x, c, h).sum().backward()
    assert torch.isfinite(x.grad).all()


def test_zero_embedding_token_keeps_head_gradients_finite():
    model = tiny_model("gemma")  # pad_token_id = 0: embedding row 0 is zero, and so is its whole stream
    convert(model)
    _freeze_base(model)
    model.train()
    ids = torch.tensor([[0, 5, 6, 7, 8, 9]])
    model(input_ids=ids, labels=ids).loss.backward()
    for name, site in delta_sites(model):
        for pname, param in site.named_parameters():
            assert torch.isfinite(param.grad).all(), f"{name}.{pname}"


# -- mechanics on a converted model -----------------------------------------------------------


def _freeze_base(model):
    for name, param in model.named_parameters():
        param.requires_grad_(".delta." in name)


def _make_heads_matter(model, seed=0):
    """Give every head a visible effect, so that a misrouted tensor shows up in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, site in delta_sites(model):
            site.gate.bias.fill_(0.0)
            site.gate.weight.copy_(0.5 * torch.randn(site.gate.weight.shape, generator=gen))
            site.target.weight.copy_(0.5 * torch.randn(site.target.weight.shape, generator=gen))
            site.target.bias.fill_(0.3)


@pytest.fixture()
def llama():
    model = convert(tiny_model("llama-tied"))
    _make_heads_matter(model)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_heads_matter_after_make_heads_matter(llama):
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(0))
    with_heads = _logits(llama, ids)
    with forced_beta(llama, 0.0):
        without = _logits(llama, ids)
    assert (with_heads - without).abs().max() > 1e-2


@pytest.mark.parametrize("shape", [(2, 9), (1, 1)], ids=["tensor-path", "one-token-path"])
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
    from deltafy.modeling_deltafy import _stash

    _logits(llama, torch.randint(0, 128, (1, 5)))
    ours = {id(site) for _, site in delta_sites(llama)}
    assert not ours & set(_stash()), "a forward left stream tensors in the stash"


def test_a_write_without_its_capture_fails_loudly(llama):
    """A site map that does not match the layer code (the write module runs, its stream module
    did not) must raise, never correct with another forward's stream."""
    layer = llama.get_submodule(llama.config.deltafy["layers"])[0]
    with pytest.raises(RuntimeError, match="ran before its stream was captured"):
        layer.mlp(torch.randn(1, 3, llama.config.hidden_size))


def test_deepcopy_is_independent(llama):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    base = _logits(llama, ids)
    clone = copy.deepcopy(llama)
    torch.testing.assert_close(_logits(clone, ids), base, rtol=0, atol=0)
    assert {id(s) for _, s in delta_sites(clone)}.isdisjoint({id(s) for _, s in delta_sites(llama)})

    # forcing beta on the copy changes the copy only: its hooks call the copy's heads
    set_forced_beta(clone, 2.0)
    assert (_logits(clone, ids) - base).abs().max() > 1e-2
    torch.testing.assert_close(_logits(llama, ids), base, rtol=0, atol=0)
    set_forced_beta(clone, None)
    torch.testing.assert_close(_logits(clone, ids), base, rtol=0, atol=0)

    # changing the copy's head weights leaves the original alone
    with torch.no_grad():
        for _, site in delta_sites(clone):
            site.target.bias.fill_(-2.0)
    changed = _logits(clone, ids)
    assert (changed - base).abs().max() > 1e-2
    torch.testing.assert_close(_logits(llama, ids), base, rtol=0, atol=0)

    # and the other way round
    set_forced_beta(llama, 0.0)
    assert (_logits(llama, ids) - base).abs().max() > 1e-2
    torch.testing.assert_close(_logits(clone, ids), changed, rtol=0, atol=0)

    # every site of the copy still runs once per forward
    betas = mean_betas(clone, lambda: _logits(clone, ids))
    assert len(betas) == 4 and all(b == b for b in betas.values())  # no NaN: no site was skipped


def test_pickled_model_round_trips(llama):
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(4))
    buffer = io.BytesIO()
    torch.save(llama, buffer)
    buffer.seek(0)
    restored = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(_logits(restored, ids), _logits(llama, ids), rtol=0, atol=0)
    set_forced_beta(restored, 0.0)  # the restored modules call the restored heads
    assert (_logits(restored, ids) - _logits(llama, ids)).abs().max() > 1e-2


def test_a_forward_wrapper_installed_before_conversion_keeps_running():
    """accelerate's device hooks replace ``module.forward`` on the instance; deltafy wraps them."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    class Count(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Count.calls += 1
            return args, kwargs

    plain = convert(tiny_model("llama-tied"))
    _make_heads_matter(plain)
    base = tiny_model("llama-tied")
    add_hook_to_module(base.model.layers[0].input_layernorm, Count())
    converted = convert(base)
    converted.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(_logits(converted, ids), _logits(plain, ids), rtol=0, atol=0)
    assert Count.calls == 1


@pytest.mark.parametrize("case", ["llama-tied", "gpt2", "opt-post-ln"])
def test_torch_compile_matches_eager(case):
    """DESIGN pitfall: dynamo can drop forward hooks. deltafy installs none; prove compile keeps the heads."""
    model = convert(tiny_model(case)).eval()
    _make_heads_matter(model)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(6))
    eager = _logits(model, ids)
    with forced_beta(model, 0.0):
        without_heads = _logits(model, ids)
    assert (eager - without_heads).abs().max() > 1e-2
    torch._dynamo.reset()
    for _, site in delta_sites(model):
        site._decode = None  # as in a model that is compiled before its first eager forward
    compiled = torch.compile(model, backend="aot_eager")  # dynamo's tracing, without a C++ toolchain
    torch.testing.assert_close(_logits(compiled, ids), eager, rtol=0, atol=1e-5)

    # decoding one token at a time with the cache: the tensor path runs inside the graph
    eager_tokens = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    compiled_tokens = compiled.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(compiled_tokens, eager_tokens)
    torch._dynamo.reset()


# -- optimizer groups -------------------------------------------------------------------------


@pytest.mark.parametrize("recipe_name", ["ddl-scalar", "ddl-learned"])
def test_head_parameter_groups(recipe_name):
    model = tiny_model("llama-untied")
    pretrained = {id(p) for p in model.parameters()}
    convert(model, recipe_name)
    recipe = load_recipe(recipe_name)
    groups = head_parameter_groups(model)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"gate", "heads"}
    assert by_name["gate"]["lr"] == pytest.approx(recipe.training.lr * recipe.training.gate_lr_scale)
    assert by_name["heads"]["lr"] == pytest.approx(recipe.training.lr)
    assert by_name["gate"]["lr"] > by_name["heads"]["lr"]
    assert by_name["gate"]["weight_decay"] == 0.0

    gate_ids = [id(p) for p in by_name["gate"]["params"]]
    head_ids = [id(p) for p in by_name["heads"]["params"]]
    site_params = [p for _, s in delta_sites(model) for p in s.parameters()]
    expected_gates = {id(p) for _, s in delta_sites(model) for p in s.gate.parameters()}
    assert len(gate_ids) == len(set(gate_ids)) and len(head_ids) == len(set(head_ids))
    assert set(gate_ids) == expected_gates
    assert set(gate_ids).isdisjoint(head_ids)
    assert set(gate_ids) | set(head_ids) == {id(p) for p in site_params}
    assert not (set(gate_ids) | set(head_ids)) & pretrained
    if recipe_name == "ddl-learned":
        direction_ids = {id(p) for _, s in delta_sites(model) for p in s.direction.parameters()}
        assert direction_ids and direction_ids <= set(head_ids)
    torch.optim.AdamW(groups)  # the groups are valid optimizer input


def test_head_parameter_groups_use_the_given_recipe():
    model = convert(tiny_model("llama-untied"))
    recipe = load_recipe().model_copy(
        update={
            "training": load_recipe().training.model_copy(
                update={"lr": 2e-4, "gate_lr_scale": 7.0, "weight_decay": 0.01}
            )
        }
    )
    by_name = {g["name"]: g for g in head_parameter_groups(model, recipe)}
    assert by_name["gate"]["lr"] == pytest.approx(2e-4 * 7.0)
    assert by_name["heads"]["lr"] == pytest.approx(2e-4)
    assert by_name["heads"]["weight_decay"] == 0.01
    assert by_name["gate"]["weight_decay"] == 0.0


# -- activation checkpointing -----------------------------------------------------------------


def _head_grads(model, ids):
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {f"{n}.{pn}": p.grad.clone() for n, s in delta_sites(model) for pn, p in s.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_gives_the_same_head_gradients(reentrant):
    from deltafy.modeling_deltafy import _stash

    model = convert(tiny_model("llama-untied"), "ddl-learned")
    _make_heads_matter(model)
    _freeze_base(model)
    model.train()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
    plain = _head_grads(model, ids)

    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # older transformers
        model.gradient_checkpointing_enable(kwargs)
    model.enable_input_require_grads()  # a frozen base gives the checkpointed layers no input needing grad
    layer = model.get_submodule(model.config.deltafy["layers"])[0]
    assert layer.gradient_checkpointing
    calls = []
    handle = layer.self_attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        checkpointed = _head_grads(model, ids)
    finally:
        handle.remove()
    assert len(calls) == 2, "the layer was not recomputed in backward: checkpointing is not active"
    assert not {id(s) for _, s in delta_sites(model)} & set(_stash()), "the recompute left stream tensors behind"

    assert set(plain) == set(checkpointed) and len(plain) == 4 * 6  # gate (2), target (2), rank-16 direction (2)
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, f"no gradient reaches {name}"
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-6, msg=name)
    assert all(p.grad is None for n, p in model.named_parameters() if ".delta." not in n)


# -- the few-token decode path ------------------------------------------------------------------
def _site_with_heads(**kwargs) -> DeltaSite:
    site = DeltaSite(D, **kwargs)
    with torch.no_grad():
        site.gate.weight.normal_(generator=torch.Generator().manual_seed(1))
        site.target.weight.normal_(generator=torch.Generator().manual_seed(2))
        site.gate.bias.fill_(-0.5)
        site.target.bias.fill_(0.3)
    return site


@pytest.fixture(params=["compiled", "python"])
def decode_impl(request, monkeypatch) -> str:
    """Each implementation of the decode path: the compiled kernel and the Python fallback."""
    if request.param == "compiled" and decode_kernel() is None:
        pytest.skip("no C compiler here (test_native.py checks that one builds wherever there is)")
    if request.param == "python":
        monkeypatch.setattr(modeling_deltafy_native, "_kernel", [None])
    return request.param


def _decode_path(site, x, c, h, kernel: bool = True):
    """What correct() computes for a decoding batch, called directly: the site's compiled kernel
    (if it has one and ``kernel``), else the Python path."""
    decode, d = site._decode_heads(), site.hidden_size
    if kernel and decode[7] is not None:
        out = torch.empty_like(h)
        decode[7](c.data_ptr(), x.data_ptr(), h.data_ptr(), out.data_ptr(), h.numel() // d)
        return out
    if h.numel() == d:
        return torch.add(h, h, alpha=site._row_gain(*(t.numpy().reshape(d) for t in (c, x, h)), decode))
    return site._correct_rows(x, c, h, decode)


def _fast_and_slow(site, x, c, h):
    with torch.no_grad():
        fast = site.correct(x, c, h)
    with torch.enable_grad():
        slow = site.correct(x, c, h)  # grad mode takes the tensor path, which reads the heads afresh
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-4)
    return fast


@pytest.mark.parametrize("scale", [1.0, 0.22])
@pytest.mark.parametrize("shape", [(1, 1, D), (1, D), (4, 1, D), (2, 3, D), (8, D)])
def test_few_token_fast_path_matches_the_tensor_path(scale, shape, decode_impl):
    """Decoding (a few fp32 tokens, no autograd, CPU) takes a scalar fast path: it must compute the same."""
    site = _site_with_heads(scale=scale)
    gen = torch.Generator().manual_seed(21)
    x, c, h = (torch.randn(shape, generator=gen) * s for s in (40.0, 1.0, 3.0))
    fast = _fast_and_slow(site, x, c, h)
    with torch.no_grad():
        assert (site._decode[7] is not None) == (decode_impl == "compiled")
        assert torch.equal(_decode_path(site, x, c, h), fast)  # correct() took the decode path
        strided = torch.stack((x, torch.full_like(x, 1e4)), dim=-1)[..., 0]  # x, not contiguous
        torch.testing.assert_close(site.correct(strided, c, h), fast, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(site.correct(x.double(), c, h), fast, rtol=1e-5, atol=1e-4)  # x not fp32
    assert fast.shape == h.shape and (fast - h).abs().max() > 1.0  # the heads matter
    site.force_beta = 0.0
    with torch.no_grad():
        assert torch.equal(site.correct(x, c, h), h)
    x.requires_grad_()  # an input leaf that requires grad, under no_grad
    site.force_beta = None
    with torch.no_grad():
        torch.testing.assert_close(site.correct(x, c, h), fast, rtol=1e-5, atol=1e-4)


def test_decode_path_sees_every_change_to_the_heads(decode_impl):
    """The decode path reads the heads' memory (numpy views, or pointers in the compiled kernel):
    an in-place change (an optimizer step, or behind autograd's back) must show at once, and a
    replaced tensor (load_state_dict(assign=True), .to()) or a copy must never be served stale values."""
    site = _site_with_heads()
    gen = torch.Generator().manual_seed(25)
    x, c, h = (torch.randn(1, 1, D, generator=gen) * s for s in (40.0, 1.0, 3.0))
    seen = [_fast_and_slow(site, x, c, h)]

    def changed():
        seen.append(_fast_and_slow(site, x, c, h))
        return not torch.equal(seen[-1], seen[-2])

    with torch.no_grad():
        site.gate.bias.add_(0.5)
    assert changed()
    site.target.weight.data.mul_(-1.0)  # no version counter sees this
    assert changed()
    optimizer = torch.optim.SGD(site.parameters(), lr=1e-3)
    site.correct(x, c, h).square().sum().backward()
    optimizer.step()
    assert changed()
    site.load_state_dict({k: v * 1.5 for k, v in site.state_dict().items()}, assign=True)
    assert changed()
    site.double()
    with torch.no_grad():
        site.target.bias.add_(0.25)  # while the heads are float64: the decode path is not taken
    site.float()
    assert changed()
    twin = copy.deepcopy(site)
    with torch.no_grad():
        twin.gate.bias.add_(1.0)
    assert not changed()  # the copy's change is its own
    with torch.no_grad():
        twin_fast = twin.correct(x, c, h)
    with torch.enable_grad():
        torch.testing.assert_close(twin_fast, twin.correct(x, c, h), rtol=1e-5, atol=1e-4)
    assert not torch.equal(twin_fast, seen[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.22])
@pytest.mark.parametrize("shape", [(2, 37, D), (9, D), (3, D), (4, 1, D)])
@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_many_token_inference_paths_match_the_tensor_path(direction, dtype, scale, shape):
    """Without autograd, a site over several tokens (prefill) takes a lean path: the sublayer
    direction above the decoding size, a low-rank learned direction from two tokens on."""
    site = DeltaSite(D, direction=direction, rank=4 if direction == "learned" else None, scale=scale)
    with torch.no_grad():
        for i, weight in enumerate(p for n, p in site.named_parameters() if n.endswith("weight")):
            weight.normal_(generator=torch.Generator().manual_seed(i))
        site.gate.bias.fill_(-0.5)
        site.target.bias.fill_(0.3)
    site.to(dtype)
    gen = torch.Generator().manual_seed(23)
    x, c, h = (torch.randn(shape, generator=gen).mul(s).to(dtype) for s in (40.0, 1.0, 3.0))
    x.view(-1, D)[0].zero_()  # a zero stream row (a zero pad embedding) stays finite
    if direction == "learned":
        path, cached = site._correct_learned_tokens, site.direction.up.weight
    else:
        path, cached = site._correct_tokens, site.target.bias
        if h.numel() <= 8 * D and dtype == torch.float32:  # the decode path
            path = functools.partial(_decode_path, site, kernel=False)  # (beta is logged: Python)
    site.beta_log = []
    with torch.inference_mode():
        fast = site.correct(x, c, h)
        fast_beta, site.beta_log = torch.stack(site.beta_log).mean(), []
        assert torch.equal(path(x, c, h).view(h.shape).to(dtype), fast)  # correct() took this path
        cached.mul_(-1.0)  # the cached heads must notice in-place updates
        fast_updated = site.correct(x, c, h)
        cached.mul_(-1.0)
        site.beta_log = []
    with torch.enable_grad():
        slow = site.correct(x, c, h)
    (slow_beta,), site.beta_log = site.beta_log, None
    assert fast.dtype == dtype and fast.shape == h.shape and torch.isfinite(fast).all()
    assert (slow.float() - h.float()).abs().max() > 1.0  # the heads matter
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast.float(), slow.float(), **tol)
    torch.testing.assert_close(fast_beta.float(), slow_beta.float(), **tol)
    assert not torch.equal(fast, fast_updated)
    site.force_beta = 0.0
    with torch.no_grad():
        assert torch.equal(site.correct(x, c, h), h)
    site.force_beta = 0.5
    with torch.no_grad():
        forced = site.correct(x, c, h)
    with torch.enable_grad():
        torch.testing.assert_close(forced.float(), site.correct(x, c, h).float(), **tol)


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-learned"])
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, D), (2, 40, D)])
def test_correction_stays_fp32_under_autocast(recipe, grad, shape):
    """Mixed-precision training and inference run under autocast, which would put the heads' and
    the Gram's matmuls in bf16; every path computes the correction as without autocast."""
    spec = load_recipe(recipe)
    site = DeltaSite(D, direction=spec.direction, rank=spec.rank)
    with torch.no_grad():
        for i, param in enumerate(site.parameters()):
            param.normal_(generator=torch.Generator().manual_seed(i))
    gen = torch.Generator().manual_seed(24)
    x, c, h = (torch.randn(shape, generator=gen) * s for s in (400.0, 1.0, 3.0))
    with torch.set_grad_enabled(grad):
        plain = site.correct(x, c, h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = site.correct(x, c, h)
    assert (plain - h).abs().max() > 10.0  # the heads matter
    torch.testing.assert_close(autocast, plain, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.22])
@pytest.mark.parametrize("shape", [(1, 1, D), (1, D)])
def test_learned_one_token_fast_path_matches_the_tensor_path(dtype, scale, shape):
    """A low-rank learned direction decodes through u = down(c/|c|) and the cached up^T up."""
    site = DeltaSite(D, direction="learned", rank=4, scale=scale)
    with torch.no_grad():
        for weight in (site.gate.weight, site.target.weight, site.direction.down.weight, site.direction.up.weight):
            weight.normal_(generator=torch.Generator().manual_seed(weight.numel()))
        site.gate.bias.fill_(-0.5)
        site.target.bias.fill_(0.3)
    site.to(dtype)
    gen = torch.Generator().manual_seed(22)
    x, c, h = (torch.randn(shape, generator=gen).mul(s).to(dtype) for s in (40.0, 1.0, 3.0))
    with torch.no_grad():
        fast = site.correct(x, c, h)
        assert torch.equal(site._correct_learned_token(x, c, h), fast)  # correct() took the fast path
        site.direction.up.weight.mul_(-1.0)  # the cached direction must notice in-place updates
        fast_flipped = site.correct(x, c, h)
        site.direction.up.weight.mul_(-1.0)
    with torch.enable_grad():
        slow = site.correct(x, c, h)
    assert fast.dtype == dtype and fast.shape == h.shape
    assert (slow.float() - h.float()).abs().max() > 1.0  # the heads matter
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(fast.float(), slow.float(), **tol)
    assert not torch.equal(fast, fast_flipped)
    site.force_beta = 0.0
    with torch.no_grad():
        assert torch.equal(site.correct(x, c, h), h)
