"""`deltafy bench` on the tiny llama: one record per arm and seed, numbers an independent evaluation
reproduces, a sweep that never sees the reported held-out text, resumption, matched LoRA ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cli import assert_one_line_error, cli
from helpers.training import read_tensors, subprocess_env

from deltafy.bench import ARMS, BENCH_FILE, PLOT_FILE, extended, run_bench
from deltafy.bench.arms import Budgets, nearest_rank, rate_label
from deltafy.conversion.job import convert_source
from deltafy.errors import DeltafyError
from deltafy.evaluate import evaluate_text, load_any, run_settings
from deltafy.surgery import delta_sites

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("token_cache")]

ARMS_RUN = ["heads", "lora", "ddl+lora"]
SIZES = dict(steps=2, seq_len=64, batch_size=4, max_eval_blocks=4, eval_every=1)
RECORD_FIELDS = {
    "arm",
    "seed",
    "lr",
    "trainable_params",
    "loss_before",
    "loss_after",
    "delta",
    "seconds_per_step",
    "peak_memory_bytes",
    "curve",
    "path",
}


def bench(tiny, out: Path, **overrides):
    values = dict(arms=ARMS_RUN, seeds=2, lrs=[1, 3], lr_extend=0, sweep_seeds=1, isolate=False, **SIZES)
    values.update(overrides)
    return run_bench(str(tiny.stock), [str(tiny.train_txt)], [str(tiny.held_txt)], out, **values)


@pytest.fixture(scope="module")
def benched(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "out"
    seen = []
    result = bench(tiny, out, progress=lambda done, total, what: seen.append((done, total, what)))
    return out, result, seen


def test_one_record_per_arm_and_seed_with_every_field(benched):
    out, result, _ = benched
    state = json.loads((out / BENCH_FILE).read_text())
    assert sorted((r["arm"], r["seed"]) for r in state["records"]) == sorted((a, s) for a in ARMS_RUN for s in (0, 1))
    for record in state["records"]:
        assert RECORD_FIELDS <= record.keys(), RECORD_FIELDS - record.keys()
        assert record["delta"] == pytest.approx(record["loss_after"] - record["loss_before"])
        assert [step for step, _ in record["curve"]] == [0, 1, 2]
        assert record["curve"][-1][1] == record["loss_after"]
        assert Path(record["path"]) == (out / "runs" / record["arm"] / f"seed-{record['seed']}").resolve()
    points = {a: [] for a in ARMS_RUN}
    for r in state["sweep"]:
        points[r["arm"]] = sorted([*points[r["arm"]], (r["lr_multiplier"], r.get("heads_lr_multiplier", 0))])
    assert points["heads"] == points["lora"] == [(1.0, 0), (3.0, 0)]  # 0: no rate of the heads' own
    assert len(points["ddl+lora"]) == 3  # its LoRA rate at two points, then its heads' rate at one more
    assert all(r["validation_loss"] > 0 for r in state["sweep"])
    assert [row["arm"] for row in state["table"]] == ARMS_RUN == [row.arm for row in result.rows]


def test_table_equals_an_independent_evaluation_of_each_saved_model(tiny, benched):
    _, result, _ = benched
    for record in result.records:  # read as `deltafy eval PATH --data HELD-OUT` reads it, with no other flag
        model, tokenizer = load_any(record["path"])
        options = run_settings(record["path"])
        assert (options.seq_len, options.max_blocks) == (64, 4)  # the run's, which the bench set
        sizes = dict(seq_len=options.seq_len, batch_size=options.batch_size, max_blocks=options.max_blocks)
        held = evaluate_text(model, tokenizer, [str(tiny.held_txt)], **sizes)
        assert abs(held.loss - record["loss_after"]) < 1e-4, record["arm"]
    for row in result.rows:
        mine = [r for r in result.records if r["arm"] == row.arm]
        assert row.loss_after == pytest.approx(sum(r["loss_after"] for r in mine) / 2)
        assert row.delta_se is not None and row.delta_se >= 0
        assert {r["lr_multiplier"] for r in mine} == {row.lr_multiplier}
        if row.heads_lr_multiplier is None:  # one rate: the best the sweep found on its validation share
            sweep = {r["lr_multiplier"]: r["validation_loss"] for r in result.sweep if r["arm"] == row.arm}
            assert row.lr_multiplier == min(sweep, key=sweep.get)


def test_ddl_lora_sweeps_its_lora_rate_at_the_heads_arms_best_then_its_heads_rate_at_that(benched):
    _, result, _ = benched
    rows = {row.arm: row for row in result.rows}
    heads, lora, combined = rows["heads"], rows["lora"], rows["ddl+lora"]
    swept = [r for r in result.sweep if r["arm"] == "ddl+lora"]
    base = lora.lora_lr / lora.lr_multiplier  # LoRA's rate at multiplier 1
    assert [r["lora_lr"] / r["lr_multiplier"] for r in swept] == pytest.approx([base] * 3)
    lora_line = {r["lr_multiplier"]: r for r in swept if r["heads_lr_multiplier"] == heads.lr_multiplier}
    assert sorted(lora_line) == [1.0, 3.0]
    best_lora = min(lora_line, key=lambda m: lora_line[m]["validation_loss"])
    heads_line = {r["heads_lr_multiplier"]: r for r in swept if r["lr_multiplier"] == best_lora}
    assert sorted(heads_line) == [1.0, 3.0]
    best_heads = min(heads_line, key=lambda h: heads_line[h]["validation_loss"])
    assert (combined.lr_multiplier, combined.heads_lr_multiplier) == (best_lora, best_heads)
    assert combined.lr == heads.lr / heads.lr_multiplier * best_heads
    assert combined.lora_lr == pytest.approx(base * best_lora)
    mine = [r for r in result.records if r["arm"] == "ddl+lora"]
    assert all((r["lr_multiplier"], r["heads_lr_multiplier"]) == (best_lora, best_heads) for r in mine)
    assert all("heads_lr_multiplier" not in r for r in result.records if r["arm"] != "ddl+lora")
    # Each point of its sweep in a folder of its own.
    for r in swept:
        assert Path(r["path"]).name == f"lr-{r['lr_multiplier']:g}x-heads-{r['heads_lr_multiplier']:g}x"
    assert all(Path(r["path"], "metrics.jsonl").is_file() for r in swept)


def test_the_sweep_goes_on_past_the_end_that_holds_its_best(tiny, tmp_path):
    assert extended([1.0, 3.0, 10.0], 10.0) == 33.3 and extended([1.0, 3.0, 10.0], 1.0) == 0.333
    assert extended([1.0, 3.0, 10.0], 3.0) is None and extended([2.0], 2.0) is None
    # At rates this small every larger one trains further in two steps: the best sits at the top end.
    result = bench(tiny, tmp_path / "out", arms=["lora"], seeds=1, lrs=[0.01, 0.02], lr_extend=2)
    swept = sorted(r["lr_multiplier"] for r in result.sweep)
    assert swept == [0.01, 0.02, 0.04, 0.08]
    losses = [r["validation_loss"] for r in sorted(result.sweep, key=lambda r: r["lr_multiplier"])]
    (row,) = result.rows
    assert row.lr_multiplier == swept[losses.index(min(losses))]
    assert row.lr_at_edge == (row.lr_multiplier == 0.08)
    assert result.records[0]["lr_multiplier"] == row.lr_multiplier


def test_a_rate_scores_the_mean_of_its_sweep_seeds(tiny, tmp_path):
    """--sweep-seeds 2 (the default): every rate trains on seeds 0 and 1, each in its own folder, and the
    arm's rate is the one whose mean validation loss is lowest; a resumed bench trains none of them again."""
    out = tmp_path / "out"
    seen = []
    progress = lambda done, total, what: seen.append((done, total, what))  # noqa: E731
    result = bench(tiny, out, arms=["heads"], seeds=1, lrs=[1, 30], sweep_seeds=2, progress=progress)
    by_rate: dict[float, dict[int, float]] = {}
    for r in result.sweep:
        by_rate.setdefault(r["lr_multiplier"], {})[r["seed"]] = r["validation_loss"]
        assert Path(r["path"]).name == f"lr-{r['lr_multiplier']:g}x" + (f"-seed-{r['seed']}" if r["seed"] else "")
    assert sorted(by_rate) == [1.0, 30.0] and all(sorted(s) == [0, 1] for s in by_rate.values())
    assert len({by_rate[1.0][0], by_rate[1.0][1]}) == 2  # the seeds differ
    means = {m: sum(s.values()) / 2 for m, s in by_rate.items()}
    (row,) = result.rows
    assert row.lr_multiplier == min(means, key=means.get)
    assert {t for _, t, _ in seen} == {1 + 2 * 2} and any(w == "heads · sweep lr ×30 · seed 2 of 2" for _, _, w in seen)
    again = bench(tiny, out, arms=["heads"], seeds=1, lrs=[1, 30], sweep_seeds=2, resume=True)
    assert again.trained == 0 and again.rows[0].lr_multiplier == row.lr_multiplier


