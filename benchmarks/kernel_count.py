"""Compute kernels per decode token and per training step: original vs converted, counted with torch.profiler.

    python benchmarks/kernel_count.py                                 # SmolLM2-135M and random GPT-2 124M, bf16, CPU
    python benchmarks/kernel_count.py --models smollm2 --dtype float32
    python benchmarks/kernel_count.py --recipe ddl-learned --top 12   # and the ops the conversion adds, by name
    python benchmarks/kernel_count.py --compile                       # also torch.compile'd (minutes per model on CPU)
    python benchmarks/kernel_count.py --phases train --compile --gradient-checkpointing --models smollm2
    python benchmarks/kernel_count.py --device cuda --compile         # CUDA kernel launches; the fused path too

A decode step is dispatch-bound: at batch 1 its time is about (kernels launched) x (cost of a launch),
so the kernels a conversion adds per step are the number to keep down. This counts them; it times nothing.

What is counted ("kernels"):
  cpu   the profiler's aten ops that do work, each chain counted once: an aten op counts when it is not
        a view/metadata/allocation op (NO_WORK below, an explicit list) and no aten op beneath it does
        work. So linear -> matmul -> mm counts once (mm), to -> _to_copy -> copy_ once (copy_), a bare
        view never, and the copy_ that a binary op with a wrapped scalar of another dtype runs counts
        in place of that op. Under torch.compile the C++ kernels inductor generates are counted too
        (one per call; inductor's cpp.enable_kernel_profile names them graph_<n>_cpp_fused_...), beside
        the aten ops its wrapper still calls (mm, addmm, attention).
  cuda  the kernels launched: profiler events of device type CUDA (ProfilerActivity.CUDA) other than
        memcpy/memset, whatever issued them (eager aten, inductor's Triton, deltafy.fused).
Decode token: batch 1 with the KV cache (DynamicCache) after an 8-token prompt and two warm-up steps;
the model's forward of one new token, averaged over --decode-steps steps (fixed tokens, so no argmax).
Training step: forward with labels (the loss) and loss.backward() of a --batch x --seq-len batch,
averaged over --train-steps steps after a warm-up; no optimizer step; a bf16 model under bf16 autocast,
its heads in fp32 (as `deltafy train` holds what trains); --gradient-checkpointing: every decoder layer
checkpointed (non-reentrant, as `deltafy train --gradient-checkpointing`), and a compiled cell compiled
under deltafy's compiled_checkpointing(), as `deltafy train --compile` runs. Two settings:
  train, heads-only   converted: only the DDL heads require grad (deltafy.head_parameter_groups).
                      original: every weight frozen, the embeddings' output requires grad
                      (enable_input_require_grads), so its backward runs through every layer for the
                      activations' gradients and computes no weight gradient: the base's share of a
                      heads-only backward, the comparable setting.
  train, full         both: every parameter requires grad.
Columns: "original" and "reference" (the converted model's formula in PyTorch ops, the fused path that
convert turns on where CUDA and triton are disabled) are kernels per
step; "ratio" is reference/original and "extra/site" (reference - original) / number of DDL sites;
"fused" is the converted model with deltafy.fused enabled: on CUDA its kernels run and are counted as
they launch; on CPU (where Triton's interpreter would run them as Python) each launch is recorded as a
triton::<kernel> event instead of run, beside the aten ops around it, so the count is the same structure
a GPU launches (the values computed are then garbage; no count depends on them); "compiled ..." the
same models under torch.compile (default mode, --compile). A cell that cannot be measured says why
under the table.
Targets (decode token): reference <= 1.8x the original's kernels (<= 15 extra per site); fused <= 1.15x.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import os
import re
import sys
import time
from collections import Counter

import torch
from benchmark_models import cache_kwarg, fused_api, smollm2_label  # (benchmarks/ is on a script's path)
from benchmark_models import load as load_model
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

import deltafy
import deltafy.fused
from deltafy.training.job import compiled_checkpointing

# aten ops that launch no compute: views, metadata, allocation, and the dispatch-only wrappers whose
# work (if any) shows as a child op (to -> _to_copy -> copy_, contiguous -> clone -> copy_)
NO_WORK = frozenset(
    "aten::" + name
    for name in """
    view view_as reshape reshape_as _reshape_alias _unsafe_view as_strided expand expand_as t transpose
    swapaxes swapdims permute movedim moveaxis unsqueeze squeeze flatten unflatten select slice split
    split_with_sizes unsafe_split chunk unsafe_chunk unbind narrow diagonal unfold detach detach_ alias
    lift_fresh real imag view_as_real view_as_complex numpy_T mT mH matrix_H
    empty empty_like empty_strided new_empty new_empty_strided resize_ resize_as_ set_
    resolve_conj resolve_neg conj result_type promote_types can_cast is_nonzero is_same_size
    size stride numel dim sym_size sym_stride sym_numel _has_compatible_shallow_copy_type
    to _to_copy type_as contiguous
    """.split()
)
INDUCTOR_CPP_KERNEL = re.compile(r"^(graph_\d+_)?cpp_")
TARGETS = {"reference": 1.8, "per_site": 15, "fused": 1.15}
PHASES = {
    "decode": "decode token (b1, KV cache)",
    "train": "train, heads-only",
    "train_full": "train, full",
}
PATHS = ("original", "reference", "fused")


# -- counting ------------------------------------------------------------------------------------
def _does_work(event) -> bool:
    return event.name.startswith("aten::") and event.name not in NO_WORK


def _work_below(event, memo: dict) -> bool:
    key = id(event)
    if key not in memo:
        memo[key] = any(_does_work(child) or _work_below(child, memo) for child in event.cpu_children)
    return memo[key]


def kernel_names(prof, device: str) -> Counter:
    """The kernels of a finished profile, by name (see the module docstring for what counts)."""
    events = prof.events()
    if device == "cuda":
        cuda = torch.autograd.DeviceType.CUDA
        return Counter(
            e.name for e in events if e.device_type == cuda and not e.name.lower().startswith(("memcpy", "memset"))
        )
    memo: dict = {}
    names = Counter()
    for e in events:
        if e.name.startswith("triton::") or INDUCTOR_CPP_KERNEL.match(e.name):
            names[e.name] += 1
        elif _does_work(e) and not _work_below(e, memo):
            names[e.name] += 1
    return names


@contextlib.contextmanager
def profiled(device: str, into: list):
    """Profile the block into ``into``; refused if torch.compile compiled a graph meanwhile (the count
    would hold the compiler's ops, and a model that recompiles every step is not what it seems)."""
    from torch._dynamo.utils import counters

    graphs = int(counters["stats"]["unique_graphs"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        yield
        if device == "cuda":
            torch.cuda.synchronize()
    if int(counters["stats"]["unique_graphs"]) > graphs:
        raise RuntimeError("torch.compile recompiled during the counted steps (TORCH_LOGS=recompiles says why)")
    into.append(prof)


def _per_step(profs: list, device: str, steps: int) -> tuple[float, Counter]:
    names = sum((kernel_names(p, device) for p in profs), Counter())
    return sum(names.values()) / steps, Counter({k: v / steps for k, v in names.items()})


@torch.inference_mode()
def decode_kernels(model, call=None, steps: int = 3, device: str = "cpu") -> tuple[float, Counter]:
    """Kernels of one decode step (batch 1, KV cache, after an 8-token prompt), averaged over ``steps``.
    ``call`` (default: the model) runs the forward, e.g. a torch.compile'd model."""
    call = model if call is None else call
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, 8 + 2 + steps), generator=torch.Generator().manual_seed(0)).to(device)
    kw = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    call(input_ids=ids[:, :8], **kw)
    for i in range(8, 10):  # warm-up (and, compiled, the recompile for a growing cache)
        call(input_ids=ids[:, i : i + 1], **kw)
    profs: list = []
    with profiled(device, profs):
        for i in range(10, 10 + steps):
            call(input_ids=ids[:, i : i + 1], **kw)
    return _per_step(profs, device, steps)


def set_trainable(model, setting: str) -> None:
    """``setting``: "heads" (a converted model's DDL heads only, in fp32 as `deltafy train` holds them
    whatever the model's dtype; _untrain puts them back), "inputs" (weights frozen, gradients of the
    activations from the embeddings' output on) or "full" (every parameter)."""
    model.train()
    for p in model.parameters():
        p.requires_grad_(setting == "full")
    if setting == "heads":
        for group in deltafy.head_parameter_groups(model):
            for p in group["params"]:
                if p.dtype != torch.float32:
                    p._held_as, p.data = p.dtype, p.data.float()
                p.requires_grad_(True)
    elif setting == "inputs":
        model.enable_input_require_grads()


def train_kernels(
    model, call=None, batch: int = 2, seq_len: int = 64, steps: int = 1, device: str = "cpu"
) -> tuple[float, Counter]:
    """Kernels of forward (with the loss) + loss.backward(), averaged over ``steps`` after a warm-up.
    Which parameters train is set beforehand (set_trainable)."""
    call = model if call is None else call
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0)).to(device)

    # a bf16 model trains under bf16 autocast, as `deltafy train` runs it (its casts of bf16 tensors are no-ops)
    bf16 = model.get_input_embeddings().weight.dtype == torch.bfloat16

    def step():
        with torch.autocast(torch.device(device).type, torch.bfloat16, enabled=bf16):
            loss = call(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()

    model.zero_grad(set_to_none=True)
    step()
    profs: list = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        with profiled(device, profs):
            step()
    model.zero_grad(set_to_none=True)
    return _per_step(profs, device, steps)


def n_sites(model) -> int:
    # by class name: a model loaded with trust_remote_code has the checkpoint's own DeltaSite class
    return sum(type(m).__name__ == "DeltaSite" for m in model.modules())


# -- the fused path and torch.compile: what is measurable where ------------------------------------
def fused_reason(device: str) -> str | None:
    """Why the fused path cannot be counted on ``device`` (None: it can). On CPU its Triton launches are
    counted, not run (launches_counted): TRITON_INTERPRET=1 is set here, before triton is imported."""
    fused, why = fused_api()
    if fused is None:
        return why
    if not fused.supported(torch.device(device)):
        return f"deltafy.fused.supported({device}) is False here (on CPU: triton imported without TRITON_INTERPRET=1)"
    return None


class _CountedLaunch:
    """A Triton kernel whose launches are recorded in the profile (one ``triton::<name>`` event each)
    and not run: on CPU the interpreter would run them as Python, which is no kernel to count."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with torch.profiler.record_function(f"triton::{self.name}"):
                pass

        return launch


@contextlib.contextmanager
def launches_counted(device: str):
    """On CPU, the fused path's kernels as _CountedLaunch (the values it computes are then garbage: the
    count does not depend on them); on CUDA they run and the profiler sees them launch."""
    if device != "cpu":
        yield
        return
    kernel = importlib.import_module("deltafy.fused.kernel")
    saved = {name: getattr(kernel, name) for name in ("_forward_kernel", "_backward_kernel")}
    try:
        for name in saved:
            setattr(kernel, name, _CountedLaunch(name.strip("_").removesuffix("_kernel")))
        yield
    finally:
        for name, value in saved.items():
            setattr(kernel, name, value)


def enable_fused(model) -> int:
    fused, _ = fused_api()
    switched = fused.enable(model)
    if not switched:
        raise RuntimeError("deltafy.fused.enable switched no site")
    return switched


# -- one model -----------------------------------------------------------------------------------
@contextlib.contextmanager
def interpreted(device: str):
    """On CPU, TRITON_INTERPRET=1 while counting (triton, if first imported now, in its interpreter mode;
    deltafy.fused reads the variable at each call), as it was before afterwards."""
    before = os.environ.get("TRITON_INTERPRET")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


def count_kernels(
    original,
    recipe: str = "ddl-scalar",
    device: str = "cpu",
    phases=tuple(PHASES),
    with_compile: bool = False,
    decode_steps: int = 3,
    train_steps: int = 1,
    batch: int = 2,
    seq_len: int = 64,
    checkpointing: bool = False,
) -> dict:
    """Kernels per step of ``original`` (left as it is) and of its conversion with ``recipe``; ``checkpointing``:
    the training phases with activation checkpointing.

    Returns {"sites": n, "device": ..., "counts": {phase: {column: kernels per step or None}},
    "names": {phase: {column: Counter of kernel names}}, "notes": {column: why it is None}} with the
    phases of PHASES and the columns original, reference, fused and, with ``with_compile``, "compiled
    original", "compiled reference", "compiled fused"; ``derived(result, phase)`` adds the ratios."""
    with interpreted(device):
        steps = (decode_steps, train_steps, batch, seq_len)
        return _count(original, recipe, device, phases, with_compile, *steps, checkpointing)


