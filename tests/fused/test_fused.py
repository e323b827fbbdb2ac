"""deltafy.fused, checked without a GPU: its Triton kernels run under the interpreter (conftest.py) on CPU
tensors and must give DeltaSite.formula's write and gradients, and ddl_reference's stream, for every
direction, gate, dtype and the expanded state, with heads that matter; and follow every change of the
weights, since the fused path reads the parameters on every call."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers.models import open_gates, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import deltafy
import deltafy.fused as fused
from deltafy.fused import kernel
from deltafy.modeling_deltafy import DeltaSite, DeltaSpec, SiteSpec, ddl_reference

D = 32
SHAPE = (2, 3, D)
DIRECTIONS = {"sublayer": ("sublayer", None), "learned-full": ("learned", None), "learned-rank4": ("learned", 4)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# max |fused - formula| / max |formula|: one rounding of the fp32 result apart, at most a few
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


def _site(direction="sublayer", channels=1, gate="logit", scale=0.5, seed=0) -> DeltaSite:
    """A site whose every head matters: random gate weights around a logit near 0 (beta of order 1),
    random targets with a bias, a random direction, and a strength of 0.8."""
    kind, rank = DIRECTIONS[direction]
    spec = SiteSpec("attn", "self_attn", scale=scale)
    site = DeltaSite(
        DeltaSpec("model.layers", D, (spec,), direction=kind, rank=rank, channels=channels, gate=gate), spec
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in site.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
        site.gate.bias.fill_(0.3)
        site.target.weight.mul_(0.3)
        site.target.bias.copy_(0.7 + 0.1 * torch.randn(channels, generator=gen))
        if site.strength is not None:
            site.strength.fill_(0.8)
    return site


def _inputs(site: DeltaSite, dtypes=(torch.float32,) * 3, seed=1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x_shape = SHAPE if site.channels == 1 else (site.channels, *SHAPE)
    x, c, h = (
        3 * torch.randn(x_shape, generator=gen),
        torch.randn(SHAPE, generator=gen),
        torch.randn(SHAPE, generator=gen),
    )
    return tuple(t.to(dtype) for t, dtype in zip((x, c, h), dtypes, strict=True))


def _fused(site, x, c, h):
    site.fused = fused.fused_write
    try:
        return site(x, c, h)
    finally:
        del site.fused


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str = "") -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    err = (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)
    assert err <= tolerance, f"{what}: relative error {err:.3g} > {tolerance:g}"


def _grads(write, site, inputs, grad_out):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    params = dict(site.named_parameters())
    for p in params.values():
        p.grad = None
    out = write(site, *inputs)
    out.backward(grad_out)
    grads = {"x": inputs[0].grad, "c": inputs[1].grad, "h": inputs[2].grad}
    return out, grads | {name: p.grad for name, p in params.items()}


def _assert_same_gradients(site, inputs, tolerance):
    grad_out = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(7)).to(inputs[2].dtype)
    want_out, want = _grads(DeltaSite.formula, site, inputs, grad_out)
    got_out, got = _grads(_fused, site, inputs, grad_out)
    _close(got_out, want_out, tolerance, "h'")
    assert set(got) == set(want) and len(want) >= 7  # x, c, h, gate (2), target (2), and the rest
    for name in want:
        assert got[name] is not None, f"no gradient for {name}"
        _close(got[name], want[name], tolerance, f"d/d{name}")


class _Counted:
    """A kernel that counts its launches (kernel[grid](...))."""

    def __init__(self, kernel, counts: Counter, name: str):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        self.counts[self.name] += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch) -> Counter:
    counts = Counter()
    for name in ("forward", "backward"):
        monkeypatch.setattr(kernel, f"_{name}_kernel", _Counted(getattr(kernel, f"_{name}_kernel"), counts, name))
    return counts


# -- the interpreter ------------------------------------------------------------------------------


def test_the_kernels_run_under_the_interpreter():
    assert kernel.INTERPRETED, "triton was imported before tests/fused/conftest.py set TRITON_INTERPRET=1"
    assert fused.supported("cpu") and fused.supported(torch.device("cpu"))
    assert not fused.supported("meta")


# -- forward --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("gate", ["logit", "strength"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_forward_is_the_formula_and_the_reference(direction, gate, channels, dtype, launches):
    site = _site(direction, channels, gate).to(dtype)
    x, c, h = _inputs(site, (dtype,) * 3)
    with torch.no_grad():
        got, want = _fused(site, x, c, h), site.formula(x, c, h)
        assert launches == {"forward": 1}
        assert (want.float() - h.float()).abs().max() > 0.1  # the heads matter
        _close(got, want, TOLERANCE[dtype], "h'")
        # the stream x + m h' against the formula written out in float64
        _close((x.double() + site.scale * got.double()), ddl_reference(site, x, c, h), TOLERANCE[dtype], "stream")


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_zero_strength_leaves_h_bitwise(direction, channels, dtype):
    """A fresh conversion (alpha = 0) is the original model bitwise, on the fused path too; and alpha
    still has its gradient there."""
    site = _site(direction, channels, "strength").to(dtype)
    with torch.no_grad():
        site.strength.zero_()
    x, c, h = _inputs(site, (dtype,) * 3)
    with torch.no_grad():
        out = _fused(site, x, c, h)
    assert torch.equal(out, h if channels == 1 else h.expand(channels, *h.shape))
    _assert_same_gradients(site.float(), [t.float() for t in (x, c, h)], TOLERANCE[torch.float32])
    assert site.strength.grad.abs().item() > 0


def test_low_precision_parameters_and_large_streams():
    """A model cast to fp16 whole: fp16 heads, and a stream whose sum of squares overflows fp16."""
    site = _site("learned-rank4", 3, "strength").half()
    x, c, h = _inputs(site, (torch.float16,) * 3)
    x = (x.float() * 300).half()
    with torch.no_grad():
        out = _fused(site, x, c, h)
        assert torch.isfinite(out).all()
        _close(out, site.formula(x, c, h), TOLERANCE[torch.float16])


def test_strided_inputs():
    """Views the layer code hands over as they are: rows apart in memory, channels out of order."""
    site = _site("learned-full", 3, "strength")
    x, c, h = _inputs(site)
    wide = torch.randn(*SHAPE[:-1], 2 * D)
    c = wide[..., D:]  # rows 2d apart
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # token dims swapped in memory
    h = h.transpose(0, 1).contiguous().transpose(0, 1)
    with torch.no_grad():
        _close(_fused(site, x, c, h), site.formula(x, c, h), TOLERANCE[torch.float32])
    _assert_same_gradients(site, (x, c, h), TOLERANCE[torch.float32])


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


NO_WORK = {"view", "_unsafe_view", "t", "empty", "empty_like", "reshape"}


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_write_is_one_kernel_besides_the_direction_matmuls(direction, channels, monkeypatch):
    """What a decode step pays per site: the fused kernel and, for a learned direction, its matmul(s);
    no other op that computes (the interpreter's own copies are left out by stubbing the launch)."""
    site = _site(direction, channels, "strength")
    x, c, h = _inputs(site)
    launched = []
    monkeypatch.setattr(kernel, "_forward_kernel", _Stub(launched))
    with torch.no_grad(), _Ops() as ops:
        _fused(site, x, c, h)
    assert len(launched) == 1
    matmuls = {"sublayer": 0, "learned-full": 1, "learned-rank4": 2}[direction]
    assert [op for op in ops.ops if op not in NO_WORK] == ["mm"] * matmuls


class _Stub:
    def __init__(self, launched: list):
        self.launched = launched

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append(grid)


def test_the_formula_runs_where_the_kernels_do_not(monkeypatch, launches):
    site = _site("sublayer", 1, "strength")
    x, c, h = _inputs(site)
    with torch.no_grad():
        # float64, and a shape the layer never passes (c broadcast over h): the formula, exactly
        assert torch.equal(
            _fused(site.double(), x.double(), c.double(), h.double()), site.formula(x.double(), c.double(), h.double())
        )
        site.float()
        assert torch.equal(_fused(site, x, c[:1], h), site.formula(x, c[:1], h))
        # under torch.compile (which traces the formula)
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            assert torch.equal(_fused(site, x, c, h), site.formula(x, c, h))
        # on the CPU without the interpreter
        monkeypatch.delenv("TRITON_INTERPRET")
        assert torch.equal(_fused(site, x, c, h), site.formula(x, c, h))
        assert not launches
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert not torch.equal(_fused(site, x, c, h), site.formula(x, c, h))  # (the kernel's rounding differs)


def test_torch_compile_traces_the_formula(launches):
    """Under torch.compile the fused seam runs the formula, in one graph (no break at the seam)."""
    site = _site("learned-rank4", 3, "strength")
    x, c, h = _inputs(site)
    site.fused = fused.fused_write
    compiled = torch.compile(site, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, c, h), site.formula(x, c, h), rtol=0, atol=0)
    assert not launches


