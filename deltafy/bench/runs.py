"""One training run of a bench: ``run_training`` in this process (peak CUDA memory) or, on a CPU, in
a fresh process, whose own peak RSS is then the run's alone (this process's would also hold every
earlier run's heap)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from ..errors import DeltafyError
from ..files import METRICS_FILE, read_metrics, run_summary
from ..options import TrainOptions
from ..training.job import NonFiniteLoss

PEAK_RSS, PEAK_CUDA = "peak RSS", "peak CUDA memory"
ERROR_KINDS = {"NonFiniteLoss": NonFiniteLoss, "DeltafyError": DeltafyError}  # what a child run may report


def memory_kind(isolate: bool) -> str | None:
    if torch.cuda.is_available():
        return PEAK_CUDA
    return PEAK_RSS if isolate else None


def train_run(model_dir: Path, data: list[str], out: Path, options: TrainOptions, eval_data, isolate: bool) -> dict:
    """Train one run into ``out`` (replacing whatever an unfinished earlier try left there) and
    return its numbers: losses, seconds per step, trainable parameters, peak memory (None where not
    measured)."""
    if isolate and not torch.cuda.is_available():
        return _in_child(model_dir, data, out, options, eval_data)
    return train(model_dir, data, out, options, eval_data)


def _in_child(model_dir, data, out, options, eval_data) -> dict:
    """The run in ``python -m deltafy.bench.child``: a new interpreter, not a multiprocessing child,
    which would run the caller's main script again (a script without a main guard: a fork bomb)."""
    import json
    import os
    import subprocess
    import tempfile

    job = {"model_dir": str(model_dir), "data": list(data), "out": str(out), "eval_data": eval_data}
    job["options"] = options.model_dump(mode="json")
    # No CUDA here: DeepSpeed (imported by accelerate) would warn that it fell back to the CPU in every run.
    env = dict(os.environ, DS_ACCELERATOR="cpu", TQDM_DISABLE="1")
    package_root = str(Path(__file__).resolve().parents[2])  # this deltafy, however the caller imported it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="deltafy-bench-") as tmp:
        spec, answer = Path(tmp, "job.json"), Path(tmp, "answer.json")
        spec.write_text(json.dumps(job))
        proc = subprocess.Popen(
            [sys.executable, "-m", "deltafy.bench.child", str(spec), str(answer)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # libraries' warnings, once per run, would bury the bench's progress
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, stderr = proc.communicate()
        except BaseException:  # the bench was interrupted: its run must not go on writing without it
            _stop(proc)
            raise
        reply = json.loads(answer.read_text()) if answer.is_file() else {}
    if "numbers" in reply:
        return reply["numbers"]
    if "error" in reply:
        raise ERROR_KINDS.get(reply["kind"], DeltafyError)(reply["error"])
    lines = stderr.strip().splitlines() or [f"exit code {proc.returncode}"]
    raise RuntimeError(f"the training run in {out} failed in its own process: {lines[-1]}")


def _stop(proc, grace: float = 60.0) -> None:
    """SIGTERM stops a training run at its next step boundary; one that does not stop in ``grace``
    seconds is killed."""
    import subprocess

    proc.terminate()
    try:
        proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def train(model_dir, data, out, options, eval_data) -> dict:
    from ..training.job import run_training

    cuda = torch.cuda.is_available()
    if cuda:  # an earlier run's leftovers in a reference cycle (accelerate's first Accelerator holds its model)
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
    result = run_training(
        str(model_dir),
        data,
        out,
        options,
        eval_data=eval_data,
        overwrite=True,
        show_progress=False,
        notice=lambda message: None,  # what it could say concerns resuming, which a bench run never does
    )
    return {
        "trainable_params": result.trainable_params,
        "loss_before": result.loss_before,
        "loss_after": result.loss_after,
        "seconds_per_step": result.seconds_per_step,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def curve(out: Path) -> list[list[float]]:
    """Held-out loss against step from a run's metrics: before training at step 0, each evaluation,
    and the final evaluation (the number the table reports) at the last step."""
    records = read_metrics(out / METRICS_FILE)
    summary = run_summary(records)
    points = {0: summary["loss_before"]}
    points |= {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r and "step" in r}
    points[summary["steps"]] = summary["loss_after"]
    return [[step, loss] for step, loss in sorted(points.items())]


def keep_only_the_record(folder: Path) -> None:
    """A sweep run is scored by its validation loss alone: its model (a full copy of the base where LoRA
    merges into it) is dropped, its metrics and run record kept."""
    import shutil

    from ..files import METRICS_FILE, RECORD_FILE, STATE_DIR

    for path in folder.iterdir():
        if path.name == STATE_DIR:
            for inner in path.iterdir():
                if inner.name != RECORD_FILE:
                    shutil.rmtree(inner) if inner.is_dir() else inner.unlink()
        elif path.name != METRICS_FILE:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