def _count(original, recipe, device, phases, with_compile, decode_steps, train_steps, batch, seq_len, checkpointing):
    if device == "cpu":
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True  # name inductor's C++ kernels in the profile
    base = copy.deepcopy(original).to(device).eval()
    converted = deltafy.convert(copy.deepcopy(base), recipe).eval()
    deltafy.fused.disable(converted)  # convert puts the sites on the fused path where CUDA and triton are
    models = {"original": base, "reference": converted}
    notes: dict[str, str] = {}
    why = fused_reason(device)
    if why is None:
        try:
            models["fused"] = copy.deepcopy(converted)
            enable_fused(models["fused"])
        except Exception as err:  # a fused path that fails is a cell that says so, not a crash
            models.pop("fused", None)
            why = f"error: {_first_line(err)}"
    if why is not None:
        notes["fused"] = why
    columns = [*PATHS] + ([f"compiled {p}" for p in PATHS] if with_compile else [])
    if not with_compile:
        notes["compiled"] = "not run; --compile counts it"
    counts = {phase: dict.fromkeys(columns) for phase in phases}
    names = {phase: {} for phase in phases}
    settings = {"train": {"original": "inputs"}, "train_full": {}}
    for phase in phases:
        for column in columns:
            path = column.removeprefix("compiled ")
            if path not in models:
                continue
            model = models[path]
            call, started, compiled = None, time.monotonic(), column.startswith("compiled")
            if compiled:
                torch._dynamo.reset()  # each compiled cell traces afresh (train settings change the graph)
                call = torch.compile(model)
            try:
                with contextlib.ExitStack() as cell:
                    if path == "fused":
                        cell.enter_context(launches_counted(device))
                    if compiled:
                        cell.enter_context(compiled_checkpointing())
                    if phase == "decode":
                        model.eval()
                        n, by_name = decode_kernels(model, call, decode_steps, device)
                    else:
                        default = "heads" if phase == "train" else "full"
                        set_trainable(model, settings[phase].get(path, default))
                        if checkpointing:
                            _checkpointing(model, True)
                        n, by_name = train_kernels(model, call, batch, seq_len, train_steps, device)
            except Exception as err:
                notes[column] = f"error: {_first_line(err)}"
                continue
            finally:
                if phase != "decode":
                    _untrain(model)
            counts[phase][column], names[phase][column] = n, by_name
            # each cell as it is counted: a run cut short (a compile that outlasts a timeout) keeps what it had
            print(f"  {phase}, {column}: {n:g} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    return {"sites": n_sites(converted), "device": device, "counts": counts, "names": names, "notes": notes}


def _checkpointing(model, on: bool) -> None:
    # under the name this transformers has: gradient_* is a deprecated alias of activation_* since v5
    name = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"
    if on:
        getattr(model, f"{name}_checkpointing_enable")(**{f"{name}_checkpointing_kwargs": {"use_reentrant": False}})
    else:
        getattr(model, f"{name}_checkpointing_disable")()


def _untrain(model) -> None:
    with contextlib.suppress(Exception):
        model.disable_input_require_grads()
    _checkpointing(model, False)
    for p in model.parameters():
        p.requires_grad_(False)
        if hasattr(p, "_held_as"):  # (set_trainable's fp32 heads, back in the model's dtype)
            p.data = p.data.to(p._held_as)
            del p._held_as
    model.zero_grad(set_to_none=True)
    model.eval()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def derived(result: dict, phase: str) -> dict:
    """A phase's counts with reference/original ("ratio"), the extra kernels per site ("per_site"),
    fused/original ("fused_ratio") and the compiled ones' ratios, None where a count is missing."""
    c, sites = result["counts"][phase], result["sites"]

    def ratio(a, b):
        return None if c.get(a) is None or c.get(b) is None else c[a] / c[b]

    out = dict(c)
    out["ratio"] = ratio("reference", "original")
    out["per_site"] = (c["reference"] - c["original"]) / sites if out["ratio"] is not None and sites else None
    out["fused_ratio"] = ratio("fused", "original")
    out["compiled_ratio"] = ratio("compiled reference", "compiled original")
    out["compiled_fused_ratio"] = ratio("compiled fused", "compiled original")
    return out


# -- the command line ----------------------------------------------------------------------------
def load(name: str, dtype: torch.dtype):
    if name == "smollm2":
        LABELS[name] = smollm2_label()
    return load_model(name, dtype)


LABELS = {"smollm2": "SmolLM2-135M", "gpt2": "GPT-2 124M (random)"}


def _cell(value, fmt: str) -> str:
    """``value`` formatted as ``fmt`` (width.precision f), or n/a in the same width."""
    return f"{'n/a':>{fmt.split('.')[0]}s}" if value is None else format(value, fmt)


def print_table(label: str, result: dict, args, top: int = 0) -> None:
    with_compile = any(k.startswith("compiled") for k in next(iter(result["counts"].values())))
    head = f"{'phase':28s} {'original':>9s} {'reference':>9s} {'ratio':>6s} {'extra/site':>10s}"
    head += f" {'fused':>9s} {'ratio':>6s}"
    if with_compile:
        head += f" {'c.original':>10s} {'c.reference':>11s} {'ratio':>6s} {'c.fused':>9s} {'ratio':>6s}"
    checkpointed = ", training with every layer checkpointed" * args.gradient_checkpointing
    print(f"\n{label}: {args.dtype}, {result['device']}, {args.recipe}, {result['sites']} sites{checkpointed}")
    print(head)
    for phase in result["counts"]:
        d = derived(result, phase)
        line = (
            f"{PHASES[phase]:28s} {_cell(d['original'], '9.1f')} {_cell(d['reference'], '9.1f')}"
            f" {_cell(d['ratio'], '6.2f')} {_cell(d['per_site'], '10.1f')} {_cell(d['fused'], '9.1f')}"
            f" {_cell(d['fused_ratio'], '6.2f')}"
        )
        if with_compile:
            line += (
                f" {_cell(d['compiled original'], '10.1f')} {_cell(d['compiled reference'], '11.1f')}"
                f" {_cell(d['compiled_ratio'], '6.2f')} {_cell(d['compiled fused'], '9.1f')}"
                f" {_cell(d['compiled_fused_ratio'], '6.2f')}"
            )
        print(line, flush=True)
    for column, why in result["notes"].items():
        print(f"  {column}: n/a ({why})" if not why.startswith("error") else f"  {column}: {why}")
    if top:
        for phase in result["names"]:
            names = result["names"][phase]
            if "original" in names and "reference" in names:
                extra = names["reference"] - names["original"]  # Counter subtraction keeps the positive
                items = ", ".join(f"{k.removeprefix('aten::')} {v:g}" for k, v in extra.most_common(top))
                print(f"  added per step, {PHASES[phase]}: {items}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gpt2")
    parser.add_argument("--recipe", default="ddl-scalar")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    parser.add_argument("--compile", action="store_true", help="also count the torch.compile'd models")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="train phases with every decoder layer checkpointed"
    )
    parser.add_argument("--decode-steps", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=0, help="list the N op names the conversion adds most")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    phases = [p for p in args.phases.split(",") if p]
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"unknown phase(s) {sorted(unknown)}; use {', '.join(PHASES)}")
    gpu = f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"torch {torch.__version__}{gpu}; kernels per step (see --help for what counts)")
    print(
        f"targets (decode token): reference <= {TARGETS['reference']}x original (<= {TARGETS['per_site']} extra "
        f"per site), fused <= {TARGETS['fused']}x"
    )
    dtype = getattr(torch, args.dtype)
    for name in args.models.split(","):
        original = load(name, dtype)
        result = count_kernels(
            original,
            args.recipe,
            args.device,
            phases,
            args.compile,
            args.decode_steps,
            args.train_steps,
            args.batch,
            args.seq_len,
            args.gradient_checkpointing,
        )
        print_table(LABELS.get(name, name), result, args, args.top)
        del original, result


if __name__ == "__main__":
    main()
