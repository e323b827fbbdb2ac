"""The bench's job: the sweep of each arm's learning rate, its seeds' runs, the table and the plot, resumable
from bench.json (the folder's layout: deltafy.bench)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import DeltafyError, Interrupted
from .arms import ARMS, Budgets, extended, needed, parse_arms, rate_label, rates_of, recipes_for, swept
from .folder import BENCH_FILE, FORMAT, PLOT_FILE, clear, compare, converted, guard, write
from .runs import curve, keep_only_the_record, memory_kind, train_run
from .settings import check, data_fingerprints, default_eval_every, options_for
from .table import Comparison, Row, comparisons, row_of

Progress = Callable[[int, int, str], None]  # (runs done, runs in all, what runs now)


@dataclass
class BenchResult:
    out: Path
    rows: list[Row]
    records: list[dict]  # one per arm and seed in the table
    sweep: list[dict]
    memory: str | None  # "peak RSS", "peak CUDA memory", or None where memory was not measured
    json_path: Path
    plot_path: Path | None
    trained: int = 0  # runs trained by this call (a resumed bench skips the finished ones)
    settings: dict = field(default_factory=dict)
    comparisons: list[Comparison] = field(default_factory=list)  # the paired questions whose arms both ran


def run_bench(
    source: str,
    data: list[str],
    eval_data: list[str],
    out: str | Path,
    *,
    arms: list[str] | str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    isolate: bool | None = None,
    progress: Progress | None = None,
    status: Callable[[str], None] = lambda message: None,
    **settings,
) -> BenchResult:
    """Bench ``arms`` (default: all) converted from ``source``, into ``out``; ``settings`` are the fields
    of BenchOptions (``steps``, ``seeds``, ``lrs``, ``lr_extend``, ``seq_len``, ...), unset: its defaults.

    ``lrs`` multiply each arm's default learning rates (the recipe's ``lr``, with its gate scale,
    for the heads; ``lora_lr`` for LoRA; ddl+lora trains its heads at the heads arm's best rate
    and sweeps its LoRA rate); with one value there is nothing to choose and no sweep. Where the
    best sits at an end of the grid, the sweep goes on past that end by the grid's own step, up to
    ``lr_extend`` more values, so no arm is judged at a rate the grid merely cut off. ``resume``
    continues a bench in ``out``, skipping the runs it finished; ``overwrite`` starts over.
    ``isolate`` runs each training run in a child process, which is how peak RSS is measured on a
    CPU (default: on a CPU only; on CUDA the peak is CUDA's own).
    """
    from ..checkpoint import read_config
    from ..conversion.job import guard_source
    from ..data import expand, refuse_shared_text
    from ..options import bench_options
    from ..sources.folders import output_path, refuse_overlap
    from ..training.launch import check_seq_len

    out = Path(out).expanduser()  # (the user's spelling, for the guards' messages; then where it leads)
    names = parse_arms(arms)
    options = bench_options(**settings)
    check(data, eval_data, resume, overwrite)
    steps, seeds, lrs, extend = options.steps, options.seeds, options.lrs, options.lr_extend
    sweep_seeds = options.sweep_seeds if len(lrs) > 1 else 1  # (one rate: nothing to choose, no sweep)
    seq_len, text_field, lora_targets = options.seq_len, options.text_field, options.lora_targets
    train_files, held_files = expand(list(data)), expand(list(eval_data))  # a missing file, before any work
    refuse_shared_text(train_files, held_files)
    guard_source(source, out, heads_only=False)
    texts = [("the training data", Path(f)) for f in train_files] + [("the held-out data", Path(f)) for f in held_files]
    refuse_overlap(out, [(what, path) for what, path in texts if path.exists()])
    out = output_path(out)
    recipes = recipes_for(names)
    options_for(recipes, options)
    settings = {
        "preset": options.preset,
        "device": _device(),
        "source": source,
        "data": list(data),
        "eval_data": list(eval_data),
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": options.batch_size,
        "lrs": lrs,
        "sweep_seeds": sweep_seeds,
        "eval_every": options.eval_every or default_eval_every(steps),
        "max_eval_blocks": options.max_eval_blocks,
        "lora_targets": lora_targets,
        "text_field": text_field,
    }
    saved = guard(out, resume, overwrite)
    if saved is not None:
        compare(saved["settings"], settings, out)
    isolate = not _cuda() if isolate is None else isolate

    from .. import interrupts
    from ..sources.lock import RunLock

    with RunLock(out) as lock:
        if overwrite:
            clear(out)
            saved = None
        made = [out / "models" / recipe for recipe in recipes if not (out / "models" / recipe).exists()]
        try:
            models = {recipe: converted(source, out / "models" / recipe, recipe, status) for recipe in recipes}
            check_seq_len(read_config(models[recipes[0]]), seq_len)  # (as train checks it, before a run)
            settings |= data_fingerprints(models[recipes[0]], data, eval_data, seq_len, text_field, status)
            if saved is not None:
                compare(saved["settings"], settings, out)
        except BaseException:  # refused before its first run: nothing left that the corrected command trips on
            for folder in made:
                shutil.rmtree(folder, ignore_errors=True)
            if lock.created_out:
                with contextlib.suppress(OSError):
                    (out / "models").rmdir()
            raise
        state = saved or {"format": FORMAT, "settings": settings, "sweep": [], "records": []}
        write(out / BENCH_FILE, state)  # from here on the folder is this bench's: --resume and --overwrite take it
        status("counting trainable parameters")
        budgets = Budgets(models, lora_targets)
        report = progress or (lambda done, total, what: None)
        bench = _Bench(out, state, models, budgets, data, eval_data, isolate, status, report, lrs, extend, sweep_seeds)
        # a sweep's points: --lrs for each arm swept, and for one that borrows its heads' rate (ddl+lora) a
        # second line, whose point at the borrowed rate the first line ran
        points = len(lrs) * len(swept(names)) + (len(lrs) - 1) * sum(ARMS[n].heads_lr_from is not None for n in names)
        bench.total = len(names) * seeds + (points if len(lrs) > 1 else 0) * sweep_seeds
        try:
            with interrupts.unwinding():
                for name in names:
                    bench.arm(name, seeds)
        except KeyboardInterrupt:
            done = len(state["sweep"]) + len(state["records"])
            raise Interrupted(
                f"interrupted; the {done} runs the bench finished are kept in {out / BENCH_FILE}: continue with "
                f"the same command plus --resume",
                interrupts.received,
            ) from None
        report(bench.total, bench.total, "done")
        return bench.result(names, seeds)


def _device() -> str:
    """Where the runs train and in what precision (a training run's own choice: bf16 on a GPU that has it)."""
    import torch

    if not torch.cuda.is_available():
        return "cpu, fp32"
    return f"{torch.cuda.get_device_name()}, {'bf16' if torch.cuda.is_bf16_supported() else 'fp32'}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="microseconds")


class _Bench:
    """The runs of one bench and the state file that records each as it finishes."""

    def __init__(self, out, state, models, budgets, data, eval_data, isolate, status, report, lrs, extend, sweep_seeds):
        self.out, self.state, self.models, self.budgets = out, state, models, budgets
        self.data, self.eval_data, self.isolate, self.status = list(data), list(eval_data), isolate, status
        self.report, self.lrs, self.extend, self.sweep_seeds = report, lrs, extend, sweep_seeds
        self.trained, self.done, self.total = 0, 0, 0
        self.visited: set[tuple] = set()  # sweep points this bench has reached: a shared one is one run
        self.chosen: dict[str, tuple[float, float | None]] = {}  # arm: (best multiplier, the heads' one)
        self.edges: dict[str, bool] = {}  # arm: its best is at an end of its sweep

    def options(self, name: str, multiplier: float, heads: float | None, seed: int, validation: bool):
        from ..checkpoint import read_config
        from ..options import options_from

        arm, settings = ARMS[name], self.state["settings"]
        steps = settings["steps"]
        base = read_config(self.models[arm.recipe])["deltafy"]["recipe"].get("training") or {}
        defaults = options_from(base)
        rank = self.budgets.rank(name)
        return options_from(
            base,
            train=arm.train,
            steps=steps,
            seq_len=settings["seq_len"],
            batch_size=settings["batch_size"],
            # A sweep run is judged on its final validation loss only: no evaluations on the way.
            eval_every=steps + 1 if validation else settings["eval_every"],
            save_every=steps,
            max_eval_blocks=settings["max_eval_blocks"],
            seed=seed,
            text_field=settings["text_field"],
            lr=defaults.lr * (multiplier if heads is None else heads),
            lora_lr=defaults.lora_lr * multiplier,
            lora_r=rank,
            lora_alpha=float(rank) if rank else None,  # scale 1 at every rank: one sweep fits all ranks
            lora_targets=self.budgets.lora_targets,
            lora_dora=arm.dora,
        )

    def arm(self, name: str, seeds: int) -> None:
        best, heads = self.sweep(name)
        rate = rate_label(name, best, heads)
        for seed in range(seeds):
            what = f"{name} · seed {seed + 1} of {seeds} ({rate})"
            found = self._find("records", name, seed=seed, lr_multiplier=best, heads_lr_multiplier=heads)
            kept = found is not None and (self.folder(name, seed) / "config.json").is_file()
            what += ": kept from before" if kept else ""  # a resumed bench says what it did not train again
            self.report(self.done, self.total, what)
            if not kept:
                self._seed(name, best, heads, seed)
            self.done += 1
            self.report(self.done, self.total, what)

    def sweep(self, name: str) -> tuple[float, float | None]:
        """The arm's best multiplier and its heads' one, from the sweep runs it has or trains now.

        Each is a line search: the grid of --lrs, then past whichever end holds the best, ``extend``
        times at most. An arm that borrows its heads' rate (ddl+lora) searches its LoRA rate with
        the heads at the borrowed rate, then its heads' rate at that LoRA rate: the heads' best
        alone need not be their best beside LoRA (one round: each group's rate is searched once).
        """
        if name in self.chosen:
            return self.chosen[name]
        source = ARMS[name].heads_lr_from
        heads = self.sweep(source)[0] if source is not None else None
        if len(self.lrs) == 1:
            self.chosen[name], self.edges[name] = (self.lrs[0], heads), False
            return self.chosen[name]
        best, edge = self._line(name, lambda m: (m, heads), self.lrs, len(self.lrs))
        if heads is not None:
            heads, heads_edge = self._line(name, lambda h: (best, h), sorted({*self.lrs, heads}), len(self.lrs) - 1)
            edge = edge or heads_edge
        self.chosen[name], self.edges[name] = (best, heads), edge
        return self.chosen[name]

    def _line(self, name: str, point, grid: list[float], counted: int) -> tuple[float, bool]:
        """The best value of one rate along ``grid`` with the other held (``point(m)``: the run's
        multiplier and its heads' one), and whether it is still at an end of the extended grid.
        ``counted``: the points the bench's total holds for this line (one more where a borrowed
        rate is off the grid)."""
        grid = list(grid)
        self.total += (sum((name, *point(m)) not in self.visited for m in grid) - counted) * self.sweep_seeds
        for m in grid:
            self._sweep_run(name, *point(m))
        added = 0
        while True:
            scores = [(self._score(name, *point(m)), m) for m in grid]
            scores = [(loss, m) for loss, m in scores if loss is not None]
            if scores:
                best = min(scores)[1]
                following = extended(grid, best)
                if following is None or added >= self.extend:
                    return best, following is not None
            elif added < self.extend and len(grid) > 1:  # diverged at every rate so far: go lower
                following = extended(grid, grid[0])
            else:
                raise DeltafyError(
                    f"arm {name}: the loss diverged at every learning rate tried ({', '.join(f'×{m:g}' for m in grid)})"
                    f"; try smaller ones in --lrs"
                )
            grid, added = sorted([*grid, following]), added + 1
            self.total += self.sweep_seeds
            self._sweep_run(name, *point(following))

    def _sweep_run(self, name: str, multiplier: float, heads: float | None) -> None:
        """One point of the sweep on each sweep seed, trained unless the bench has its score already."""
        if (name, multiplier, heads) in self.visited:
            return
        self.visited.add((name, multiplier, heads))
        for seed in range(self.sweep_seeds):
            if self._find("sweep", name, lr_multiplier=multiplier, heads_lr_multiplier=heads, seed=seed) is None:
                rate = rate_label(name, multiplier, heads)
                seeded = f" · seed {seed + 1} of {self.sweep_seeds}" if self.sweep_seeds > 1 else ""
                self.report(self.done, self.total, f"{name} · sweep {rate}{seeded}")
                self._validate(name, multiplier, heads, seed)
            self.done += 1

    def _score(self, name: str, multiplier: float, heads: float | None) -> float | None:
        """A sweep point's validation loss, the mean over its seeds (one seed's luck does not pick a rate
        at a cliff's edge); None where any seed diverged."""
        losses = []
        for seed in range(self.sweep_seeds):
            record = self._find("sweep", name, lr_multiplier=multiplier, heads_lr_multiplier=heads, seed=seed)
            loss = record["validation_loss"]
            if loss is None or not math.isfinite(loss):
                return None
            losses.append(loss)
        return sum(losses) / len(losses)

    def folder(self, name: str, seed: int) -> Path:
        return self.out / "runs" / name / f"seed-{seed}"

    def sweep_folder(self, name: str, multiplier: float, heads: float | None = None, seed: int = 0) -> Path:
        rate = f"lr-{multiplier:g}x" + ("" if heads is None else f"-heads-{heads:g}x")
        return self.out / "runs" / name / (rate + (f"-seed-{seed}" if seed else ""))

    def _find(self, key: str, arm: str, **match) -> dict | None:
        def fits(record: dict) -> bool:  # (a sweep record of a bench from before sweep seeds: seed 0)
            return all(record.get(k, 0 if k == "seed" else None) == v for k, v in match.items())

        return next((r for r in self.state[key] if r["arm"] == arm and fits(r)), None)

    def _validate(self, name: str, multiplier: float, heads: float | None, seed: int = 0) -> None:
        from ..training.job import NonFiniteLoss

        folder = self.sweep_folder(name, multiplier, heads, seed)
        point = (name, multiplier, heads, seed)
        self.state["sweep"] = [r for r in self.state["sweep"] if _point(r) != point]  # an unfinished try's
        options = self.options(name, multiplier, heads, seed, validation=True)
        record = {"arm": name, "lr_multiplier": multiplier, **_heads(heads), "seed": seed, **rates_of(name, options)}
        record["path"] = str(folder.resolve())
        try:  # no eval data: run_training validates on its held-out share of the training text
            numbers = train_run(self.models[ARMS[name].recipe], self.data, folder, options, None, self.isolate)
            record |= {"validation_loss": numbers["loss_after"], "validation_loss_before": numbers["loss_before"]}
            keep_only_the_record(folder)
        except NonFiniteLoss as err:  # a learning rate too large: the sweep's answer, not the bench's failure
            record |= {"validation_loss": None, "diverged": str(err)}
            self.status(f"{name}: the loss diverged at lr ×{multiplier:g}; the sweep goes on without it")
            if folder.is_dir():
                keep_only_the_record(folder)
        self._add("sweep", record)

    def _seed(self, name: str, multiplier: float, heads: float | None, seed: int) -> None:
        arm = ARMS[name]
        folder = self.folder(name, seed)
        self.state["records"] = [r for r in self.state["records"] if not (r["arm"] == name and r["seed"] == seed)]
        options = self.options(name, multiplier, heads, seed, validation=False)
        try:
            numbers = train_run(self.models[arm.recipe], self.data, folder, options, self.eval_data, self.isolate)
        except DeltafyError as err:
            raise DeltafyError(f"arm {name}, seed {seed}: {err}") from err
        record = {
            "arm": name,
            "seed": seed,
            "recipe": arm.recipe,
            "train": arm.train,
            "lr_multiplier": multiplier,
            **_heads(heads),
            **rates_of(name, options),
            **numbers,
            "delta": numbers["loss_after"] - numbers["loss_before"],
            "peak_memory_kind": memory_kind(self.isolate) if numbers["peak_memory_bytes"] is not None else None,
            "curve": curve(folder),
            "path": str(folder.resolve()),
        }
        self._add("records", record)

    def _add(self, key: str, record: dict) -> None:
        self.state[key].append(record | {"finished_at": _now()})
        self.trained += 1
        write(self.out / BENCH_FILE, self.state)

    def result(self, names: list[str], seeds: int) -> BenchResult:
        records = [r for name in names for r in self.state["records"] if r["arm"] == name and r["seed"] < seeds]
        for record in self.state["records"]:  # where the models are now: the folder may have moved since
            record["path"] = str(self.folder(record["arm"], record["seed"]).resolve())
        for record in self.state["sweep"]:
            record["path"] = str(self.sweep_folder(*_point(record)).resolve())
        rows = [row_of(name, [r for r in records if r["arm"] == name], self.edges[name]) for name in names]
        self.state["table"] = [asdict(row) for row in rows]
        paired = comparisons(records)
        self.state["comparisons"] = [asdict(c) for c in paired]
        self.state["arms"] = {name: asdict(ARMS[name]) | {"lora_r": self.budgets.rank(name)} for name in needed(names)}
        self.state["lora_targets"] = self.budgets.targets
        write(self.out / BENCH_FILE, self.state)
        plot = self._plot(names, records)
        return BenchResult(
            out=self.out,
            rows=rows,
            records=records,
            sweep=[r for r in self.state["sweep"] if r["arm"] in names],
            memory=memory_kind(self.isolate),
            json_path=self.out / BENCH_FILE,
            plot_path=plot,
            trained=self.trained,
            settings=self.state["settings"],
            comparisons=paired,
        )

    def _plot(self, names, records) -> Path:
        from ..training.plots import plot_bench

        curves = {}
        for name in names:
            runs = [dict(map(tuple, r["curve"])) for r in records if r["arm"] == name]
            steps = sorted(set.intersection(*(set(c) for c in runs))) if runs else []
            curves[name] = [(s, sum(c[s] for c in runs) / len(runs)) for s in steps]
        settings = self.state["settings"]
        title = f"{settings['source']} · {settings['steps']} steps of {settings['batch_size']}×{settings['seq_len']}"
        return plot_bench(curves, self.out / PLOT_FILE, title)


def _point(record: dict) -> tuple[str, float, float | None, int]:
    return record["arm"], record["lr_multiplier"], record.get("heads_lr_multiplier"), record.get("seed", 0)


def _heads(multiplier: float | None) -> dict:
    """The heads' own multiplier, recorded only where it is not the run's ``lr_multiplier``."""
    return {} if multiplier is None else {"heads_lr_multiplier": multiplier}


__all__ = ["ARMS", "BenchResult", "Row", "run_bench"]