# -- gradients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("gate", ["logit", "strength"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_gradients_are_the_formulas(direction, gate, channels, dtype, launches):
    """Gradients for x, c, h and every head parameter; in bf16/fp16 the inputs' (the heads stay fp32)."""
    site = _site(direction, channels, gate)
    _assert_same_gradients(site, _inputs(site, (dtype,) * 3), TOLERANCE[dtype])
    assert launches == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("direction", ["sublayer", "learned-rank4"])
def test_mixed_dtypes_under_autocast(direction, channels):
    """Under autocast each input is read in its own dtype and the heads run in fp32, as in the formula."""
    site = _site(direction, channels, "strength")
    for dtypes in [(torch.bfloat16, torch.float32, torch.bfloat16), (torch.float32, torch.bfloat16, torch.float32)]:
        inputs = _inputs(site, dtypes)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                got, want = _fused(site, *inputs), site.formula(*inputs)
            _close(got, want, TOLERANCE[dtypes[2]], "h'")
            _assert_same_gradients(site, inputs, TOLERANCE[torch.bfloat16])


# -- weight changes: the parameters are read on every call ----------------------------------------


def _change_copy(site, new):
    with torch.no_grad():
        for name, param in site.named_parameters():
            param.copy_(new[name])


def _change_data(site, new):
    for name, param in site.named_parameters():
        param.data = new[name].clone()


