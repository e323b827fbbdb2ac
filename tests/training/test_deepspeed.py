"""DeepSpeed ZeRO-3: `accelerate launch` with examples/accelerate_deepspeed_zero3.yaml on 2 CPU
processes (gloo) with the shared tiny llama, held to what an FSDP run is held to (test_fsdp): the
losses and heads of a one-process run, one complete output written once, the base bitwise as it was.
"""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch
from helpers.training import REPO, read_metrics, read_tensors, step_records
from test_fsdp import (  # noqa: F401 (single: the one-process reference fixture)
    STEPS,
    check_heads_trained_base_unchanged,
    check_loads_both_ways,
    launch,
    single,
)

from deltafy.training.checkpoints import newest_complete

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("token_cache")]

# Every parameter partitioned, none kept whole: transformers' default thresholds (10 × hidden size
# elements) would leave the tiny model's heads unpartitioned, and the gathering untested.
PARTITION_ALL = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_live_parameters": 0,
        "stage3_max_reuse_distance": 0,
    },
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_allow_untested_optimizer": True,
}


def accelerate(config) -> list[str]:
    with socket.socket() as probe:  # a free port: another job on the machine may hold accelerate's default
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [
        sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port),
        "--config_file", str(config), "--num_processes", "2",
    ]  # fmt: skip


def engine_states(out, step: int = 2) -> list[dict]:
    """DeepSpeed's per-rank module states in checkpoint-``step``."""
    folder = out / "training" / f"checkpoint-{step}" / f"global_step{step}"
    files = sorted(folder.glob("zero_pp_rank_*_model_states.pt"))
    assert len(files) == 2, f"no DeepSpeed engine state in {folder}: the run was not DeepSpeed"
    return [torch.load(f, map_location="cpu", weights_only=False) for f in files]


def check_deepspeed_run(proc, out, single, tiny) -> None:  # noqa: F811
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone evaluates, saves and reports
    assert "built successfully" not in proc.stdout + proc.stderr  # no C++ kernel compiled on CPU

    # Checkpoints: complete, and without the frozen base (neither whole nor in per-rank fragments).
    state_dir = out / "training"
    assert newest_complete(state_dir)[0] == state_dir / f"checkpoint-{STEPS}"
    base_bytes = sum(t.numel() * t.element_size() for t in read_tensors(tiny.delta).values())
    for state in engine_states(out):
        assert state.get("frozen_param_fragments") is None
    engine_bytes = sum(f.stat().st_size for f in (state_dir / "checkpoint-2" / "global_step2").iterdir())
    assert engine_bytes < base_bytes / 4

    steps = step_records(read_metrics(out))
    expected = [r["loss"] for r in step_records(read_metrics(single))]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # written once, not once per rank
    assert [r["loss"] for r in steps] == pytest.approx(expected, abs=1e-4)

    assert sorted(p.name for p in out.glob("config*.json")) == ["config.json"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "hidden leftovers in the output"
    heads, start = check_heads_trained_base_unchanged(out, single, tiny)
    checkpoint_heads = read_tensors(state_dir / "checkpoint-2")  # gathered whole, not empty partitions
    assert checkpoint_heads.keys() == set(heads)
    assert all(checkpoint_heads[k].shape == start[k].shape for k in heads)


def test_accelerate_deepspeed_zero3_matches_one_process(tiny, tmp_path, single):  # noqa: F811
    out = tmp_path / "zero3"
    proc = launch(accelerate(REPO / "examples" / "accelerate_deepspeed_zero3.yaml"), tiny, out)
    check_deepspeed_run(proc, out, single, tiny)
    check_loads_both_ways(out)


def test_zero3_partitioned_heads_are_gathered_for_every_save(tiny, tmp_path, single):  # noqa: F811
    (tmp_path / "zero3.json").write_text(json.dumps(PARTITION_ALL))
    (tmp_path / "accelerate.yaml").write_text(
        "distributed_type: DEEPSPEED\nnum_machines: 1\nnum_processes: 2\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'zero3.json'}\n  zero3_init_flag: false\n"
    )
    out = tmp_path / "partitioned"
    proc = launch(accelerate(tmp_path / "accelerate.yaml"), tiny, out)
    check_deepspeed_run(proc, out, single, tiny)
    # The heads really were partitioned: the engine holds empty tensors where they live.
    module = engine_states(out)[0]["module"]
    assert module and all(module[k].numel() == 0 for k in module if ".delta." in k)


def test_deepspeed_resume_is_refused_in_one_line(tiny, tmp_path):
    out = tmp_path / "resumed"
    config = accelerate(REPO / "examples" / "accelerate_deepspeed_zero3.yaml")
    first = launch(config, tiny, out, "--steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    proc = launch(config, tiny, out, "--resume")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("--resume does not work with DeepSpeed yet" in line for line in errors)
    assert "internal error" not in proc.stderr


def test_compile_under_zero3_is_refused_in_one_line(tiny, tmp_path):
    """ZeRO-3 gathers each partitioned parameter in a hook torch.compile does not trace: the graph would
    read the empty partitions. (ZeRO-2 leaves parameters whole, and compiles.)"""
    out = tmp_path / "compiled"
    proc = launch(accelerate(REPO / "examples" / "accelerate_deepspeed_zero3.yaml"), tiny, out, "--compile")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors and all("--compile does not work with DeepSpeed ZeRO-3" in line for line in errors), proc.stderr
    assert "internal error" not in proc.stderr
    assert not out.exists()  # refused before anything was written
