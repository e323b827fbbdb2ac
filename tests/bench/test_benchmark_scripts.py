"""benchmarks/gpu.py --cpu runs end to end and prints its table with finite numbers; benchmarks/kernel_count.py
counts more kernels for a converted tiny Llama than for its original; benchmarks/site_call.py times a site;
benchmarks/kernel_build.py builds the fused kernels for GPUs; benchmarks/site_step.py times a site's training step."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.models import tiny_model
from helpers.training import subprocess_env

# slow: a child process that imports torch, transformers and peft, and profiled forwards and backwards
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EAGER = ("prefill", "decode b1", "decode b8")
TRAIN = ("train step vs full", "train step vs LoRA")
TRAIN_COMPILED = ("train step compiled vs full", "train step compiled vs LoRA")
COMPILED_MEMORY = "train memory compiled vs LoRA"
COMPILED = ("prefill compiled", "decode b1 compiled", "decode b8 compiled", *TRAIN_COMPILED, COMPILED_MEMORY)


def _script(name: str):
    """A benchmark script imported as a module (benchmarks/ is not a package), with the folder on the path
    as when it runs as a script (its shared module, benchmark_models, is imported by name)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def _positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def _run(script: str, *args: str, env: dict | None = None) -> str:
    """A benchmark script's stdout, run as a user runs it (from the repository root); it must exit 0."""
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=REPO,
        env=subprocess_env(env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def gpu_cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "cells.json"
    return _run("gpu.py", "--cpu", "--json", str(out)), json.loads(out.read_text())


def test_gpu_script_on_cpu_prints_every_row_with_the_targets(gpu_cpu_run):
    stdout, cells = gpu_cpu_run
    assert "targets: prefill >= 0.97x" in stdout
    assert "torch " in stdout and "no GPU (CPU run)" in stdout
    table = stdout[stdout.index("model ") :]
    rows = [line for line in table.splitlines() if line.startswith("tiny Llama (random)")]
    measures = {row["measure"] for row in cells}
    assert set(EAGER + TRAIN + COMPILED) | {"max |dlogits|", "train memory vs LoRA", "kernels decode b1"} <= measures
    assert len(rows) == len(cells)
    for measure in measures:
        assert any(f" {measure} " in line for line in rows), measure
    assert "not reached" not in stdout  # every cell ran or says why it did not


def test_gpu_script_on_cpu_measures_finite_numbers(gpu_cpu_run):
    _, cells = gpu_cpu_run
    by_measure = {row["measure"]: row for row in cells}
    for measure in EAGER + TRAIN:
        row = by_measure[measure]
        assert _positive(row["baseline"]) and _positive(row["reference"]), row
        assert _positive(row["reference_ratio"]), row
        # the fused column holds a number or says why it has none (no deltafy.fused, no CUDA)
        assert _positive(row["fused"]) or isinstance(row["fused"], str), row
        assert "error" not in str(row["fused"]), row
    for measure in COMPILED:  # compiled rows are off on CPU unless --compile: a note, not a number
        assert "--compile" in by_measure[measure]["reference"]
    floor = by_measure["train step floor vs full"]  # the frozen original's backward, beside the same full FT
    assert _positive(floor["reference"]) and floor["baseline"] == by_measure["train step vs full"]["baseline"]
    assert floor["fused"].startswith("floor: the original, every weight frozen"), floor
    kernels = by_measure["kernels decode b1"]  # the device run counts a decode token's kernels too
    assert _positive(kernels["baseline"]) and kernels["reference"] > kernels["baseline"], kernels
    memory = by_measure["train memory vs LoRA"]
    assert "CPU" in memory["baseline"] and memory["target"] == ["<=", 1.1]


def test_gpu_script_runs_only_the_rows_asked_for(tmp_path):
    out = tmp_path / "cells.json"
    _run("gpu.py", "--cpu", "--only", "dlogits,b1", "--json", str(out))
    by_measure = {row["measure"]: row for row in json.loads(out.read_text())}
    assert _positive(by_measure["decode b1"]["reference"])
    for measure in ("max |dlogits|", "decode b1 compiled"):  # (they ran, or say why not: no fused path, on CPU)
        assert by_measure[measure]["baseline"] != "not run (--only)", measure
    for measure in ("prefill", "decode b8", *TRAIN):
        assert by_measure[measure]["reference"] == "not run (--only)", measure


def test_gpu_script_times_a_compiled_training_step_of_every_arm(tmp_path):
    """As `deltafy train --compile` runs: full FT, LoRA r=8 and the heads each under torch.compile."""
    out = tmp_path / "cells.json"
    _run("gpu.py", "--cpu", "--compile", "--only", "step compiled", "--json", str(out))
    by_measure = {row["measure"]: row for row in json.loads(out.read_text())}
    for measure in TRAIN_COMPILED:
        row = by_measure[measure]
        assert _positive(row["baseline"]) and _positive(row["reference"]), row
        assert "traces the formula" in row["fused"], row
    full, lora = (by_measure[measure] for measure in TRAIN_COMPILED)
    assert full["reference"] == lora["reference"]  # one heads-only arm, against two baselines
    assert "CPU" in by_measure[COMPILED_MEMORY]["baseline"]  # (peak memory: CUDA's allocator only)
    assert by_measure["train step vs full"]["reference"] == "not run (--only)"


def test_gpu_script_times_one_parameter_a_site_after_the_table():
    """--packed: a batch-1 compiled decode of the original, the converted model and the same heads packed
    into one parameter a site (what that format would win on a device), whose logits are the converted's."""
    stdout = _run("gpu.py", "--cpu", "--compile", "--only", "b1 compiled", "--packed")
    line = next(line for line in stdout.splitlines() if "one parameter a site" in line)
    speeds = re.findall(r"(original|reference|one parameter a site) ([\d,.]+) \(", line)
    assert [name for name, _ in speeds] == ["original", "reference", "one parameter a site"], line
    assert all(float(value.replace(",", "")) > 0 for _, value in speeds), line
    assert line.endswith("max |dlogits| packed vs reference 0"), line


def test_kernel_counts_of_a_tiny_llama(capsys):
    kernels = _script("kernel_count")
    interpret_before = os.environ.get("TRITON_INTERPRET")
    original = tiny_model("llama-tied")
    result = kernels.count_kernels(original, phases=("decode", "train"), decode_steps=2, batch=1, seq_len=16)
    assert not any(type(m).__name__ == "DeltaSite" for m in original.modules())  # converted a copy
    assert result["sites"] == 4  # two layers, attention and MLP writes
    for phase in ("decode", "train"):
        counts = kernels.derived(result, phase)
        assert counts["original"] > 0, result["notes"]
        assert counts["reference"] > counts["original"]
        assert counts["per_site"] > 0 and math.isfinite(counts["per_site"])
        assert counts["ratio"] == pytest.approx(counts["reference"] / counts["original"])
        # the fused path, its launches counted on CPU: far fewer ops than the formula's
        assert 0 < counts["fused"] < counts["reference"], result["notes"]
    assert result["counts"]["decode"]["fused"] == result["counts"]["decode"]["original"] + 4  # a launch a site
    # each cell is printed as it is counted (a run that a timeout cuts short keeps those)
    progress = capsys.readouterr().err
    assert f"decode, reference: {result['counts']['decode']['reference']:g} (" in progress
    assert "TRITON_INTERPRET" not in os.environ or os.environ["TRITON_INTERPRET"] == interpret_before
    names = result["names"]["decode"]["reference"]
    assert all(not name.startswith("aten::view") and name not in kernels.NO_WORK for name in names)


def test_kernel_counts_of_compiled_checkpointed_layers():
    """Trained with every layer checkpointed, the compiled converted model runs its layers as graphs: until
    the training loop let dynamo apply a forward's effects once (deltafy.training.job.compiled_checkpointing),
    the sites' stash broke the graph at each checkpoint and the layers ran eagerly, as many kernels as eager."""
    kernels = _script("kernel_count")
    result = kernels.count_kernels(
        tiny_model("llama-tied"), phases=("train",), with_compile=True, batch=1, seq_len=16, checkpointing=True
    )
    counts = result["counts"]["train"]
    assert counts["reference"] > 0 and counts["compiled reference"] < counts["reference"] / 3, result["notes"]
    assert counts["compiled original"] < counts["original"] / 3, result["notes"]


def _site_call(*args: str, env: dict | None = None) -> tuple[dict, str, dict]:
    """site_call.py --decode at width 64: its call rows (issue, total µs), what follows them up to the decode
    table (notes, the profile), and the decode rows (µs a token, added a site)."""
    stdout = _run(
        "site_call.py", "--width", "64", "--calls", "20", "--rounds", "2", "--decode", "--layers", "2", *args, env=env
    )
    calls, decode = stdout.split("\ndecode, batch 1: ")
    lines = calls.splitlines()
    assert "cpu float32, shape (1, 1, 64)" in lines[0]
    times, rest = {}, []
    for line in lines[2:]:
        if rest or line.startswith("  ") or not line.strip():  # (an indented line is a note)
            rest.append(line)
        else:
            times[line[:26].strip()] = tuple(float(v) for v in line.split()[-2:])
    for issue, total in times.values():
        assert 0 < issue <= total and math.isfinite(total)
    head, _, *rows = decode.splitlines()
    assert head == "a 2-layer Llama of width 64, 4 sites"
    per_token = {row[:26].strip(): [float(v) for v in row.split()[-2:]] for row in rows}
    assert per_token["original"][1] == 0 and all(us > 0 and math.isfinite(us) for us, _ in per_token.values())
    return times, "\n".join(rest), per_token


def test_site_call_prints_its_rows_with_finite_times():
    times, rest, per_token = _site_call("--profile", "formula")
    warm = {"site, formula", "RMSNorm (yardstick)"}
    assert set(times) == {*warm, *(f"{name}, cold" for name in warm), "residual add (yardstick)", "empty module call"}
    assert "site, fused: deltafy.fused.supported() is False" in rest
    # the decode split, per site over the original (timings are not asserted: they are the script's output)
    assert set(per_token) == {"original", "capture and write alone", "formula"}
    # the profile of the formula's decode tokens: the site's own functions among those that took the most time
    assert "profile of 16 decode tokens, formula" in rest
    assert "(formula)" in rest.split("Ordered by: internal time")[1]


def test_site_call_splits_the_fused_call_from_its_launch():
    """Under Triton's interpreter the fused rows run on CPU: "fused, no launch" is the fused path's call with
    its launch returning h, which the script undoes (the fused row, timed after it in the next round, still
    launches: an interpreted launch costs milliseconds, a call without one microseconds)."""
    times, rest, per_token = _site_call("--tokens", "2", env={"TRITON_INTERPRET": "1"})
    assert "site, fused" in times and "site, fused, cold" in times
    assert set(per_token) == {"original", "capture and write alone", "formula", "fused", "fused, no launch"}
    assert per_token["fused"][1] > 10 * per_token["fused, no launch"][1]


@pytest.fixture
def convert_fuses(monkeypatch):
    """deltafy.convert as it behaves where CUDA and triton are: every site on the fused path."""
    import deltafy.fused
    import deltafy.surgery

    monkeypatch.setattr(deltafy.surgery, "enable_where_available", lambda m: deltafy.fused.enable(m, force=True))


def test_the_reference_column_is_the_formula_where_convert_fuses(convert_fuses, monkeypatch):
    kernels = _script("kernel_count")
    result = kernels.count_kernels(tiny_model("llama-tied"), phases=("decode",), decode_steps=2)
    counts = kernels.derived(result, "decode")
    assert counts["per_site"] > 10  # the formula's dozens of ops, not the fused path's one launch
    assert result["counts"]["decode"]["fused"] == result["counts"]["decode"]["original"] + 4

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # gpu.py imports its neighbour speed.py
    gpu = _script("gpu")
    args = argparse.Namespace(dtype=torch.float32, device="cpu", recipe="ddl-scalar", force_fused=False)
    run = gpu.ModelRun(gpu.Bench(args, gpu.SMALL, gpu.Table()), "tiny-llama")
    sites = [m for m in run.models["reference"].modules() if type(m).__name__ == "DeltaSite"]
    assert sites and all("fused" not in vars(site) for site in sites)


def test_the_command_line_check_passes_on_cpu():
    stdout = _run("gpu_cli.py")
    assert "no GPU (CPU run)" in stdout and stdout.rstrip().endswith("all checks passed")
    assert stdout.count("\nok ") >= 14 and "FAIL" not in stdout


def _build_rows(stdout: str) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    """kernel_build.py's rows: (model, (registers, stack bytes) forward, the same backward)."""
    rows = []
    for line in stdout.splitlines()[2:]:
        cells = re.fullmatch(r"\s*(\S+) .* (\d+) / (\d+) +(\d+) / (\d+)", line)
        assert cells, line
        rows.append((cells[1], (int(cells[2]), int(cells[3])), (int(cells[4]), int(cells[5]))))
    return rows


def test_the_fused_kernels_build_for_a100_h100_and_h200():
    """Every variant of the fused kernels (dtype, heads' dtype, direction, gate, channels) compiles to a cubin
    for sm_90, and the ddl-scalar recipe's at every width for sm_80; the fused tests run the kernels under
    Triton's interpreter, which never compiles them (a loop variable that changes type passes there)."""
    rows = _build_rows(_run("kernel_build.py", "--every-variant", "--widths", "smollm2-135m"))
    assert len(rows) == 8 + 16 + 16  # fp32; bf16 and fp16 with their heads in their own dtype or fp32
    assert all(0 < kernel[0] <= 255 for _, *kernels in rows for kernel in kernels)
    rows = _build_rows(_run("kernel_build.py", "--arch", "80"))
    assert [row[0] for row in rows] == ["smollm2-135m", "gpt2", "llama-1b", "llama-3b", "7b", "13b", "70b", "widest"]


@pytest.mark.parametrize(
    "args, tolerance",
    [
        (("--widths", "64,576"), 2e-2),
        (("--widths", "64", "--direction", "learned", "--channels", "3", "--dtype", "float32"), 1e-4),
    ],
    ids=["ddl-scalar-bf16", "learned-3-channels-fp32"],
)
def test_site_step_times_both_paths_and_their_gap(args, tolerance):
    """Under Triton's interpreter the fused rows run on CPU: each width's row has both times and the fused
    path's output and gradients within the dtype's rounding of the formula's (bf16: a few of its 2^-8 steps)."""
    stdout = _run("site_step.py", "--tokens", "8", "--reps", "1", *args, env={"TRITON_INTERPRET": "1"})
    rows = [line.split(maxsplit=4) for line in stdout.splitlines()[2:]]
    assert [int(row[0]) for row in rows] == [int(w) for w in args[1].split(",")]
    for _, formula, fused, ratio, gaps in rows:
        assert _positive(float(formula)) and _positive(float(fused)) and _positive(float(ratio))
        assert all(0 <= float(gap) < tolerance for gap in gaps.split(", ")), gaps


def _kernel_rows(stdout: str) -> dict:
    """compiled.py's kernel rows: {phase label: ((Triton, extern) original, (Triton, extern) converted)}."""
    rows = {}
    for line in stdout.splitlines():
        if " extern" in line:
            label, cells = line[:24].strip(), line[24:].split()  # "14 + 19 extern  14 + 19 extern"
            rows[label] = ((int(cells[0]), int(cells[2])), (int(cells[4]), int(cells[6])))
    return rows


def test_compiled_sites_fuse_into_the_kernels_around_them():
    """inductor's Triton code for a compiled decode step of a converted tiny SmolLM2 holds the original's
    kernels and no more (each site's reductions and write fuse into the norm and the residual add beside it),
    and the host part measures both models and their guards."""
    stdout = _run("compiled.py", "--phases", "decode", "--layers", "2", "--rounds", "1", "--steps", "2", "--packed")
    (original, converted) = _kernel_rows(stdout)["decode step, batch 1"]
    assert original[0] > 0 and original[1] > 0, stdout
    assert converted == original, stdout
    host = stdout[stdout.index("compiled decode step on the host") :].splitlines()
    cells = {line[:28].strip(): line[28:].split() for line in host[2:5]}
    assert all(float(v) > 0 for v in cells["µs a token (median)"][:2]), host
    nodes = [int(v) for v in cells["guard tree, nodes"][:3]]
    assert 0 < nodes[0] < nodes[1], host  # the heads and the site calls are guarded too
    # one parameter a site (same logits, checked by the script): how many guards that saves is torch's to
    # decide (fewer under torch 2.13, 19 more of 1,973 under 2.15), so only that it was measured
    assert nodes[2] > nodes[0] and float(cells["µs a token (median)"][2]) > 0, host


def test_compiled_learned_direction_adds_its_two_matmuls_a_site():
    stdout = _run("compiled.py", "--only", "kernels", "--phases", "decode", "--recipe", "ddl-learned")
    (original, converted) = _kernel_rows(stdout)["decode step, batch 1"]
    assert converted[1] == original[1] + 2 * 4, stdout  # down and up of a rank-16 direction, at 4 sites
    assert original[0] <= converted[0] <= original[0] + 4, stdout  # at most one more kernel a site