def _change_state_dict(site, new):
    site.load_state_dict(new)


def _change_state_dict_assign(site, new):
    site.load_state_dict({k: v.clone() for k, v in new.items()}, assign=True)


def _change_optimizer(site, new):
    opt = torch.optim.AdamW(site.parameters(), lr=0.05)
    x, c, h = _inputs(site, seed=5)
    for _ in range(3):
        opt.zero_grad()
        _fused(site, x, c, h).square().mean().backward()
        opt.step()


@pytest.mark.parametrize(
    "change", [_change_copy, _change_data, _change_state_dict, _change_state_dict_assign, _change_optimizer]
)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_the_fused_write_follows_every_weight_change(direction, change):
    site = _site(direction, 3, "strength")
    x, c, h = _inputs(site)
    site.fused = fused.fused_write
    with torch.no_grad():
        before = site(x, c, h)
    gen = torch.Generator().manual_seed(3)
    change(site, {n: p.detach() + 0.3 * torch.randn(p.shape, generator=gen) for n, p in site.named_parameters()})
    with torch.no_grad():
        after = site(x, c, h)
        want = site.formula(x, c, h)
    assert (after - before).abs().max() > 1e-2, "the change did not move the write; the test would be trivial"
    _close(after, want, TOLERANCE[torch.float32])


# -- enable / disable on a converted model --------------------------------------------------------

