"""The DDL math of DeltaSite, checked against the formula written out (ddl_reference, in float64) and
against what the paper's delta rule does at beta = 1 (overwrite) and beta = 2 (reflect)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.models import gates_at

from deltafy.modeling_deltafy import DeltaDirection, DeltafyError, DeltaSite, DeltaSpec, SiteSpec, ddl_reference

D = 16


def _tensors(seed: int = 0, shape=(3, 5, D), dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(shape, generator=gen)
    c = torch.randn(shape, generator=gen)
    h = torch.randn(shape, generator=gen)
    return x.to(dtype), c.to(dtype), h.to(dtype)


def _new(scale=1.0, **spec) -> DeltaSite:
    """A fresh site of a spec with ``spec``'s fields (the rest its defaults), of scale ``scale``."""
    site = SiteSpec("attn", "self_attn", scale=scale)
    return DeltaSite(DeltaSpec("model.layers", D, (site,), **spec), site)


def _site(direction="sublayer", rank=None, scale=1.0, seed=0, target_bias=0.7, **spec):
    """A site with heads that matter: a random gate, a target bias, a random full-rank direction."""
    torch.manual_seed(seed)
    site = _new(scale, direction=direction, rank=rank, **spec)
    with torch.no_grad():
        site.gate.weight.normal_()
        site.gate.bias.fill_(0.3)
        site.target.bias.fill_(target_bias)
        if site.direction is not None and rank is None:
            site.direction.proj.weight.normal_()
    return site


def _rms(t: torch.Tensor) -> torch.Tensor:
    return torch.sqrt((t * t).mean(-1, keepdim=True))


def _unit_context(c: torch.Tensor) -> torch.Tensor:
    """The heads read the context normalized to unit length: c / sqrt(|c|^2 + 1e-6)."""
    return c / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-6)


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=-1, keepdim=True)


def _readout(k, t):
    return (k * t).sum(-1)


def _run(site, x, c, h):
    with torch.no_grad():
        return site(x, c, h)


# -- the sublayer direction (the paper's k = h / |h|) ---------------------------------------------


def test_sublayer_beta_one_overwrites_readout_with_v():
    site = _site("sublayer", target_bias=0.7)
    x, c, h = _tensors()
    with gates_at(site, 1.0):
        new = _run(site, x, c, h)
    k = _unit(h)
    v = 0.7 * _rms(x).squeeze(-1)
    delta = new - h
    # the correction is along k only, and it sets k^T x to v exactly
    torch.testing.assert_close(_readout(k, x + delta), v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta, _readout(k, delta).unsqueeze(-1) * k, rtol=1e-5, atol=1e-5)