def test_a_sweep_that_diverges_at_every_rate_tries_lower_ones(tiny, tmp_path):
    result = bench(tiny, tmp_path / "out", arms=["heads"], seeds=1, lrs=[1e15, 1e30], lr_extend=1)
    sweep = {r["lr_multiplier"]: r for r in result.sweep}
    assert sorted(sweep) == [1.0, 1e15, 1e30]  # one step lower (the grid's own ratio) trains
    assert sweep[1e15]["validation_loss"] is None and "diverged" in sweep[1e15]
    assert sweep[1e30]["validation_loss"] is None and sweep[1.0]["validation_loss"] is not None
    assert result.rows[0].lr_multiplier == 1.0 and result.rows[0].lr_at_edge  # still at the grid's lower end
    with pytest.raises(DeltafyError, match=r"diverged at every learning rate tried \(×1e\+15, ×1e\+30\)"):
        bench(tiny, tmp_path / "none", arms=["heads"], seeds=1, lrs=[1e15, 1e30], lr_extend=0)


def test_the_sweep_never_reads_the_reported_held_out_text(tiny, benched):
    out, _, _ = benched
    sweeps = sorted((out / "runs").glob("*/lr-*x"))
    assert len(sweeps) == 2 * len(ARMS_RUN) + 1  # ddl+lora's heads' rate at one more point
    for run in sweeps:
        record = json.loads((run / "training" / "run.json").read_text())
        assert record["eval_sources"] == [] and record["data_sources"] == [str(tiny.train_txt)]
        assert sorted(p.name for p in run.rglob("*") if p.is_file()) == ["metrics.jsonl", "run.json"]  # no model
    for run in (out / "runs").glob("*/seed-*"):
        record = json.loads((run / "training" / "run.json").read_text())
        assert record["eval_sources"] == [str(tiny.held_txt)]