IDS = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("recipe", ["ddl-scalar", "ddl-scalar-logit", "ddl-learned", "ddl-expanded", "ddl-write-only"])
def test_enable_and_disable_on_a_converted_model(recipe, launches):
    original = _logits(tiny_model("llama-tied"))
    model = deltafy.convert(tiny_model("llama-tied"), recipe)
    sites = [m for m in model.modules() if isinstance(m, DeltaSite)]
    assert fused.enable(model) == len(sites) == 4
    assert all(site.fused is fused.fused_write for site in sites)
    if recipe != "ddl-scalar-logit":  # alpha = 0: the original model bitwise (the logit gate's beta is 3e-8)
        assert torch.equal(_logits(model), original)
    open_gates(model)
    launches.clear()
    got = _logits(model)
    kernels = {"forward": 4} if recipe != "ddl-write-only" else {}  # a kernel a site; the control runs the formula
    assert launches == kernels
    assert fused.disable(model) == 4 and fused.disable(model) == 0
    assert all("fused" not in vars(site) for site in sites)
    want = _logits(model)
    assert launches == kernels
    assert (want - original).abs().max() > 1e-2  # the heads matter
    _close(got, want, 1e-5, "logits")


@pytest.mark.parametrize("recipe", ["ddl-learned", "ddl-expanded"])
def test_a_training_step_has_the_formulas_gradients(recipe, launches):
    model = deltafy.convert(tiny_model("llama-tied"), recipe)
    open_gates(model)
    heads = {n: p for n, p in model.named_parameters() if ".delta." in n}

    def grads():
        model.zero_grad()
        model(input_ids=IDS, labels=IDS).loss.backward()
        return {n: p.grad.clone() for n, p in heads.items()}

    want = grads()
    fused.enable(model)
    got = grads()
    assert launches == {"forward": 4, "backward": 4}
    for name in want:
        _close(got[name], want[name], 1e-4, name)


def test_enable_switches_nothing_on_the_cpu_without_the_interpreter(monkeypatch, launches):
    model = deltafy.convert(tiny_model("llama-tied"), "ddl-scalar")
    open_gates(model)
    want = _logits(model)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not fused.supported("cpu")
    assert fused.enable(model) == 0
    assert all("fused" not in vars(m) for m in model.modules())
    assert fused.enable(model, force=True) == 4  # forced: the formula still runs where the kernels cannot
    assert torch.equal(_logits(model), want)
    assert not launches


def test_convert_and_load_switch_it_on_only_where_cuda_and_triton_are(tmp_path, monkeypatch):
    """deltafy.convert and deltafy.load call enable_where_available: every site on a CUDA machine with
    triton (unless DELTAFY_FUSED=0), none here."""
    cuda = torch.cuda.is_available()
    model = deltafy.convert(tiny_model("llama-tied"), "ddl-scalar")
    assert sum("fused" in vars(m) for m in model.modules()) == (4 if cuda else 0)
    deltafy.save(model, tmp_path / "ckpt")
    assert sum("fused" in vars(m) for m in deltafy.load(tmp_path / "ckpt").modules()) == (4 if cuda else 0)
    monkeypatch.setenv("DELTAFY_FUSED", "0")
    assert fused.enable_where_available(deltafy.load(tmp_path / "ckpt")) == 0


def test_supported_without_the_interpreter_in_a_fresh_process():
    code = (
        "import torch, deltafy.fused as f; print(f.supported('cpu'), f.supported('cuda') == torch.cuda.is_available())"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["False", "True"]


@pytest.mark.slow
def test_every_weight_change_is_seen_through_remote_code(tmp_path, launches):
    """A checkpoint loaded by plain transformers (DeltaSite from the checkpoint's own copy of the
    modeling file, found by class name), fused, after every way users change weights (the checks of
    tests/model/test_weight_changes.py), decoded token by token and in one forward."""
    import helpers.weight_change_check as check
    from transformers import AutoModelForCausalLM

    model = deltafy.convert(tiny_model("llama-untied"), "ddl-expanded")
    open_gates(model)
    path = deltafy.save(model, tmp_path / "out")

    def load():
        loaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
        assert type(next(m for m in loaded.modules() if type(m).__name__ == "DeltaSite")) is not DeltaSite
        assert fused.enable(loaded) == 4
        return loaded

    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    results = check.change_every_way(load, ids)
    assert len(results) == 7 and launches["forward"] > 0 and launches["backward"] > 0  # (the optimizer's steps)
    for way, (decode_error, stale_error, change) in results.items():
        assert decode_error <= 1e-4 and stale_error <= 1e-4, way
        assert change > 1e-2, way
