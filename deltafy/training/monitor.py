"""What a training run shows and records as it goes: one JSON line per step in metrics.jsonl, a rich
progress bar on a terminal or a plain line every tenth of the run elsewhere, and the stop on a
non-finite loss or a signal (at a step boundary, so the step is saved whole)."""

from __future__ import annotations

import math
import signal
import sys
import time
from pathlib import Path

import torch

from .run_folder import append_metrics


def to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def monitor(out: Path, total_steps: int, tokens_per_step: int, show_progress: bool, stop: Stop, first: str = ""):
    from transformers import TrainerCallback

    class Monitor(TrainerCallback):
        """Metrics as JSON lines; progress as a rich bar on a terminal, else a plain line every
        tenth of the run (a log file or CI would otherwise show nothing until the end), ``first``
        saying what the first step does beyond a step (compiling); a stop on a non-finite loss or a signal.
        With a ``first``, the speeds shown and ``timing()`` leave that step out: a compiled run's first
        step takes minutes, and a mean over it would say nothing of the steps the run is made of."""

        def __init__(self):
            self.progress = None
            self.started = None
            self.every = max(1, total_steps // 10)
            self.steps, self.first_end, self.last_end = 0, None, None  # this session's steps, when they ended

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            self.steps = 0
            if show_progress and state.is_world_process_zero and sys.stderr.isatty():
                from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

                self.progress = Progress(
                    TextColumn("[bold]train[/]"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(),
                    transient=False,
                )
                self.task = self.progress.add_task("train", total=total_steps, completed=state.global_step, info=first)
                self.progress.start()
            elif show_progress and state.is_world_process_zero and first:
                to_stderr(f"train: {first}")

        def on_step_end(self, args, state, control, **kwargs):
            self.steps, self.last_end = self.steps + 1, time.perf_counter()
            if self.steps == 1:
                self.first_end = self.last_end
            if stop.requested():  # at a step boundary: save this step, then leave the loop
                control.should_save = True
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(loss):
                control.should_training_stop = True
                control.should_save = False
                state.deltafy_nonfinite = state.global_step
                return
            since, steps = self._span()  # (on_log follows on_step_end: this step is counted)
            speed = steps * tokens_per_step / (time.perf_counter() - since)
            logs |= {"step": state.global_step, "tokens_per_second": speed}
            if not state.is_world_process_zero:
                return
            append_metrics(out, logs)
            if loss is None:
                if self.progress is not None:
                    self.progress.update(self.task, completed=state.global_step)
                return
            speed, lr = logs["tokens_per_second"], logs.get("learning_rate", 0.0)
            info = f"loss {loss:.4f} · {speed:.0f} tok/s · lr {lr:.2e}"
            if self.progress is not None:
                self.progress.update(self.task, completed=state.global_step, info=info)
            elif show_progress and (state.global_step % self.every == 0 or state.global_step == total_steps):
                to_stderr(f"train: step {state.global_step}/{total_steps} · {info}")

        def on_train_end(self, args, state, control, **kwargs):
            self.stop()

        def timing(self) -> tuple[float, float | None]:
            """Seconds a step over this session's steps, and the first step's seconds where it was left out
            of that mean (with a ``first``, and other steps after it), else None."""
            if not self.steps:
                return 0.0, None
            since, steps = self._span()
            left_out = self.first_end - self.started if since != self.started else None
            return (self.last_end - since) / steps, left_out

        def _span(self) -> tuple[float, int]:
            """Since when, and over how many of this session's steps, a speed is measured: from the end of the
            first step where a ``first`` made it slow and others followed it, else from the start."""
            if first and self.steps > 1:
                return self.first_end, self.steps - 1
            return self.started, max(self.steps, 1)

        def stop(self):
            if self.progress is not None:
                self.progress.stop()
                self.progress = None

    return Monitor()


class Stop:
    """SIGINT and SIGTERM during training: the first asks the run to save and stop at the next step
    boundary, a second aborts at once. Outside training both abort at once (nothing to save).

    In a distributed run every rank stops at the same step: the ranks agree on the flag each step,
    since a rank that left the loop alone would leave the others waiting in a collective forever.
    """

    def __init__(self):
        self.signal: int | None = None
        self.training = False
        self.previous = {}

    def __enter__(self) -> Stop:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals stay Python's
                break
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if not self.training or self.signal is not None:
            from ..interrupts import note

            note(signum)
            raise KeyboardInterrupt
        self.signal = signum

    def requested(self) -> bool:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signal is not None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([0 if self.signal is None else self.signal], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())
        return bool(flag.item())
