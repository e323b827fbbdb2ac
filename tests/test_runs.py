"""A training run's state in --out: the guarded folder, its lock, the checked resume, checkpoints
that are complete or absent, signals and full disks. Real runs of the tiny llama (2-3 steps)."""

from __future__ import annotations

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
from _train_helpers import read_metrics, run_cli, shared_tokenizer, step_records, subprocess_env
from test_cli import assert_one_line_error

import deltafy
from deltafy.engine import run_training
from deltafy.errors import DeltafyError
from deltafy.runs import LOCK_FILE, RunLock
from deltafy.train import options_from

pytestmark = pytest.mark.usefixtures("token_cache")

SHORT = ("--seq-len", "32", "--batch-size", "2", "--lr", "0.05")


def opts(**overrides):
    values = dict(steps=2, seq_len=32, batch_size=2, lr=0.05, save_every=1)
    return options_from(None, **{**values, **overrides})


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


def test_out_that_contains_the_input_or_is_a_file(tiny, tmp_path):
    with pytest.raises(DeltafyError, match="contains the input model folder") as err:
        run_training(str(tiny.delta), [str(tiny.train_txt)], tiny.delta.parent, opts(), overwrite=True)
    assert "--overwrite" not in str(err.value)
    file = tmp_path / "out.txt"
    file.write_text("mine")
    proc = train_cli(tiny, file, cwd=tmp_path)
    assert_one_line_error(proc, "is a file", "choose another --out")
    assert file.read_text() == "mine"
    # Refused before the model is loaded: a library call returns at once.
    started = time.perf_counter()
    with pytest.raises(DeltafyError, match="is a file"):
        train(tiny, file)
    assert time.perf_counter() - started < 0.5


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


def test_a_lock_of_a_killed_run_is_free(tiny, tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from deltafy.runs import RunLock; RunLock({str(out)!r}).__enter__(); input()"],
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


def test_resume_of_a_run_whose_model_was_not_written_writes_it(tiny, finished, tmp_path):
    from _train_helpers import read_tensors

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
    from _train_helpers import read_tensors

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
    assert proc.returncode == 1 and "Traceback" not in stderr, stderr
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


FSIZE_LIMIT = 200_000  # above run.json, metrics and token caches; below the tiny model's 560 kB weights


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead


def test_a_failed_checkpoint_write_keeps_the_previous_one(tiny, finished, tmp_path):
    out = copy_run(finished, tmp_path)
    extra = ("--steps", "4", "--save-every", "1", "--resume")
    proc = train_cli(tiny, out, *extra, cwd=tmp_path, preexec_fn=_limit_file_size)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert error_lines(proc)[0] == "resuming with --steps 2 → 4"
    (line,) = error_lines(proc)[1:]
    assert line.startswith("error: could not write checkpoint") and "checkpoint-3" in line, line
    assert "too large" in line.lower() and f"{out / 'training' / 'checkpoint-2'} is still usable" in line, line
    assert sorted(os.listdir(out / "training")) == ["checkpoint-1", "checkpoint-2", "run.json"]  # nothing half-written
    result = train(tiny, out, resume=True, steps=4)
    assert result.steps == 4 and checkpoint_names(out) == ["checkpoint-3", "checkpoint-4"]


# -- training-side checks and output ------------------------------------------------------------------


def test_seq_len_above_the_model_positions_is_refused(tmp_path):
    from conftest import tiny_model

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
    from _train_helpers import build_stock_model

    from deltafy.pipeline import convert_source

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
