from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..bench.arms import ARMS, swept_group
from ..options import BenchOptions
from ._console import console, err_console, state
from ._options import OFF, OverwriteOpt, described, extra_text_paths, with_model_options


# Every bench setting is a flag generated from BenchOptions, the model run_bench validates them with.
@with_model_options(BenchOptions, panel="Bench options", source=None)
def bench_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="Hub id, local HF folder, .gguf file or alias to convert and bench.")],
    data: Annotated[
        list[str], typer.Option("--data", "-d", help="Training text (files, folders, globs, datasets). Repeatable.")
    ],
    eval_data: Annotated[
        list[str],
        typer.Option(
            "--eval-data", help="Held-out text every arm is reported on; never used to choose a learning rate."
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the converted models, runs and results.")],
    arms: Annotated[
        str | None,
        typer.Option("--arms", **described("Comma-separated arms (listed above).", "all")),
    ] = None,
    resume: Annotated[
        bool, typer.Option("--resume", **described("Continue the bench in --out, keeping its finished runs.", OFF))
    ] = False,
    overwrite: OverwriteOpt = False,
    **flags,
) -> None:
    from ..bench import run_bench

    extra_data, extra_eval = extra_text_paths(ctx)
    state.kept = f"the runs the bench finished (if any) are kept in {out}: continue with the same command plus --resume"
    with _Bar() as bar:
        result = run_bench(
            model,
            list(data) + extra_data,
            list(eval_data) + extra_eval,
            out,
            arms=arms,
            resume=resume,
            overwrite=overwrite,
            progress=bar.progress,
            status=bar.status,
            **flags,  # None where a flag was not given: BenchOptions' default
        )
    _print_table(result)


# the help's arm list is the arms table itself (deltafy.bench.arms.ARMS), so it cannot fall behind it
bench_command.__doc__ = "\n\n".join(
    [
        "Train DDL arms and their baselines from one conversion of MODEL, each at its best swept learning "
        "rate, and compare them on the same held-out text.",
        "[bold]Arms[/]",
        "\n".join(f"  {name:<12} {arm.description}" for name, arm in ARMS.items()),
        "[bold]Example[/]",
        "  deltafy bench smollm2-135m --data plays/ --eval-data held-out/ --out ./bench --preset cpu-small",
    ]
)


class _Bar:
    """One bar over every run of the bench, its description saying which arm runs and whether it is
    the learning-rate sweep or a seed; between runs it says what is being prepared. Off a terminal
    (a log file, a batch job) a plain line for each run instead, which an hour-long bench owes a log."""

    def __enter__(self) -> _Bar:
        self.bars = None
        self.plain = not err_console.is_terminal
        self.said = None
        return self

    def __exit__(self, *exc) -> None:
        if self.bars is not None:
            self.bars.__exit__(*exc)

    def _started(self):
        """The bar, drawn at the first news: a setting refused at once leaves no trace of one."""
        if self.bars is not None:
            return self.bars
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.bars = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=True,
        )
        self.bars.__enter__()
        self.task = self.bars.add_task("", total=None)
        return self.bars

    def status(self, message: str) -> None:
        if self.plain:
            self._say(f"bench: {message} …", message)
        else:
            self._started().update(self.task, description=escape(message) + " …")

    def progress(self, done: int, total: int, what: str) -> None:
        if self.plain:
            if what != "done":
                self._say(f"bench: run {min(done + 1, total)}/{total}: {what}", what)
        else:
            self._started().update(self.task, completed=done, total=total, description=escape(f"bench: {what}"))

    def _say(self, line: str, what: str) -> None:
        """The line of ``what`` once: a run is reported as it starts and again as it ends."""
        if what != self.said:
            self.said = what
            err_console.print(escape(line), highlight=False, soft_wrap=True)


def _nats(value: float, signed: bool = False) -> str:
    """A loss difference to 4 decimals, as every loss in the table; one too small for them (a tiny model's)
    in two significant digits, not as a 0.0000 that reads as no difference at all."""
    digits = ".1e" if 0 < abs(value) < 5e-5 else ".4f"
    return format(value, ("+" if signed else "") + digits)