def test_lora_ranks_match_the_parameter_budgets(tiny, benched, tmp_path):
    out, result, _ = benched
    models = {"ddl-scalar": out / "models" / "ddl-scalar", "ddl-learned": tmp_path / "learned"}
    convert_source(str(tiny.stock), models["ddl-learned"], recipe="ddl-learned")
    budgets = Budgets(models, None)
    per_rank, heads = budgets.per_rank(), budgets.heads("ddl-scalar")
    trained = {row.arm: row for row in result.rows}
    assert trained["heads"].trainable_params == heads
    assert trained["lora"].trainable_params == trained["lora"].lora_r * per_rank
    assert trained["ddl+lora"].trainable_params == heads + trained["lora"].lora_r * per_rank
    for name in ("lora", "lora-2x", "lora-large"):
        target = budgets.count(ARMS[name].lora_matches)
        rank = budgets.rank(name)
        assert all(abs(rank * per_rank - target) <= abs(r * per_rank - target) for r in range(1, 4 * rank + 2))
    assert budgets.rank("lora-large") > budgets.rank("lora")  # the learned direction is the larger budget
    assert nearest_rank(10, 4) == 2 and nearest_rank(11, 4) == 3 and nearest_rank(1, 100) == 1


def test_progress_names_the_arm_and_the_kind_of_run(benched):
    _, _, seen = benched
    # ddl+lora's second line (its heads' rate) holds one point its first line ran: one run, counted once
    total = len(ARMS_RUN) * (2 + 2) + 1
    assert {t for _, t, _ in seen} == {total} and seen[-1][0] == total
    started = {}  # each run's count when it was named (a seed is named again when it is passed)
    for done, _, what in seen:
        started.setdefault(what, done)
    assert sorted(started.values()) == list(range(total + 1)), seen  # none skipped, then "done"
    assert any(what == "lora · sweep lr ×3" for _, _, what in seen)
    assert any(what.startswith("ddl+lora · seed 2 of 2") for _, _, what in seen)


