"""A training run's state in --out: the guarded folder, its lock, the checked resume, checkpoints
that are complete or absent, signals and full disks. Real runs of the tiny llama (2-3 steps)."""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import assert_one_line_error
from helpers.training import (
    interrupted_at,
    read_metrics,
    read_tensors,
    run_cli,
    shared_tokenizer,
    step_records,
    subprocess_env,
)

import deltafy
from deltafy.errors import DeltafyError
from deltafy.files import LOCK_FILE
from deltafy.options import options_from
from deltafy.recipe import load_recipe
from deltafy.sources.lock import RunLock
from deltafy.training.checkpoints import HEADS_FILE, TRAINER_STATE
from deltafy.training.job import run_training

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("token_cache")]

SHORT = ("--seq-len", "32", "--batch-size", "2", "--lr", "0.05")


def opts(**overrides):
    values = dict(steps=2, seq_len=32, batch_size=2, lr=0.05, save_every=1)
    return options_from(load_recipe().training.model_dump(), **{**values, **overrides})  # as `deltafy train` would


def train(tiny, out: Path, resume: bool = False, data=None, model=None, notices=None, **overrides):
    return run_training(
        str(model or tiny.delta),
        [str(data or tiny.train_txt)],
        out,
        opts(**overrides),
        eval_data=[str(tiny.held_txt)],
        resume=resume,
        show_progress=False,
        notice=(notices if notices is not None else []).append,
    )


def train_cli(tiny, out, *extra, cwd, model=None, **kwargs):
    return run_cli(
        "train", model or tiny.delta, "--data", tiny.train_txt, "--eval-data", tiny.held_txt, "--out", out,
        *SHORT, *extra, cwd=cwd, **kwargs,
    )  # fmt: skip


def checkpoint_names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "training").iterdir() if p.is_dir())


def error_lines(proc) -> list[str]:
    """stderr less the plain progress lines a non-terminal gets."""
    return [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("train: step")]