def _rate(row) -> str:
    """The learning rate and its multiplier; the heads' and the other group's (LoRA or the weights) apart where
    they were chosen apart."""
    edge = "*" if row.lr_at_edge else ""
    if row.heads_lr_multiplier is None:
        return f"{row.lr:.2g} ×{row.lr_multiplier:g}{edge}"
    other = f"{swept_group(row.arm)} {row.lora_lr:.2g} ×{row.lr_multiplier:g}{edge}"
    return f"heads {row.lr:.2g} ×{row.heads_lr_multiplier:g}\n{other}"


def _print_table(result) -> None:
    from rich import box
    from rich.segment import Segments
    from rich.table import Table

    from ..bench.table import ROSE

    settings = result.settings
    memory = result.memory or "peak memory"
    table = Table(
        title=f"deltafy bench · {escape(settings['source'])}",
        caption=(
            f"{settings.get('device', 'cpu, fp32')}: {settings['steps']} steps of {settings['batch_size']}×"
            f"{settings['seq_len']} tokens per arm, held-out loss on the first {settings['max_eval_blocks']} blocks of "
            f"--eval-data; lr chosen on "
            f"a held-out share of --data (* at an end of the sweep); Δ ± standard error over seeds (! a seed rose over "
            f"{ROSE:.0%} above its start); {memory} per run"
            + ("" if result.memory else " (measured on CUDA, or on a CPU with each run in its own process)")
        ),
        box=box.SIMPLE_HEAD,
    )
    for name in ("arm", "trainable", "held-out before → after", "Δ nats", "lr", "s/step", memory):
        table.add_column(name, justify="left" if name == "arm" else "right")
    for row in result.rows:
        se = "—" if row.delta_se is None else _nats(row.delta_se)
        peak = "—" if row.peak_memory_bytes is None else f"{row.peak_memory_bytes / 2**20:,.0f} MiB"
        table.add_row(
            row.arm,
            f"{row.trainable_params:,}" + (f" r={row.lora_r}" if row.lora_r else ""),
            f"{row.loss_before:.4f} → {row.loss_after:.4f}",
            f"{_nats(row.delta, signed=True)} ± {se}" + ("!" if row.rose_above_start else ""),
            _rate(row),
            f"{row.seconds_per_step:.2f}",
            peak,
        )
    if console.is_terminal:
        console.print(table)
    else:  # a log or a pipe: at rich's assumed 80 columns "write-only" would be cut to "write-on…", every cell wrapped
        console.print(Segments(console.render(table, console.options.update_width(10_000))))
    for c in result.comparisons:
        spread = "" if c.se is None else f" ± {_nats(c.se)}"
        verdict = (
            "one seed: no standard error" if c.se is None else "beyond 2 s.e." if c.beyond_2se else "within 2 s.e."
        )
        better = c.arm if c.difference < 0 else c.against if c.difference > 0 else "neither (equal)"
        console.print(
            f"{c.question}: {c.arm} − {c.against} = {_nats(c.difference, signed=True)}{spread} nats over "
            f"{c.seeds} seed(s) ({verdict}); lower: {better}"
        )
    edges = [row.arm for row in result.rows if row.lr_at_edge]
    if edges:
        console.print(
            f"note: the best learning rate of {', '.join(edges)} is at an end of the sweep; a wider one "
            "(--lrs, --lr-extend) may do better"
        )
    for row in result.rows:
        if row.rose_above_start:
            seeds = ", ".join(f"seed-{seed} at step {step}" for seed, step in row.rose_above_start)  # its folder
            console.print(
                f"note: the held-out loss of {row.arm} rose over {ROSE:.0%} above where it started ({seeds}): its "
                f"rate may sit at the edge of divergence; see {escape(str(result.plot_path))} before trusting the row"
            )
    console.print(f"wrote [bold]{escape(str(result.json_path))}[/] and [bold]{escape(str(result.plot_path))}[/]")