def test_bench_png_is_drawn(benched):
    out, result, _ = benched
    assert result.plot_path == out / PLOT_FILE
    assert (out / PLOT_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resume_trains_nothing_finished_and_a_changed_setting_is_refused(tiny, benched):
    out, first, first_seen = benched
    before = (out / BENCH_FILE).read_text()
    with pytest.raises(DeltafyError, match="holds a bench already; pass --resume"):
        bench(tiny, out)
    seen = []
    again = bench(tiny, out, resume=True, progress=lambda done, total, what: seen.append((done, total, what)))
    assert again.trained == 0
    seeds = [(done, total, what) for done, total, what in seen if " · seed " in what]
    assert seeds and all(what.endswith(": kept from before") for _, _, what in seeds), seen
    # A kept seed is counted where the first bench counted it: reported as it is reached and as it is passed.
    trained = [(done, total, what) for done, total, what in first_seen if " · seed " in what]
    assert [(done, total, what.removesuffix(": kept from before")) for done, total, what in seeds] == trained
    assert [r["finished_at"] for r in again.records] == [r["finished_at"] for r in first.records]
    assert json.loads((out / BENCH_FILE).read_text())["records"] == json.loads(before)["records"]
    with pytest.raises(DeltafyError, match=r"other settings \(--steps 2 → 3; --lrs 1,3 → 1,2\)"):
        bench(tiny, out, resume=True, steps=3, lrs=[1, 2])
    # A subset of the arms with fewer seeds reuses what is there.
    subset = bench(tiny, out, resume=True, arms=["lora"], seeds=1)
    assert subset.trained == 0 and [(r["arm"], r["seed"]) for r in subset.records] == [("lora", 0)]
    alone = bench(tiny, out, resume=True, arms=["ddl+lora"], seeds=1)  # its heads' rate: heads' own sweep
    assert alone.trained == 0 and [row.arm for row in alone.rows] == ["ddl+lora"]


def test_an_unfinished_bench_resumes_from_its_last_finished_run(tiny, tmp_path):
    out = tmp_path / "out"
    bench(tiny, out, arms=["heads"], seeds=1, lrs=[1])
    state = json.loads((out / BENCH_FILE).read_text())
    assert state["sweep"] == []  # one learning rate: nothing to choose, no sweep
    (out / "runs" / "heads" / "seed-0" / "config.json").unlink()  # its model lost: the run is redone
    stamp = time.time()
    again = bench(tiny, out, arms=["heads"], seeds=2, lrs=[1], resume=True)
    assert again.trained == 2 and [r["seed"] for r in again.records] == [0, 1]
    assert all(Path(r["path"], "config.json").stat().st_mtime >= stamp for r in again.records)


def _bench_children(pid: int) -> list[int]:
    """The bench's training runs in processes of their own: the children of ``pid`` running one."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            command = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):  # a process that ended while we looked
            continue
        if ppid == pid and b"deltafy.bench.child" in command:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the bench's child processes in /proc")
def test_sigterm_stops_the_bench_and_the_run_it_started(tiny, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltafy", "bench", str(tiny.stock), "--data", str(tiny.train_txt), "--eval-data",
         str(tiny.held_txt), "--out", str(out), "--arms", "heads", "--steps", "5000", "--seeds", "1", "--lrs", "1",
         "--seq-len", "64", "--batch-size", "4", "--max-eval-blocks", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    children = []
    try:
        deadline = time.monotonic() + 120
        while not (children := _bench_children(proc.pid)):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 143 and "Traceback" not in stderr, stderr  # 128 + SIGTERM: a scheduler sees it
        (error,) = [line for line in stderr.splitlines() if not line.startswith("bench: ")]  # less the log lines
        assert error.startswith("error: interrupted;") and "--resume" in error, error
        for child in children:  # reaped by the bench: it waited for its run to stop
            with pytest.raises(ProcessLookupError):
                os.kill(child, 0)
        assert not (out / ".deltafy-lock").exists()
    finally:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (dict(arms=["heads", "nope"]), "unknown arm 'nope'; choose from heads, logit"),
        (dict(seeds=0), "--seeds: Input should be greater than 0"),
        (dict(steps=0), "--steps: Input should be greater than 0"),
        (dict(lrs=[1, -1]), "--lrs: Input should be greater than 0"),
        (dict(lrs=[1, 1]), "--lrs: takes distinct multipliers"),
        (dict(lr_extend=-1), "--lr-extend: Input should be greater than or equal to 0"),
        (dict(resume=True, overwrite=True), "--resume and --overwrite contradict"),
        (dict(seq_len=1), "--seq-len"),
    ],
)
def test_bad_settings_are_refused_before_any_work(tiny, tmp_path, overrides, needle):
    with pytest.raises(DeltafyError, match=None) as err:
        bench(tiny, tmp_path / "out", **overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_bad_data_and_out_are_refused(tiny, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(DeltafyError, match="bench needs --eval-data"):
        run_bench(str(tiny.stock), [str(tiny.train_txt)], [], out)
    with pytest.raises(DeltafyError, match="bench needs --data"):
        run_bench(str(tiny.stock), [], [str(tiny.held_txt)], out)
    with pytest.raises(DeltafyError, match="holds the same text as --data"):
        run_bench(str(tiny.stock), [str(tiny.train_txt)], [str(tiny.train_txt)], out)
    with pytest.raises(DeltafyError, match="data not found"):
        run_bench(str(tiny.stock), [str(tmp_path / "missing.txt")], [str(tiny.held_txt)], out)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(DeltafyError, match="holds no text"):
        run_bench(str(tiny.stock), [str(empty)], [str(tiny.held_txt)], out, arms=["heads"], seeds=1, isolate=False)
    assert not out.exists()  # refused before its first run: nothing that would block the corrected command
    (tmp_path / "file").write_text("mine")
    with pytest.raises(DeltafyError, match="exists and is not a folder"):
        run_bench(str(tiny.stock), [str(tiny.train_txt)], [str(tiny.held_txt)], tmp_path / "file")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(DeltafyError, match="already holds files and no bench.json"):
        bench(tiny, mine)
    assert (mine / "notes.txt").read_text() == "mine"


def test_a_seed_worse_than_the_untrained_model_is_marked_in_the_table(benched, monkeypatch):
    from dataclasses import replace

    from deltafy.bench.table import row_of
    from deltafy.cli._console import console
    from deltafy.cli.bench import _nats, _print_table

    _, result, _ = benched
    records = [r for r in result.records if r["arm"] == "heads"]
    # A random model's held-out loss barely moves, up or down: nothing to mark.
    assert max(abs(loss - r["loss_before"]) for r in records for _, loss in r["curve"]) < 1e-3
    assert row_of("heads", records, False).rose_above_start == []
    # Seed 1 as the KJV's cliff-edge rate left it: far above its start at the first evaluation, then back below.
    before = records[1]["loss_before"]
    jumped = records[1] | {"curve": [[0, before], [1, before + 0.7], [2, before - 0.01]]}
    row = row_of("heads", [records[0], jumped], False)
    assert row.rose_above_start == [(1, 1)]
    monkeypatch.setattr(console, "width", 250)
    with console.capture() as captured:
        _print_table(replace(result, rows=[row]))
    text = captured.get()
    assert f"{_nats(row.delta, signed=True)} ± {_nats(row.delta_se)}!" in text  # (the mark after the figure)
    assert "note: the held-out loss of heads rose over 1% above where it started (seed-1 at step 1)" in text


def test_the_expanded_arm_trains_from_its_own_recipe(tiny, tmp_path):
    result = bench(tiny, tmp_path / "out", arms=["expanded"], seeds=1, lrs=[1])
    (record,) = result.records
    assert record["recipe"] == "ddl-expanded" and record["trainable_params"] > 0
    model, tokenizer = load_any(record["path"])
    held = evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=64, batch_size=4, max_blocks=4)
    assert abs(held.loss - record["loss_after"]) < 1e-4


def test_the_write_only_control_trains_from_its_own_recipe_and_is_not_the_heads_arm(tiny, tmp_path):
    result = bench(tiny, tmp_path / "out", arms=["heads", "write-only"], seeds=1, lrs=[1])
    heads, control = sorted(result.records, key=lambda r: r["arm"] != "heads")
    assert control["arm"] == "write-only" and control["recipe"] == "ddl-write-only"
    assert control["trainable_params"] == heads["trainable_params"]  # the same heads, one term fewer
    assert control["loss_after"] != heads["loss_after"] and control["delta"] != 0  # it trained
    model, tokenizer = load_any(control["path"])
    assert all(not site.erase for _, site in delta_sites(model))
    held = evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=64, batch_size=4, max_blocks=4)
    assert abs(held.loss - control["loss_after"]) < 1e-4


def test_the_peft_baselines_train_at_their_counts(tiny, tmp_path):
    """DoRA at the lora arm's rank (its count: LoRA's plus a magnitude per output), (IA)^3 and LN tuning at
    their natural counts; each saved model evaluates to its record."""
    result = bench(tiny, tmp_path / "out", arms=["lora", "dora", "ia3", "ln-tuning"], seeds=1, lrs=[1])
    records = {r["arm"]: r for r in result.records}
    assert records["dora"]["lora_r"] == records["lora"]["lora_r"]
    assert records["ia3"]["lora_r"] is None and records["ln-tuning"]["lora_r"] is None
    budgets = Budgets({"ddl-scalar": tiny.delta}, None)
    for name, record in records.items():
        assert record["trainable_params"] == budgets.count(name), name
        model, tokenizer = load_any(record["path"])
        assert not any("lora_" in n or "ia3_" in n for n, _ in model.named_parameters())  # merged
        held = evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=64, batch_size=4, max_blocks=4)
        assert abs(held.loss - record["loss_after"]) < 1e-4, name
    assert records["dora"]["trainable_params"] > records["lora"]["trainable_params"]
    assert records["dora"]["loss_after"] != records["lora"]["loss_after"]


def test_a_borrowed_heads_rate_is_named_beside_what_the_arm_sweeps_itself():
    # ddl+full's own rate is the pretrained weights' (lora_lr drives them): calling it LoRA misled a reader
    assert rate_label("ddl+lora", 3.0, 1.0) == "heads ×1, LoRA ×3"
    assert rate_label("ddl+full", 0.1, 3.0) == "heads ×3, weights ×0.1"
    assert rate_label("full", 10.0, None) == "lr ×10"


def test_full_and_ddl_full_train_every_weight_they_should(tiny, tmp_path):
    result = bench(tiny, tmp_path / "out", arms=["full", "ddl+full"], seeds=1, lrs=[1])
    records = {r["arm"]: r for r in result.records}
    start = read_tensors(tiny.delta)
    heads = {k for k in start if ".delta." in k}
    total = sum(v.numel() for v in start.values())
    assert records["full"]["trainable_params"] == total - sum(start[k].numel() for k in heads)
    assert records["ddl+full"]["trainable_params"] == total
    budgets = Budgets({"ddl-scalar": tiny.delta}, None)
    for name, record in records.items():
        assert record["trainable_params"] == budgets.count(name)
        after = read_tensors(record["path"])
        moved = {k for k in start if not torch.equal(start[k], after[k])}
        assert moved == (set(start) - heads if name == "full" else set(start)), name
        model, tokenizer = load_any(record["path"])
        held = evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=64, batch_size=4, max_blocks=4)
        assert abs(held.loss - record["loss_after"]) < 1e-4, name


def test_cli_bench_prints_the_table_and_measures_each_run_in_its_own_process(tiny, tmp_path):
    out = tmp_path / "out"
    # at 80 columns off a terminal, as in a log: the table keeps the width it needs there
    proc = cli(
        "bench", tiny.stock, "--data", tiny.train_txt, "--eval-data", tiny.held_txt, "--out", out,
        "--arms", "heads,lora,ddl+lora", "--steps", "2", "--seeds", "1", "--lrs", "1",
        "--seq-len", "64", "--batch-size", "4", "--max-eval-blocks", "4", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert {line.split()[0] for line in proc.stdout.splitlines() if line.strip()} >= {"heads", "lora", "ddl+lora"}
    state = json.loads((out / BENCH_FILE).read_text())
    assert [r["arm"] for r in state["records"]] == ["heads", "lora", "ddl+lora"]
    for record in state["records"]:
        assert record["peak_memory_kind"] == "peak RSS" and record["peak_memory_bytes"] > 50 * 2**20
        assert f"{record['trainable_params']:,}" in proc.stdout
        assert f"{record['loss_after']:.4f}" in proc.stdout
    assert "peak RSS" in proc.stdout and "± —" in proc.stdout
    assert "held-out loss on the first 4 blocks of --eval-data" in " ".join(proc.stdout.split())  # (the caption wraps)
    heads, lora = state["records"][0]["lr"], state["records"][1]["lora_lr"]
    assert f"heads {heads:.2g} ×1" in proc.stdout and f"LoRA {lora:.2g} ×1" in proc.stdout  # ddl+lora's two rates
    assert (out / PLOT_FILE).is_file()
    # Off a terminal, a plain line as each run starts (a log of an hour-long bench is not left empty).
    runs = [line for line in proc.stderr.splitlines() if line.startswith("bench: run ")]
    assert runs == [
        "bench: run 1/3: heads · seed 1 of 1 (lr ×1)",
        "bench: run 2/3: lora · seed 1 of 1 (lr ×1)",
        "bench: run 3/3: ddl+lora · seed 1 of 1 (heads ×1, LoRA ×1)",
    ], proc.stderr
    assert "bench: converting" in proc.stderr


def test_a_run_in_its_own_process_reports_its_own_peak_not_the_launching_processs():
    """A bench on CPU trains each run in a child and reports that child's peak RSS. Linux's getrusage
    carries the launching process's peak into the child through fork and exec: a child of a process
    that once held 1.5 GiB would report at least 1.5 GiB, whatever it used itself."""
    held = bytearray(b"\x01") * (3 << 29)  # 1.5 GiB, every page written: the launcher's peak
    child = (
        "from deltafy.bench.child import peak_rss_bytes\n"
        "before = peak_rss_bytes()\n"
        "grown = bytearray(b'\\x01') * (256 << 20)\n"
        "print(before, peak_rss_bytes())"
    )
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=subprocess_env())
    del held
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert 10 * 2**20 < before < 2**30, before  # the child's imports, not the launcher's 1.5 GiB
    assert after - before >= 256 * 2**20, (before, after)  # and what the child itself wrote


@pytest.mark.parametrize(
    "args, needles",
    [(["--arms", "heads,bogus"], ["unknown arm 'bogus'", "lora-large"]), (["--seeds", "0"], ["--seeds"])],
)
def test_cli_bad_arms_and_seeds_are_one_line_errors(tiny, tmp_path, args, needles):
    proc = cli(
        "bench", tiny.stock, "--data", tiny.train_txt, "--eval-data", tiny.held_txt, "--out", tmp_path / "o", *args,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert_one_line_error(proc, *needles)


def test_paths_after_eval_data_stay_held_out(monkeypatch):
    """`--eval-data held/*.md` reaches the command as one value and extra arguments: those stay held-out
    text (deltafy train once added every extra path to --data, training on the held-out text)."""
    from types import SimpleNamespace

    from deltafy.cli._console import state
    from deltafy.cli._options import extra_text_paths

    argv = ["train", "m", "--data", "a.txt", "b.txt", "--eval-data", "h1.md", "h2.md", "h3.md", "--out", "o"]
    monkeypatch.setattr(state, "argv", argv)
    assert extra_text_paths(SimpleNamespace(args=["b.txt", "h2.md", "h3.md"])) == (["b.txt"], ["h2.md", "h3.md"])
    monkeypatch.setattr(state, "argv", ["bench", "m", "--out", "o", "x"])
    with pytest.raises(DeltafyError, match="unexpected argument 'x'"):
        extra_text_paths(SimpleNamespace(args=["x"]))


def test_every_bench_flag_is_a_field_of_its_options_model_with_its_default_in_the_help():
    """One source for each setting: the command's flags are BenchOptions' fields (unset: None, so
    run_bench applies the model's default), and --help shows that default as it is typed."""
    import inspect

    from typer.testing import CliRunner

    from deltafy.cli import app
    from deltafy.cli.bench import bench_command
    from deltafy.options import BenchOptions

    parameters = inspect.signature(bench_command).parameters
    assert set(BenchOptions.model_fields) <= set(parameters)
    assert all(parameters[name].default is None for name in BenchOptions.model_fields)
    help_text = " ".join(CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "[default: 0.3,1,3]" in help_text and "[default: 4]" in help_text and "[default: 256]" in help_text


def test_the_help_lists_every_arm_with_its_description():
    from typer.testing import CliRunner

    from deltafy.bench.arms import ARMS
    from deltafy.cli import app

    help_text = " ".join(CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}).output.split())
    for name, arm in ARMS.items():
        assert f"{name} {arm.description}" in help_text, name


