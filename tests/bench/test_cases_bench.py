"""`deltafy bench` as a table of command lines: each row a real subprocess on the tiny llama, its exit
code, its first line, and what it leaves on disk. Every row failed before the bench guarded its --out,
compared its texts by content, cleaned up after a refusal and recorded a diverged rate."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from helpers.cases import Case, assert_case, mount_tmpfs, run_table, unmount_all
from helpers.training import run_cli

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

SMALL = ["--steps", "2", "--seeds", "1", "--seq-len", "32", "--batch-size", "2", "--max-eval-blocks", "2"]
SMALL += ["--arms", "heads"]


def _bench(out: str, data: str = "{train}", eval_data: str = "{held}", source: str = "{stock}", *more: str) -> list:
    return ["bench", source, "--data", data, "--eval-data", eval_data, "--out", out, *SMALL, *more]


def _twin_texts(here: Path, paths: dict) -> None:
    shutil.copy(paths["train"], here / "train.txt")
    shutil.copy(paths["train"], here / "the same under another name.txt")


def _empty_text(here: Path, paths: dict) -> None:
    (here / "empty.txt").write_text(" \n")


def _data_in_out(here: Path, paths: dict) -> None:
    (here / "w").mkdir()
    shutil.copy(paths["train"], here / "w" / "train.txt")


def _users_runs(here: Path, paths: dict) -> None:
    (here / "w" / "runs").mkdir(parents=True)
    (here / "w" / "runs" / "mine.txt").write_text("my own runs")


def _source_copy(here: Path, paths: dict) -> None:
    shutil.copytree(paths["stock"], here / "stock")


def _diverged_and_went_on(paths: dict) -> None:
    state = json.loads((Path(paths["here"]) / "o" / "bench.json").read_text())
    sweep = {record["lr_multiplier"]: record for record in state["sweep"]}
    assert sweep[1e30]["validation_loss"] is None and "NaN/inf" in sweep[1e30]["diverged"], sweep
    assert sweep[1.0]["validation_loss"] is not None
    assert [r["lr_multiplier"] for r in state["records"]] == [1.0]


def _read_only_out(here: Path, paths: dict) -> None:
    (here / "ro").mkdir()
    mount_tmpfs(here / "ro", "ro,size=1m")


def _resumes_where_it_stopped(paths: dict) -> None:
    # interrupted in its first run, the folder is the bench's: bench.json says so, and --resume finishes it
    here = Path(paths["here"])
    assert json.loads((here / "o" / "bench.json").read_text())["records"] == []
    argv = [a.format(**paths) for a in _bench("{here}/o")]
    proc = run_cli(*argv, "--resume", cwd=here, env={"DELTAFY_CACHE": str(here / "cache")}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert [r["arm"] for r in json.loads((here / "o" / "bench.json").read_text())["records"]] == ["heads"]


STATUS = ("bench: ",)  # off a terminal the bench says what it does, a line a step, on stderr

CASES = [
    Case(
        "eval-data-is-a-copy-of-data",
        _bench("{here}/o", "{here}/train.txt", "{here}/the same under another name.txt"),
        1,
        "--eval-data {here}/the same under another name.txt holds the same text as --data {here}/train.txt",
        absent=("{here}/o",),
        prepare=_twin_texts,
        notices=STATUS,
    ),
    Case(
        "refused-before-its-first-run-leaves-nothing",  # once a models/ folder that blocked the fixed command
        _bench("{here}/o", "{here}/empty.txt"),
        1,
        "holds no text",
        absent=("{here}/o",),
        prepare=_empty_text,
        notices=STATUS,
    ),
    Case(
        "out-holds-its-data",
        [*_bench("{here}/w", "{here}/w/train.txt"), "--overwrite"],
        1,
        "--out {here}/w contains the training data {here}/w/train.txt",
        untouched=("{here}/w",),
        prepare=_data_in_out,
        notices=STATUS,
    ),
    Case(
        "overwrite-a-folder-with-the-users-runs",
        [*_bench("{here}/w"), "--overwrite"],
        1,
        "{here}/w holds runs but no bench.json, so it is not a bench deltafy wrote",
        untouched=("{here}/w",),
        prepare=_users_runs,
        notices=STATUS,
    ),
    Case(
        "out-is-the-source",
        [*_bench("{here}/stock", source="{here}/stock"), "--overwrite"],
        1,
        "--out {here}/stock is the source {here}/stock",
        untouched=("{here}/stock",),
        prepare=_source_copy,
        notices=STATUS,
    ),
    Case(
        "a-rate-that-diverges-is-recorded-and-the-bench-goes-on",
        [*_bench("{here}/o"), "--lrs", "1,1e30", "--lr-extend", "0"],
        0,
        "deltafy bench",
        check=_diverged_and_went_on,
        notices=STATUS,
    ),
    Case(
        "a-block-longer-than-the-models-positions-is-refused-before-its-first-run",
        [*_bench("{here}/o"), "--seq-len", "100000"],
        1,
        "--seq-len 100000 is longer than the model's",
        absent=("{here}/o",),
        notices=STATUS,
    ),
    Case(
        "sigint-in-its-first-run-resumes",  # once a folder deltafy then refused whatever the flags
        _bench("{here}/o"),
        130,
        "interrupted; the 0 runs the bench finished are kept in {here}/o/bench.json: continue with the same",
        interrupt=(signal.SIGINT, "o/runs/heads"),
        check=_resumes_where_it_stopped,
        notices=STATUS,
    ),
    Case(
        "read-only-out",  # an existing folder: once an internal error from the lock
        _bench("{here}/ro"),
        1,
        "cannot write --out {here}/ro: {here}/ro is not writable",
        needles=("Read-only file system",),
        prepare=_read_only_out,
        notices=STATUS,
    ),
    Case(
        "sigterm-while-converting",
        _bench("{here}/o"),
        143,
        "interrupted by SIGTERM; the runs the bench finished (if any) are kept in {here}/o",
        absent=("{here}/o",),
        interrupt=(signal.SIGTERM, "o/models"),
        notices=STATUS,
    ),
]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-cases")
    paths = {"stock": str(tiny.stock), "train": str(tiny.train_txt), "held": str(tiny.held_txt)}
    try:
        return run_table(CASES, paths, root, env={"DELTAFY_CACHE": str(root / "cache")}, timeout=600)
    finally:
        unmount_all()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bench_case(runs, case):
    assert_case(case, runs[case.name])
