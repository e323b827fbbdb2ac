"""How the device run (benchmarks/gpu.py) times its cells: prefill, decode with the variants in lockstep,
training steps with their peak memory; each cell group under a time limit, a failure written into its cells."""

from __future__ import annotations

import contextlib
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import torch
from benchmark_models import cache_kwarg  # (benchmarks/ is on a script's path)
from gpu_table import LABELS, Table


@dataclass(frozen=True)
class Shapes:
    prefill: tuple[int, int]
    prompt: int
    new_tokens: int
    decode_batches: tuple[int, ...]
    train: tuple[int, int]
    logits: tuple[int, int]
    rounds: int  # timed rounds (prefill, decode) after one warm-up round
    train_steps: int  # timed steps per variant after warm-up
    train_warmup: int


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"error: {type(err).__name__}: {lines[0] if lines else ''}"[:200]


class CellTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float | None):
    """Raise CellTimeout in the main thread after ``seconds`` (between Python bytecodes: a compile or a
    Python loop is interrupted; one CUDA call that never returns is left to the deadline's watchdog)."""
    if seconds is None or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise CellTimeout(f"timed out after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Bench:
    def __init__(self, args, shapes: Shapes, table: Table):
        self.args, self.shapes, self.table = args, shapes, table
        self.device = args.device
        self.cuda = self.device == "cuda"
        self.start = time.monotonic()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self, model: str, measures, fn, compiled: bool = False) -> None:
        """Run one cell group: ``fn()`` returns {measure: {column: value}} for ``measures`` (one or a
        list); a failure or timeout marks every column of them with the error and the run goes on."""
        measures = [measures] if isinstance(measures, str) else list(measures)
        columns = ("baseline", "reference", "fused")

        def mark(text: str) -> None:
            for measure in measures:
                for column in columns:
                    if self.table.rows[model, measure].cells.get(column) is None:
                        self.table.set(model, measure, column, text)

        if any(word in measure for word in self.args.skip for measure in measures):
            return mark("skipped (--skip)")
        if self.args.only and not any(word in measure for word in self.args.only for measure in measures):
            return mark("not run (--only)")
        if compiled and not self.args.compile:
            return mark("compiled rows off" + (" on CPU (--compile runs them)" if not self.cuda else " (--no-compile)"))
        if compiled and self.elapsed() > self.args.budget:
            return mark(f"time budget: would start after {self.args.budget:g} s (--budget)")
        print(
            f"[{self.elapsed():6.1f} s] {LABELS.get(model, model)}: {', '.join(measures)}", file=sys.stderr, flush=True
        )
        try:
            with time_limit(max(self.args.deadline - self.elapsed() - 15, 5.0)):
                values = fn()
        except Exception as err:  # OOM, compile errors, a timeout: the cells say so
            values = {}
            mark(first_line(err))
            if self.cuda:
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
                torch.cuda.empty_cache()
        finally:
            if compiled:
                with contextlib.suppress(Exception):
                    torch._dynamo.reset()
        for measure, cells in values.items():
            for column, value in cells.items():
                self.table.set(model, measure, column, value)

    # prefill -----------------------------------------------------------------------------------
    def prefill(self, calls: dict, vocab: int) -> dict:
        b, t = self.shapes.prefill
        ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0)).to(self.device)
        times = {name: [] for name in calls}
        dropped: dict[str, str] = {}
        with torch.inference_mode():
            for r in range(self.shapes.rounds + 1):
                for name in rotate([n for n in calls if n not in dropped], r):
                    graphs = compiled_graphs()
                    self.sync()
                    start = time.perf_counter()
                    calls[name](input_ids=ids, use_cache=False)
                    self.sync()
                    if r:  # round 0 warms up (and compiles)
                        times[name].append(time.perf_counter() - start)
                        if compiled_graphs() > graphs:
                            dropped[name] = RECOMPILES
        return speeds(times, ids.numel(), dropped)

    # decode ------------------------------------------------------------------------------------
    def decode(self, models: dict, batch: int, compiled: bool) -> dict:
        """Tokens/s of greedy decode, the variants in lockstep one token at a time."""
        from transformers import DynamicCache, StaticCache

        s = self.shapes
        vocab = next(iter(models.values())).get_input_embeddings().num_embeddings
        prompt = torch.randint(0, vocab, (batch, s.prompt), generator=torch.Generator().manual_seed(1))
        prompt = prompt.to(self.device)
        steps, caches = {}, {}
        for name, model in models.items():
            if compiled:
                # one cache per variant for the whole run, reset between rounds: CUDA graphs keep its address
                caches[name] = StaticCache(config=model.config, max_cache_len=s.prompt + s.new_tokens + 1)
                steps[name] = torch.compile(model, mode="reduce-overhead", dynamic=False)
            else:
                steps[name] = model
        times = {name: [] for name in models}
        dropped: dict[str, str] = {}  # a variant that recompiles step after step stops being timed
        with torch.inference_mode():
            for r in range(s.rounds + 1):
                kw, tokens = {}, {}
                live = [n for n in models if n not in dropped]
                for name in live:
                    model = models[name]
                    if compiled:
                        caches[name].reset()
                        cache = caches[name]
                    else:
                        cache = DynamicCache(config=model.config)
                    kw[name] = {cache_kwarg(model): cache, "use_cache": True}
                    # the prompt runs eagerly (a compiled prefill would be one more graph per length)
                    tokens[name] = model(input_ids=prompt, **kw[name]).logits[:, -1:].argmax(-1)
                for i in range(s.new_tokens):
                    for name in rotate([n for n in live if n not in dropped], i):
                        graphs = compiled_graphs()
                        if compiled:
                            torch.compiler.cudagraph_mark_step_begin()
                        self.sync()
                        start = time.perf_counter()
                        logits = steps[name](input_ids=tokens[name], **kw[name]).logits
                        tokens[name] = logits[:, -1:].argmax(-1)
                        self.sync()
                        if r:
                            times[name].append(time.perf_counter() - start)
                        # the first steps may compile (and record CUDA graphs); later ones must not
                        if (r or i >= 3) and compiled_graphs() > graphs:
                            dropped[name] = RECOMPILES
        return speeds(times, batch, dropped)

    # training ----------------------------------------------------------------------------------
    def train(self, arms: dict) -> dict:
        """Median seconds per optimizer step and peak memory (bytes) per arm; ``arms`` maps a name to
        (model, optimizer). The arms alternate step by step."""
        b, t = self.shapes.train
        vocab = next(iter(arms.values()))[0].get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(2)).to(self.device)
        times = {name: [] for name in arms}
        peaks = {name: 0 for name in arms}
        failed: dict[str, str] = {}  # an arm that fails (the fused kernel's backward, an OOM) drops out alone
        for r in range(self.shapes.train_warmup + self.shapes.train_steps):
            for name in rotate([n for n in arms if n not in failed], r):
                model, opt = arms[name]
                self.sync()
                if self.cuda:
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                start = time.perf_counter()
                try:
                    with torch.autocast(self.device, torch.bfloat16, enabled=self.args.dtype == torch.bfloat16):
                        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                    loss.backward()
                    opt.step()
                    self.sync()
                except CellTimeout:
                    raise
                except Exception as err:
                    failed[name] = first_line(err)
                    if self.cuda:
                        torch.cuda.empty_cache()
                    continue
                finally:
                    opt.zero_grad(set_to_none=True)
                elapsed = time.perf_counter() - start
                if r >= self.shapes.train_warmup:
                    times[name].append(elapsed)
                    if self.cuda:
                        own = resident_bytes(model, opt)
                        peaks[name] = max(peaks[name], own + torch.cuda.max_memory_allocated() - before)
        results = {name: (failed[name],) * 2 for name in failed}
        for name, ts in times.items():
            if name not in failed:
                results[name] = (statistics.median(ts), peaks[name] if self.cuda else "CPU: no allocator statistics")
        return results


def compiled_graphs() -> int:
    """How many graphs torch.compile has compiled so far (a count that grows while timing means the
    timed calls recompiled: their time would be the compiler's)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def speeds(times: dict, tokens_per_call: int, dropped: dict) -> dict:
    """Tokens/s per variant, or the note that says why it was not timed to the end."""
    return {name: dropped.get(name) or tokens_per_call * len(ts) / sum(ts) for name, ts in times.items()}


RECOMPILES = "torch.compile recompiled while timed: its time would be the compiler's (TORCH_LOGS=recompiles says why)"


def rotate(names: list, r: int) -> list:
    """Round ``r``'s order: each variant goes first in turn."""
    k = r % len(names)
    return names[k:] + names[:k]


def resident_bytes(model, opt) -> int:
    """What an arm keeps between steps: its weights, buffers and optimizer state (grads are set to None)."""
    seen, total = set(), 0
    tensors = [*model.parameters(), *model.buffers()]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        if tensor.device.type == "cuda" and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