def test_presets_set_the_budget_and_flags_override_them():
    from deltafy.options import BENCH_PRESETS, bench_options

    gpu = bench_options(preset="gpu")
    assert (gpu.steps, gpu.seeds, gpu.seq_len, gpu.batch_size, gpu.max_eval_blocks) == (64, 3, 1024, 16, 100)
    assert gpu.steps * gpu.batch_size * gpu.seq_len >= 1_000_000 and gpu.max_eval_blocks * gpu.seq_len >= 100_000
    small = bench_options(preset="cpu-small", steps=24)
    assert small.steps == 24 and small.seq_len == BENCH_PRESETS["cpu-small"]["seq_len"] == 128
    assert bench_options().steps == 100 and bench_options().preset is None  # no preset: the defaults
    with pytest.raises(DeltafyError, match=r"invalid bench options: --preset: Input should be 'cpu-small' or 'gpu'"):
        bench_options(preset="laptop")


def test_the_bench_records_where_it_ran(benched):
    out, result, _ = benched
    state = json.loads((out / BENCH_FILE).read_text())
    assert state["settings"]["device"] == result.settings["device"] == "cpu, fp32"  # (this machine has no GPU)


def test_comparisons_are_paired_by_seed_with_their_standard_error():
    from deltafy.bench.table import comparisons

    records = [
        {"arm": "heads", "seed": 0, "loss_after": 3.0},
        {"arm": "heads", "seed": 1, "loss_after": 3.2},
        {"arm": "write-only", "seed": 0, "loss_after": 3.1},
        {"arm": "write-only", "seed": 1, "loss_after": 3.3},
        {"arm": "write-only", "seed": 2, "loss_after": 9.0},  # no heads seed 2: left out of the pairing
        {"arm": "ia3", "seed": 0, "loss_after": 2.0},
        {"arm": "ia3", "seed": 1, "loss_after": 4.0},
    ]
    by_pair = {(c.arm, c.against): c for c in comparisons(records)}
    assert set(by_pair) == {("heads", "write-only"), ("heads", "ia3")}  # the other arms did not run
    erase = by_pair["heads", "write-only"]
    assert erase.seeds == 2 and erase.difference == pytest.approx(-0.1) and erase.se == pytest.approx(0.0, abs=1e-12)
    assert erase.beyond_2se  # the same gap on every seed
    ia3 = by_pair["heads", "ia3"]  # differences +1.0 and -0.8: mean 0.1, s.e. 0.9
    assert ia3.difference == pytest.approx(0.1) and ia3.se == pytest.approx(0.9) and not ia3.beyond_2se