def test_sublayer_beta_two_reflects_readout():
    site = _site("sublayer", target_bias=-0.4)
    x, c, h = _tensors(1)
    with gates_at(site, 2.0):
        new = _run(site, x, c, h)
    k = _unit(h)
    v = -0.4 * _rms(x).squeeze(-1)
    torch.testing.assert_close(_readout(k, x + new - h), 2 * v - _readout(k, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_beta_zero_is_bitwise_identity(direction):
    site = _site(direction)
    x, c, h = _tensors(2)
    with gates_at(site, 0.0):
        assert torch.equal(_run(site, x, c, h), h)
        site.bfloat16()
        assert torch.equal(_run(site, x.bfloat16(), c.bfloat16(), h.bfloat16()), h.bfloat16())


def test_v_is_in_units_of_stream_rms():
    """Scaling the stream by s scales the target v (and so the new readout) by s."""
    site = _site("sublayer", target_bias=0.5)
    x, c, h = _tensors(3)
    k = _unit(h)
    with gates_at(site, 1.0):
        for s in (1.0, 10.0, 1000.0):
            readout = _readout(k, s * x + _run(site, s * x, c, h) - h)
            torch.testing.assert_close(readout, 0.5 * s * _rms(x).squeeze(-1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("beta", [None, 1.0, 2.0])
@pytest.mark.parametrize("scale", [1.0, 0.22])
@pytest.mark.parametrize(
    "direction, rank", [("sublayer", None), ("learned", None), ("learned", 3)], ids=["sublayer", "full", "rank-3"]
)
@pytest.mark.parametrize("shape", [(3, 5, D), (1, 1, D), (4, D)], ids=["batch", "one-token", "rows"])
def test_matches_the_paper(direction, rank, scale, beta, shape):
    """Every shape the model feeds a site (prefill, one decoding token, rows) and both directions."""
    site = _site(direction, rank=rank, scale=scale)
    with torch.no_grad():
        site.target.weight.normal_()  # v depends on the context too
    x, c, h = _tensors(4, shape)
    with gates_at(site, beta) if beta is not None else contextlib.nullcontext():
        got = x + scale * _run(site, x, c, h)
        torch.testing.assert_close(got.double(), ddl_reference(site, x, c, h), rtol=1e-5, atol=1e-5)
        with torch.enable_grad():  # autograd runs the same code
            assert torch.equal(x + scale * site(x, c, h).detach(), got)


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("direction, rank", [("sublayer", None), ("learned", 3)], ids=["sublayer", "rank-3"])
def test_strength_gate_and_expanded_channels_match_the_formula(direction, rank, channels):
    """alpha beta (v_j - k^T x_j) k on every channel x_j of an expanded stream, with its own target v_j."""
    site = _site(direction, rank=rank, scale=0.22, gate="strength", gate_bias=0.5, channels=channels)
    with torch.no_grad():
        site.target.weight.normal_()
        site.target.bias.copy_(torch.linspace(-1.0, 1.0, channels))
        site.strength.fill_(0.6)
    x, c, h = _tensors(8, (2, 5, D))
    if channels > 1:  # the channels differ: each reads its own k^T x_j
        x = torch.stack([x * (1 + j) + j for j in range(channels)])
    got = x + 0.22 * _run(site, x, c, h)
    assert got.shape == x.shape
    torch.testing.assert_close(got.double(), ddl_reference(site, x, c, h), rtol=1e-5, atol=1e-5)
    assert (got - x - 0.22 * h).abs().max() > 0.1  # the correction is there


# -- the write-only control (erase: false) -----------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("direction, rank", [("sublayer", None), ("learned", 3)], ids=["sublayer", "rank-3"])
def test_write_only_writes_beta_v_along_k_and_erases_nothing(direction, rank, channels):
    """erase: false is x + m h + alpha beta v k, written out here by hand, and ddl_reference agrees; with
    the erase term the same heads give another stream (the term the control leaves out)."""
    spec = dict(gate="strength", gate_bias=0.5, channels=channels)
    erasing, control = (_site(direction, rank=rank, scale=0.22, erase=erase, **spec) for erase in (True, False))
    with torch.no_grad():
        for site in (erasing, control):
            site.target.weight.normal_(generator=torch.Generator().manual_seed(3))
            site.strength.fill_(0.6)
    x, c, h = _tensors(9, (2, 5, D))
    if channels > 1:
        x = torch.stack([x * (1 + j) + j for j in range(channels)])
    got = x + 0.22 * _run(control, x, c, h)
    torch.testing.assert_close(got.double(), ddl_reference(control, x, c, h), rtol=1e-5, atol=1e-5)
    cu = _unit_context(c)
    beta = 2 * torch.sigmoid(cu @ control.gate.weight.T + control.gate.bias) * 0.6
    kr = 0.22 * h if direction == "sublayer" else control.direction(cu)
    k = kr / torch.sqrt((kr * kr).sum(-1, keepdim=True) + control.eps**2)
    xs = x if channels > 1 else x.unsqueeze(0)
    v = (cu @ control.target.weight.T + control.target.bias).movedim(-1, 0).unsqueeze(-1) * _rms(xs)
    by_hand = xs + 0.22 * h + beta * v * k
    torch.testing.assert_close(got, by_hand if channels > 1 else by_hand[0], rtol=1e-5, atol=1e-5)
    assert (got - (x + 0.22 * _run(erasing, x, c, h))).abs().max() > 0.1
    assert "write-only" in repr(control) and "write-only" not in repr(erasing)


def test_write_only_is_the_original_at_init_bitwise_and_trains_from_step_one():
    """alpha = 0 keeps the write h bitwise; v starts at rms(x), else alpha and v would both be zero and
    neither would have a gradient."""
    site = _new(gate="strength", gate_bias=0.0, erase=False)
    x, c, h = _tensors(2)
    assert torch.equal(_run(site, x, c, h), h)
    site(x, c, h).square().sum().backward()
    assert site.strength.grad.abs().item() > 0


def test_erase_must_be_a_boolean():
    with pytest.raises(DeltafyError, match="erase must be true or false"):
        DeltaSpec("model.layers", D, (SiteSpec("attn", "self_attn"),), erase="no")


def test_default_init_is_nearly_identity():
    site = _new()
    x, c, h = _tensors(5)
    out = _run(site, x, c, h)
    beta = 2 * torch.sigmoid(torch.tensor(site.gate_bias_init))
    assert 0 < (out - h).abs().max() <= 10 * beta * x.abs().max()


# -- the learned direction ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", [None, 4], ids=["full-rank", "rank-4"])
def test_learned_beta_one_overwrites_readout_along_learned_k(rank):
    site = _site("learned", rank=rank, target_bias=1.3)
    x, c, h = _tensors(6)
    with gates_at(site, 1.0):
        new = _run(site, x, c, h)
    with torch.no_grad():
        k = _unit(site.direction(_unit_context(c)))
    v = 1.3 * _rms(x).squeeze(-1)
    delta = new - h
    torch.testing.assert_close(_readout(k, x + delta), v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(delta, _readout(k, delta).unsqueeze(-1) * k, rtol=1e-5, atol=1e-5)
    # k is not the sublayer's direction: the learned head really picks its own
    assert (_readout(k, _unit(h)).abs() < 0.99).all()


@pytest.mark.parametrize("rank", [None, 4], ids=["full-rank", "rank-4"])
def test_learned_beta_two_reflects_readout(rank):
    site = _site("learned", rank=rank, target_bias=0.2)
    x, c, h = _tensors(7)
    with torch.no_grad():
        k = _unit(site.direction(_unit_context(c)))
    with gates_at(site, 2.0):
        reflected = _readout(k, x + _run(site, x, c, h) - h)
    torch.testing.assert_close(reflected, 2 * 0.2 * _rms(x).squeeze(-1) - _readout(k, x), rtol=1e-5, atol=1e-5)


def test_learned_full_rank_starts_at_normalized_context():
    site = _new(direction="learned")
    assert torch.equal(site.direction.proj.weight, torch.eye(D))
    _, c, _ = _tensors(9)
    with torch.no_grad():
        k = _unit(site.direction(_unit_context(c)))
    torch.testing.assert_close(k, _unit(c))


def test_learned_rank_has_factored_shapes():
    direction = DeltaDirection(D, rank=5)
    assert direction.down.weight.shape == (5, D)
    assert direction.up.weight.shape == (D, 5)
    assert not hasattr(direction, "proj")
    assert sum(p.numel() for p in direction.parameters()) == 2 * 5 * D


def test_bad_direction_and_scale_are_rejected():
    with pytest.raises(DeltafyError, match="direction"):
        _new(direction="foo")
    with pytest.raises(DeltafyError, match="scale must be a finite number > 0"):
        _new(scale=0.0)


# -- precision --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_low_precision_tensors_compute_in_fp32(direction, dtype):
    site = _site(direction).to(dtype)
    x, c, h = _tensors(10, dtype=dtype)
    with gates_at(site, 1.0):
        out = _run(site, x, c, h)
        fp32 = _site(direction)
        fp32.load_state_dict({k: v.float() for k, v in site.state_dict().items()})
        ref = _run(fp32, x.float(), c.float(), h.float())
    assert out.dtype == dtype and torch.isfinite(out).all()
    # the result is the fp32 result rounded once, not low-precision arithmetic throughout
    torch.testing.assert_close(out, ref.to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, casts", [(torch.float32, 0), (torch.bfloat16, 3), (torch.float16, 3)])
@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_the_formula_casts_only_the_context_the_write_and_its_result(direction, dtype, casts):
    """Decoding pays a dispatched call per op: the heads' weights, biases, alpha and the stream x are promoted
    by the ops that read them, not cast by calls of their own (a learned direction's matmul casts its own)."""
    from torch.profiler import profile

    site = _site(direction, gate="strength").to(dtype)
    x, c, h = _tensors(13, dtype=dtype)
    with torch.no_grad(), profile() as prof:
        site.formula(x, c, h)
    top = [e.name for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    assert top.count("aten::to") == casts + (casts > 0 and direction == "learned")  # (direction.proj.weight)
    assert top.count("aten::addcmul") == 4  # (what was profiled: the formula's multiply-adds)


def test_fp16_large_stream_does_not_overflow():
    """|x| ~ 1e3 over d = 16 has a sum of squares above fp16's range; the heads must still be finite."""
    site = _site("sublayer", target_bias=0.0).half()
    x, c, h = _tensors(11, dtype=torch.float16)
    x = (x.float() * 300).half()
    with gates_at(site, 1.0):
        out = _run(site, x, c, h)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


@pytest.mark.parametrize("recipe", [("sublayer", None), ("learned", 16)], ids=["ddl-scalar", "ddl-learned"])
@pytest.mark.parametrize("grad", [False, True])
def test_correction_stays_fp32_under_autocast(recipe, grad):
    """Mixed-precision training and inference run under autocast, which would put the heads'
    matmuls in bf16; the correction is computed as without autocast."""
    site = _new(direction=recipe[0], rank=recipe[1])
    with torch.no_grad():
        for i, param in enumerate(site.parameters()):
            param.normal_(generator=torch.Generator().manual_seed(i))
    x, c, h = (t * s for t, s in zip(_tensors(24, (2, 40, D)), (100.0, 1.0, 1.0), strict=True))
    with torch.set_grad_enabled(grad):
        plain = site(x, c, h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = site(x, c, h)
    assert (plain - h).abs().max() > 10.0  # the heads matter
    torch.testing.assert_close(autocast, plain, rtol=0, atol=0)


# -- gradients --------------------------------------------------------------------------------


@pytest.mark.parametrize("direction, rank", [("sublayer", None), ("learned", None), ("learned", 4)])
def test_gradients_reach_every_head_at_default_init(direction, rank):
    site = _new(direction=direction, rank=rank)  # default init: beta ~ 3e-8, target 0
    x, c, h = _tensors(12)
    x.requires_grad_(True)
    h.requires_grad_(True)
    probe = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    (site(x, c, h) * probe).sum().backward()
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


@pytest.mark.parametrize("direction", ["sublayer", "learned"])
def test_zero_stream_row_gives_finite_gradients(direction):
    site = _new(direction=direction)
    x, c, h = _tensors(14)
    x = x.clone()
    x[0, 0] = 0.0  # e.g. a token whose embedding row is zero (padding_idx rows are zero at init)
    x.requires_grad_(True)
    site(x, c, h).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in site.parameters())
