"""The compiled decode kernel: built once into deltafy's cache, never in the way where it cannot be.

Each test starts the once-per-process build afresh (``_kernel`` emptied) in a folder of its own.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from conftest import HAS_C_COMPILER, tiny_model

import deltafy
from deltafy import modeling_deltafy_native as native
from deltafy.modeling_deltafy import DeltaSite, delta_sites

needs_compiler = pytest.mark.skipif(not HAS_C_COMPILER, reason="no C compiler on this machine")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not tried to build the kernel yet, with its own cache folder."""
    monkeypatch.setattr(native, "_kernel", [])
    monkeypatch.setenv("DELTAFY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DELTAFY_NATIVE", raising=False)
    return tmp_path / "cache"


def _decoded_by(site: DeltaSite) -> str:
    """Which implementation correct() uses for one token on this site (built afresh)."""
    site._decode = None
    x, c, h = (torch.randn(1, 1, site.hidden_size) for _ in range(3))
    with torch.no_grad():
        site.correct(x, c, h)
    return "compiled" if site._decode[7] is not None else "python"


@needs_compiler
def test_kernel_is_built_once_into_the_cache(fresh, monkeypatch):
    assert native.decode_kernel() is not None
    (library,) = [p for p in fresh.rglob("*") if p.is_file()]
    assert library.parent == fresh / "kernels" and library.suffix == ".so"
    assert [p.name for p in fresh.iterdir()] == ["kernels"]  # no build folder left behind
    built = library.stat()
    monkeypatch.setattr(native, "_kernel", [])  # the next process
    assert native.decode_kernel() is not None
    assert (library.stat().st_ino, library.stat().st_mtime_ns) == (built.st_ino, built.st_mtime_ns)
    assert _decoded_by(DeltaSite(16)) == "compiled"


def test_DELTAFY_NATIVE_0_turns_it_off(fresh, monkeypatch):
    monkeypatch.setenv("DELTAFY_NATIVE", "0")
    assert native.decode_kernel() is None
    assert _decoded_by(DeltaSite(16)) == "python"
    assert not fresh.exists()


def test_without_a_compiler_decoding_takes_the_python_path_quietly(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CC", str(fresh.parent / "no-such-cc"))
    with caplog.at_level(logging.INFO):
        assert native.decode_kernel() is None
    assert caplog.records == [] and not fresh.exists()


def test_a_failing_compiler_falls_back_with_one_warning(fresh, monkeypatch, caplog):
    cc = fresh.parent / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'decode.c:1: error: something is wrong' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    with caplog.at_level(logging.WARNING):
        assert native.decode_kernel() is None
        assert native.decode_kernel() is None  # tried once
    (record,) = caplog.records
    assert "something is wrong" in record.getMessage() and "Python path" in record.getMessage()
    assert [p for p in fresh.rglob("*") if p.is_file()] == []  # no half-built library left to load
    site = DeltaSite(16)
    with torch.no_grad():
        site.gate.bias.fill_(0.0)
        site.target.bias.fill_(0.5)
    assert _decoded_by(site) == "python"
    x, c, h = (torch.randn(1, 1, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with torch.no_grad():
        fast = site.correct(x, c, h)
    with torch.enable_grad():
        torch.testing.assert_close(fast, site.correct(x, c, h), rtol=1e-5, atol=1e-4)
    assert not torch.equal(fast, h)


@needs_compiler
@pytest.mark.parametrize("width", [4, 21, 576])  # no vector loop, a vector loop and a tail, SmolLM2's
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_matches_the_tensor_path_at_any_width(width, rows):
    site = DeltaSite(width, scale=0.5)
    gen = torch.Generator().manual_seed(width)
    with torch.no_grad():
        site.gate.weight.normal_(generator=gen)
        site.target.weight.normal_(generator=gen)
        site.gate.bias.fill_(-0.5)
        site.target.bias.fill_(0.3)
    x, c, h = (torch.randn(rows, 1, width, generator=gen) * s for s in (40.0, 1.0, 3.0))
    with torch.no_grad():
        fast = site.correct(x, c, h)
    assert site._decode[7] is not None  # correct() had the kernel
    with torch.enable_grad():
        slow = site.correct(x, c, h)
    assert (slow - h).abs().max() > 0.1  # the heads matter
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-4)


@needs_compiler
def test_a_cache_that_cannot_be_written_builds_for_the_process(fresh, monkeypatch):
    blocker = fresh.parent / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("DELTAFY_CACHE", str(blocker / "cache"))
    assert native.decode_kernel() is not None
    assert blocker.is_file()


@torch.no_grad()
def _greedy(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and per-step logits of 12 greedy decoding steps with the KV cache."""
    out = model.generate(
        input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=0, output_logits=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


@needs_compiler
def test_a_model_decodes_the_same_with_and_without_the_kernel(monkeypatch):
    """Greedy decoding of a converted model with open gates: the compiled kernel and the Python
    path agree token for token (their dot products differ only in rounding)."""
    model = deltafy.convert(tiny_model("llama-untied")).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, site in delta_sites(model):
            site.gate.weight.normal_(generator=gen)
            site.target.weight.normal_(generator=gen)
            site.target.bias.fill_(1.0)
            site.gate.bias.fill_(0.0)
    ids = torch.randint(0, 128, (1, 6), generator=gen)
    runs = {}
    for impl in ("compiled", "python"):
        monkeypatch.setattr(native, "_kernel", [native.decode_kernel()] if impl == "compiled" else [None])
        twin = copy.deepcopy(model)  # (a copy builds its decode path afresh)
        runs[impl] = _greedy(twin, ids)
        assert all((site._decode[7] is not None) == (impl == "compiled") for _, site in delta_sites(twin))
    assert torch.equal(runs["compiled"][0], runs["python"][0])
    torch.testing.assert_close(runs["compiled"][1], runs["python"][1], rtol=1e-4, atol=1e-4)
    _, stock_logits = _greedy(tiny_model("llama-untied").eval(), ids)
    assert (stock_logits - runs["compiled"][1]).abs().max() > 1e-2  # the heads matter