def test_the_bench_states_each_comparison_whose_arms_ran(tiny, tmp_path):
    result = bench(tiny, tmp_path / "out", arms=["heads", "write-only"], seeds=2, lrs=[1])
    (paired,) = result.comparisons
    after = {(r["arm"], r["seed"]): r["loss_after"] for r in result.records}
    want = sum(after["heads", s] - after["write-only", s] for s in (0, 1)) / 2
    assert (paired.arm, paired.against, paired.seeds) == ("heads", "write-only", 2)
    assert paired.difference == pytest.approx(want) and paired.se is not None
    state = json.loads((tmp_path / "out" / BENCH_FILE).read_text())
    assert state["comparisons"][0]["difference"] == pytest.approx(want)


def test_the_table_prints_each_comparison_plainly(benched, monkeypatch):
    from dataclasses import replace

    from deltafy.bench.table import Comparison
    from deltafy.cli._console import console
    from deltafy.cli.bench import _print_table

    _, result, _ = benched
    paired = [
        Comparison("heads", "write-only", "the erase term", 3, -0.0123, 0.004, True),
        Comparison("ddl+full", "full", "everything trained", 1, 0.02, None, False),
        # a tiny model's gaps: too small for 4 decimals, shown in two significant digits, not as +0.0000 ± 0.0000
        Comparison("heads", "logit", "the gate", 2, 2.1e-5, 3e-6, True),
        Comparison("heads", "expanded", "the expanded state", 2, 0.0, 0.0, False),
    ]
    monkeypatch.setattr(console, "width", 250)
    with console.capture() as captured:
        _print_table(replace(result, comparisons=paired))
    text = captured.get()
    assert (
        "the erase term: heads − write-only = -0.0123 ± 0.0040 nats over 3 seed(s) (beyond 2 s.e.); lower: heads"
        in text
    )
    assert (
        "everything trained: ddl+full − full = +0.0200 nats over 1 seed(s) (one seed: no standard error); lower: full"
        in text
    )
    assert "the gate: heads − logit = +2.1e-05 ± 3.0e-06 nats over 2 seed(s) (beyond 2 s.e.); lower: logit" in text
    assert "heads − expanded = +0.0000 ± 0.0000 nats over 2 seed(s) (within 2 s.e.); lower: neither (equal)" in text