@pytest.fixture(scope="module")
def finished(tiny, tmp_path_factory):
    """A finished 2-step run (checkpoints 1 and 2), copied by tests that change it."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(tiny, out)
    return out


def copy_run(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    return out


# -- a guarded --out --------------------------------------------------------------------------------


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def test_out_that_is_the_input_is_refused_even_with_overwrite(tiny, tmp_path):
    before = snapshot(tiny.delta)
    for extra in ((), ("--overwrite",), ("--resume",)):
        proc = train_cli(tiny, tiny.delta, "--steps", "1", *extra, cwd=tmp_path)
        line = assert_one_line_error(proc, "is the input model folder", "choose another --out")
        assert "--overwrite" not in line  # the refusal must not suggest destroying the input
    assert snapshot(tiny.delta) == before


def test_resume_and_overwrite_together_are_refused_as_bench_refuses_them(tiny, finished, tmp_path):
    """--overwrite would delete the checkpoints --resume continues from: train took both silently."""
    before = snapshot(finished)
    proc = train_cli(tiny, finished, "--resume", "--overwrite", cwd=tmp_path)
    assert_one_line_error(proc, "--resume and --overwrite contradict each other")
    assert snapshot(finished) == before


def test_out_that_contains_the_input_or_is_a_file(tiny, tmp_path, monkeypatch):
    with pytest.raises(DeltafyError, match="contains the input model folder") as err:
        run_training(str(tiny.delta), [str(tiny.train_txt)], tiny.delta.parent, opts(), overwrite=True)
    assert "--overwrite" not in str(err.value)
    file = tmp_path / "out.txt"
    file.write_text("mine")
    proc = train_cli(tiny, file, cwd=tmp_path)
    assert_one_line_error(proc, "exists and is not a folder", "choose another --out")
    assert file.read_text() == "mine"
    # Refused before the model or its tokenizer is loaded.
    import deltafy.checkpoint

    for name in ("load", "load_tokenizer"):
        monkeypatch.setattr(deltafy.checkpoint, name, lambda *a, **k: pytest.fail("loaded before --out was checked"))
    with pytest.raises(DeltafyError, match="exists and is not a folder"):
        train(tiny, file)


def test_a_second_run_on_the_same_out_is_refused_naming_the_first(tiny, tmp_path):
    out = tmp_path / "run"
    with RunLock(out):
        holder = json.loads((out / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["started"] and holder["host"]
        proc = train_cli(tiny, out, "--steps", "1", cwd=tmp_path)
        assert_one_line_error(proc, "in use by another deltafy run", f"pid {os.getpid()}", holder["started"])
        assert os.listdir(out) == [LOCK_FILE]  # the refused run wrote nothing
    assert not out.exists()  # nothing was written: the lock's folder goes with it
    train(tiny, out, steps=1)  # the lock is free again
    assert not (out / LOCK_FILE).exists() and (out / "config.json").is_file()


def test_a_lock_that_cannot_be_made_is_a_one_line_error(tmp_path):
    # (a folder that cannot be written in: as root, a lock file's name taken by a folder stands for it)
    (tmp_path / "run" / LOCK_FILE).mkdir(parents=True)
    with pytest.raises(DeltafyError, match=f"cannot write --out {tmp_path / 'run'}: Is a directory"):
        RunLock(tmp_path / "run").__enter__()
    assert (tmp_path / "run" / LOCK_FILE).is_dir()  # the folder it found stays as it was


def test_a_folder_a_run_holds_is_not_replaced_by_another_command(tiny, finished, tmp_path):
    """convert --overwrite (or deltafy.save) of a live run's --out would leave the run writing into a
    deleted folder; refused before any work, and again as the output is swapped in."""
    from deltafy.sources.folders import atomic_dir

    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    with RunLock(out):
        proc = run_cli("convert", tiny.stock, "--out", out, "--overwrite", cwd=tmp_path)
        assert_one_line_error(proc, f"{out} is in use by another deltafy run", f"pid {os.getpid()}")
        model = deltafy.load(tiny.delta)
        with pytest.raises(DeltafyError, match="in use by another deltafy run"):
            deltafy.save(model, out, overwrite=True)
    assert snapshot(out) == before
    with pytest.raises(DeltafyError, match="in use by another deltafy run"):
        with atomic_dir(out, overwrite=True) as tmp:  # the run starts while the output is being written
            (tmp / "config.json").write_text("{}")
            lock = RunLock(out).__enter__()
    lock.__exit__(None, None, None)
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    deltafy.save(model, out, overwrite=True)  # no run holds it now
    assert not (out / "training").exists() and deltafy.load(out) is not None


def test_a_lock_of_a_killed_run_is_free(tiny, tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from deltafy.sources.lock import RunLock; RunLock({str(out)!r}).__enter__(); input()",
        ],
        stdin=subprocess.PIPE,
        env=subprocess_env(),
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / LOCK_FILE).is_file() or not (out / LOCK_FILE).read_text():
            assert time.monotonic() < deadline and holder.poll() is None
            time.sleep(0.05)
        with pytest.raises(DeltafyError, match=f"pid {holder.pid}"):
            train(tiny, out, steps=1)
    finally:
        holder.kill()
        holder.wait()
    train(tiny, out, steps=1)  # the kernel released the dead process's lock


# -- a checked resume ---------------------------------------------------------------------------------


def test_resume_refuses_changed_settings_naming_each(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(tiny.train_txt.read_text()[::-1])
    with pytest.raises(DeltafyError) as err:
        train(tiny, out, resume=True, steps=3, seq_len=16, data=other, train="lora")
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"cannot resume {out}")
    for field in ("--seq-len 32 → 16", "--train heads → lora", f"--data {tiny.train_txt} → {other}"):
        assert field in message, message
    assert "--steps" not in message  # a budget may change
    # The same file, edited: named as such.
    data = tmp_path / "train.txt"
    data.write_text(tiny.train_txt.read_text())
    out2 = tmp_path / "run2"
    train(tiny, out2, data=data)
    data.write_text(tiny.train_txt.read_text().upper())
    with pytest.raises(DeltafyError, match="the same inputs now hold different text"):
        train(tiny, out2, resume=True, steps=3, data=data)


def test_resume_after_changing_train_mode_is_one_line(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    proc = train_cli(tiny, out, "--steps", "3", "--save-every", "1", "--train", "heads+lora", "--resume", cwd=tmp_path)
    assert_one_line_error(proc, "cannot resume", "--train heads → heads+lora")


def test_resume_of_a_finished_run_trains_nothing_and_more_steps_continue(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    before = snapshot(out)
    notices = []
    result = train(tiny, out, resume=True, notices=notices)  # a restarted job that had finished: not an error
    assert len(notices) == 1 and notices[0].startswith("nothing to train: the run in") and "2 of 2 steps" in notices[0]
    assert result.already_finished and result.steps == 2
    summary = [r for r in read_metrics(out) if r.get("event") == "summary"][-1]
    assert (result.loss_before, result.loss_after) == (summary["loss_before"], summary["loss_after"])
    assert [r["step"] for r in step_records(read_metrics(out))] == [1, 2]
    assert snapshot(out) == before  # nothing trained, nothing written
    proc = train_cli(tiny, out, "--steps", "2", "--resume", cwd=tmp_path)
    assert proc.returncode == 0 and "nothing to train" in proc.stderr and "Traceback" not in proc.stderr
    notices = []
    result = train(tiny, out, resume=True, steps=3, eval_every=5, notices=notices)
    assert result.steps == 3
    assert [r["step"] for r in step_records(read_metrics(out))] == [1, 2, 3]
    assert notices == ["resuming with --eval-every 50 → 5", "resuming with --steps 2 → 3"]
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-3"]
    deltafy.load(out)
    # The added step trains at the new schedule's rate for it, as a straight 3-step run's third step does, not
    # at the rate the old 2-step schedule had decayed to (0: the step would change nothing)
    straight = train(tiny, tmp_path / "straight", steps=3).out
    rates = [[r["learning_rate"] for r in step_records(read_metrics(run))] for run in (out, straight)]
    assert rates[0][2] > 0 and rates[0][2] == pytest.approx(rates[1][2], rel=1e-6)
    kept, third = (read_tensors(out / "training" / f"checkpoint-{step}") for step in (2, 3))
    assert any(not kept[key].equal(third[key]) for key in kept), "the added step changed nothing"


def test_resume_of_a_run_whose_model_was_not_written_writes_it(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    (out / "config.json").unlink()  # the final write failed (config.json goes in last)
    notices = []
    result = train(tiny, out, resume=True, notices=notices)
    assert notices == ["the run already trained 2 of 2 steps: writing its model from checkpoint-2"]
    assert result.steps == 2 and [r["step"] for r in step_records(read_metrics(out))] == [1, 2]
    assert read_tensors(out).keys() == read_tensors(finished).keys()
    for key, value in read_tensors(out / "training" / "checkpoint-2").items():
        assert read_tensors(out)[key].equal(value), key


def test_a_half_written_newest_checkpoint_is_skipped(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    (out / "training" / "checkpoint-2" / "trainer_state.json").unlink()  # a save cut short
    (out / "training" / ".saving" / "checkpoint-3").mkdir(parents=True)  # a staged save of a killed run
    notices = []
    result = train(tiny, out, resume=True, steps=3, notices=notices)
    assert result.steps == 3
    assert any(n.startswith("removed") and ".saving" in n for n in notices), notices
    skipped = [n for n in notices if n.startswith("skipping checkpoint-2")]
    assert len(skipped) == 1 and "trainer_state.json" in skipped[0] and "resuming from checkpoint-1" in skipped[0]
    assert checkpoint_names(out) == ["checkpoint-2", "checkpoint-3", "incomplete-checkpoint-2"]
    assert (out / "training" / "checkpoint-2" / "trainer_state.json").is_file()  # saved again by the resumed run


def test_resume_of_heads_and_lora_restores_the_heads(tiny, tmp_path):
    """peft checkpoints hold the adapter alone: the heads that train beside it must come back too,
    or a resumed heads+lora run silently restarts them from init. With a constant schedule a run
    of 3 steps and a run of 2 resumed to 3 are the same run, bit for bit."""
    lora = dict(train="heads+lora", merge_lora=False, schedule="constant", warmup=0.0)
    train(tiny, tmp_path / "straight", steps=3, **lora)
    train(tiny, tmp_path / "resumed", steps=2, **lora)
    notices = []
    train(tiny, tmp_path / "resumed", resume=True, steps=3, notices=notices, **lora)
    assert notices == ["resuming with --steps 2 → 3"]
    straight, resumed = read_tensors(tmp_path / "straight"), read_tensors(tmp_path / "resumed")
    assert any(".delta." in key for key in straight)
    for key, value in straight.items():
        assert resumed[key].equal(value), key
    for name in ("adapter_model.safetensors", "deltafy_heads.safetensors"):
        assert (tmp_path / "resumed" / "training" / "checkpoint-3" / name).is_file()


def test_resume_with_no_complete_checkpoint_is_one_line(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    for name in ("checkpoint-1", "checkpoint-2"):
        (out / "training" / name / "optimizer.pt").unlink()
    with pytest.raises(DeltafyError, match="every checkpoint is incomplete: checkpoint-2 .no optimizer.pt.") as err:
        train(tiny, out, resume=True, steps=3)
    assert "\n" not in str(err.value)


# -- what a checkpoint holds ------------------------------------------------------------------------


def test_a_heads_checkpoint_holds_what_trains_not_the_base(tiny, finished):
    """The base is frozen and the run loads it from its input: a checkpoint keeps the heads, the
    optimizer, scheduler, RNG and trainer state (tiny llama: 37 kB, against 564 kB of weights)."""
    checkpoint = finished / "training" / "checkpoint-2"
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    assert set(files) == {"deltafy_heads.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", TRAINER_STATE}
    model_bytes = (finished / "model.safetensors").stat().st_size
    assert sum(files.values()) < model_bytes / 10, (files, model_bytes)
    heads, final = read_tensors(checkpoint), read_tensors(finished)
    assert heads and all(".delta." in key for key in heads)
    assert heads.keys() == {key for key in final if ".delta." in key}  # every head: nothing that does not train
    for key, value in heads.items():
        assert value.equal(final[key]), key  # step 2 is the last: its heads are the model's


def _as_previous_format(tiny, checkpoint: Path) -> None:
    """What deltafy wrote before checkpoints held only what trains: the whole model, heads included."""
    import torch
    from safetensors.torch import load_file

    model = deltafy.load(tiny.delta, dtype=torch.float32)
    model.load_state_dict(load_file(checkpoint / HEADS_FILE), strict=False)
    model.save_pretrained(checkpoint)
    (checkpoint / HEADS_FILE).unlink()


def test_a_checkpoint_of_the_previous_format_resumes(tiny, finished, tmp_path):
    new, old = copy_run(finished, tmp_path / "new"), copy_run(finished, tmp_path / "old")
    _as_previous_format(tiny, old / "training" / "checkpoint-2")
    assert {"model.safetensors", "config.json"} <= set(os.listdir(old / "training" / "checkpoint-2"))
    for out in (new, old):
        assert train(tiny, out, resume=True, steps=3).steps == 3
    a, b = read_tensors(new), read_tensors(old)
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert b[key].equal(value), key
    assert [r["loss"] for r in step_records(read_metrics(old))] == [r["loss"] for r in step_records(read_metrics(new))]
    # What it saves next is the new format.
    assert not (old / "training" / "checkpoint-3" / "model.safetensors").exists()


def test_a_checkpoint_whose_heads_do_not_fit_is_refused(tiny, finished, tmp_path):
    from safetensors.torch import load_file, save_file

    out = copy_run(finished, tmp_path)
    file = out / "training" / "checkpoint-2" / HEADS_FILE
    heads = load_file(file)
    key = next(k for k in sorted(heads) if k.endswith(".weight"))  # (1, hidden): one column less
    heads[key] = heads[key][..., :-1].contiguous()
    save_file(heads, file)
    with pytest.raises(DeltafyError, match="do not fit this model") as err:
        train(tiny, out, resume=True, steps=3)
    assert "\n" not in str(err.value) and "1 of another shape" in str(err.value) and key in str(err.value)
    del heads[key]
    save_file(heads, file)
    with pytest.raises(DeltafyError, match=f"1 missing.*{key}, missing"):
        train(tiny, out, resume=True, steps=3)


@pytest.mark.parametrize("mode", ["lora", "all"])
def test_lora_and_all_checkpoints_resume_exactly(tiny, tmp_path, mode):
    """lora keeps peft's adapter (and an empty heads file: no head trains); all keeps the whole
    model, as the Trainer saves it. Either way 2 steps resumed to 3 are a run of 3."""
    kwargs = dict(train=mode, merge_lora=False, schedule="constant", warmup=0.0)
    train(tiny, tmp_path / "straight", steps=3, **kwargs)
    train(tiny, tmp_path / "resumed", steps=2, **kwargs)
    kept = set(os.listdir(tmp_path / "resumed" / "training" / "checkpoint-2"))
    if mode == "lora":
        assert {
            "adapter_model.safetensors",
            "adapter_config.json",
            HEADS_FILE,
        } <= kept and "model.safetensors" not in kept
    else:
        assert "model.safetensors" in kept and HEADS_FILE not in kept
    train(tiny, tmp_path / "resumed", resume=True, steps=3, **kwargs)
    straight, resumed = read_tensors(tmp_path / "straight"), read_tensors(tmp_path / "resumed")
    for key, value in straight.items():
        assert resumed[key].equal(value), key


def test_an_fsdp_checkpoint_holds_what_trains_and_resumes_exactly(tiny, tmp_path):
    """Under FSDP the trainable tensors are gathered from their shards for a checkpoint (and the
    base is not): 2 processes, 3 steps straight, against the same run resumed after step 2."""

    def torchrun(out, *extra):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "deltafy", "train", str(tiny.delta), "--data", str(tiny.train_txt),
            "--eval-data", str(tiny.held_txt), "--out", str(out),
            *SHORT, "--steps", "3", "--save-every", "1", "--fsdp", "--schedule", "constant", "--warmup", "0", *extra,
        ]  # fmt: skip
        proc = subprocess.run(
            command, cwd=tmp_path, env=subprocess_env({"CUDA_VISIBLE_DEVICES": ""}), capture_output=True, text=True,
            stdin=subprocess.DEVNULL, timeout=240,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    straight = tmp_path / "straight"
    torchrun(straight)
    checkpoint = straight / "training" / "checkpoint-2"
    assert not set(os.listdir(checkpoint)) & {"model.safetensors", "pytorch_model_fsdp.bin", "pytorch_model_fsdp_0"}
    assert {HEADS_FILE, "optimizer.bin", "rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(checkpoint))
    resumed = interrupted_at(straight, 2, tmp_path / "resumed")  # the folder the run leaves, killed after step 2
    torchrun(resumed, "--resume")
    a, b = read_tensors(straight), read_tensors(resumed)
    assert any(".delta." in key for key in a)
    for key, value in a.items():
        assert b[key].equal(value), key
    assert [r["loss"] for r in step_records(read_metrics(resumed))] == [
        r["loss"] for r in step_records(read_metrics(straight))
    ]


def test_a_step_torch_compile_cannot_compile_is_one_line_saying_to_train_without_it(tiny, tmp_path):
    """No working C++ compiler (inductor's CPU backend needs one): a real compile failure, from an empty
    cache so that no graph compiled before is reused."""
    out = tmp_path / "run"
    env = {"CXX": str(tmp_path / "no-such-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = train_cli(tiny, out, "--steps", "1", "--compile", cwd=tmp_path, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "torch.compile could not compile the training step" in errors[0] and "no-such-compiler" in errors[0]
    assert errors[0].endswith("train without --compile")
    assert not out.exists()  # it failed at its first step: no --out left behind


# -- signals and full disks -------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_and_resume_finishes(tiny, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltafy", "train", str(tiny.delta), "--data", str(tiny.train_txt),
         "--eval-data", str(tiny.held_txt), "--out", str(out), *SHORT, "--steps", "400", "--save-every", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").is_file() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in stderr, stderr  # 128 + SIGTERM, having saved
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    assert "interrupted at step" in errors[0] and "by SIGTERM" in errors[0] and "--resume" in errors[0], stderr
    (checkpoint,) = (out / "training").glob("checkpoint-*")
    step = int(checkpoint.name.split("-")[1])
    assert f"checkpoint-{step}" in errors[0] and 2 <= step < 400
    assert not (out / "config.json").exists() and not (out / LOCK_FILE).exists()
    result = run_training(
        str(tiny.delta), [str(tiny.train_txt)], out, opts(steps=step + 1, save_every=1000),
        eval_data=[str(tiny.held_txt)], resume=True, show_progress=False, notice=[].append,
    )  # fmt: skip
    assert result.steps == step + 1 and (out / "config.json").is_file()


def _limit_file_size(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead


def test_a_failed_checkpoint_write_keeps_the_previous_one(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    # Just below the size of a checkpoint's heads (its first file), above what the run writes before it.
    limit = (out / "training" / "checkpoint-2" / "deltafy_heads.safetensors").stat().st_size - 1
    assert limit > 2 * max((out / "metrics.jsonl").stat().st_size, (out / "training" / "run.json").stat().st_size)
    extra = ("--steps", "4", "--save-every", "1", "--resume")
    proc = train_cli(tiny, out, *extra, cwd=tmp_path, preexec_fn=functools.partial(_limit_file_size, limit))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert error_lines(proc)[0] == "resuming with --steps 2 → 4"
    (line,) = error_lines(proc)[1:]
    assert line.startswith("error: could not write checkpoint") and "checkpoint-3" in line, line
    assert "too large" in line.lower() and line.endswith(
        f"{out / 'training' / 'checkpoint-2'} is still usable: rerun with --resume"
    ), line  # (no "free space": the disk is not full)
    assert sorted(os.listdir(out / "training")) == ["checkpoint-1", "checkpoint-2", "run.json"]  # nothing half-written
    result = train(tiny, out, resume=True, steps=4)
    assert result.steps == 4 and checkpoint_names(out) == ["checkpoint-3", "checkpoint-4"]


def test_a_failed_torch_save_is_a_failed_write(tmp_path):
    """torch.save reports a write cut short by a full disk or a size limit without an errno."""
    from deltafy.training.checkpoints import write_failure

    failure = write_failure(RuntimeError("basic_ios::clear: iostream error"), "checkpoint X", tmp_path)
    assert failure is not None and str(failure).startswith("could not write checkpoint X: the write failed")
    assert write_failure(RuntimeError("shape mismatch"), "checkpoint X", tmp_path) is None


def test_memory_running_out_while_the_model_is_written_says_what_is_kept(tmp_path):
    """An allocation refused while a run's model is saved is not its batch size: the line names the
    memory and what is still usable, as for a full disk (the refusal is the CPU allocator's own)."""
    import torch

    from deltafy.training.checkpoints import write_failure

    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as refused:
        err = refused
    memory = "could not write the model into out: out of memory (it tried to allocate 1,048,576.0 GiB)"
    assert str(write_failure(err, "the model into out", tmp_path)) == f"{memory}; no checkpoint was saved"
    checkpoint = tmp_path / "checkpoint-3"  # a complete one: what a resume needs
    checkpoint.mkdir()
    for name in ("trainer_state.json", "scheduler.pt", "optimizer.pt", "deltafy_heads.safetensors"):
        (checkpoint / name).write_text("{}")
    kept = f"{memory}; {checkpoint} is still usable: free memory and rerun with --resume"
    assert str(write_failure(err, "the model into out", tmp_path)) == kept


# -- training-side checks and output ------------------------------------------------------------------


def test_seq_len_above_the_model_positions_is_refused(tmp_path):
    from helpers.models import tiny_model

    model = deltafy.convert(tiny_model("gpt2"))
    folder = deltafy.save(model, tmp_path / "gpt2-delta")
    limit = model.config.n_positions
    data = tmp_path / "d.txt"
    data.write_text("text " * 100)
    proc = run_cli("train", folder, "--data", data, "--out", tmp_path / "run", "--seq-len", limit + 1, cwd=tmp_path)
    assert_one_line_error(proc, f"--seq-len {limit + 1}", f"model's {limit} positions", "n_positions")
    assert not (tmp_path / "run").exists()


def test_quiet_resume_of_tied_embeddings_with_progress_lines(tmp_path):
    """No FutureWarning, no "missing keys" for the tied lm_head, progress lines on a non-terminal."""
    from helpers.training import build_stock_model

    from deltafy.conversion.job import convert_source

    tokenizer = shared_tokenizer()
    stock = build_stock_model(tokenizer)
    stock.config.tie_word_embeddings = True
    stock.tie_weights()
    stock.save_pretrained(tmp_path / "stock")
    tokenizer.save_pretrained(tmp_path / "stock")
    convert_source(str(tmp_path / "stock"), tmp_path / "delta")
    assert json.loads((tmp_path / "delta" / "config.json").read_text())["tie_word_embeddings"] is True
    data = tmp_path / "d.txt"
    data.write_text("\n".join(["To be, or not to be, that is the question."] * 60))
    out = tmp_path / "run"
    base = ("train", tmp_path / "delta", "--data", data, "--out", out, *SHORT, "--save-every", "1")
    first = run_cli(*base, "--steps", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = run_cli(*base, "--steps", "3", "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    for proc in (first, second):
        assert "Warning" not in proc.stderr and "missing keys" not in proc.stderr, proc.stderr
    assert [line.split(" · ")[0] for line in first.stderr.splitlines()] == ["train: step 1/2", "train: step 2/2"]
    assert second.stderr.splitlines() == ["resuming with --steps 2 → 3", second.stderr.splitlines()[1]]
    assert second.stderr.splitlines()[1].startswith("train: step 3/3 · loss ")
