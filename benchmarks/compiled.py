"""What torch.compile makes of a converted model, measured on a CPU: the Triton kernels inductor writes for
a GPU, and what a compiled decode step costs the host. Original vs converted; it needs no GPU.

    python benchmarks/compiled.py                     # both parts, recipe ddl-scalar
    python benchmarks/compiled.py --only kernels --recipe ddl-learned
    python benchmarks/compiled.py --only kernels --model gpt2
    python benchmarks/compiled.py --only host --rounds 9 --packed

kernels  A random Llama of SmolLM2-135M's shape (--model gpt2: GPT-2 124M's), 2 layers, bf16, compiled (default
         mode) for a batch-1 decode step with the KV cache, a 4x1024 prefill and a heads-only training step
         (forward with the loss, backward, under bf16 autocast). inductor is told to write its CPU graphs as Triton
         code (cpu_backend="triton"), which is the scheduling and fusion it does for a GPU, and each kernel's
         source is collected as inductor hands it to Triton to compile; nothing is compiled or run (that needs
         a GPU), so the step then fails, as expected, and the count is of the code inductor wrote. "extern" are
         the calls inductor leaves to aten (matmuls, attention). Caveat: inductor's heuristics read some device
         properties, so a GPU may split a kernel differently; the same code is compared on both sides.
host     A random Llama with SmolLM2's 30 layers but a width of 64, compiled, decoding batch 1 with the KV
         cache, one model after the other in each of --rounds rounds: at that width the arithmetic is
         negligible, so a compiled step's time is what the host spends issuing it (dynamo's guards on every
         parameter and attribute the forward read, fetching the graph's inputs, inductor's wrapper). Also the
         guard tree of the decode step's compiled entry: its nodes, and one evaluation of it timed alone.
         Under CUDA graphs (mode="reduce-overhead") the kernels are replayed in one launch, and this is what
         is left for the host to do per token. --packed adds the converted model with each site's five head
         tensors packed into one parameter that the forward slices (the same logits, checked): what one
         graph input a site instead of five would save, which no checkpoint format of deltafy's does yet.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import itertools
import math
import statistics
import sys
import time

import torch
from benchmark_models import SMOLLM2, cache_kwarg, open_gates  # (benchmarks/ is on a script's path)
from kernel_count import n_sites, set_trainable


def llama(**shape):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**SMOLLM2, **shape})).eval()


def two_layers(name: str):
    """SmolLM2-135M's shape or GPT-2 124M's, random weights, 2 layers, bf16."""
    if name == "smollm2":
        return llama(num_hidden_layers=2).to(torch.bfloat16)
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2)).to(torch.bfloat16).eval()
    model.loss_type = "ForCausalLM"  # (a GPT2LMHeadModel has none: a warning inside the forward, a graph break)
    return model


def converted(model, recipe: str):
    import deltafy

    model = deltafy.convert(copy.deepcopy(model), recipe=recipe)
    open_gates(model)  # (heads as after training: a zero strength would let inductor fold the correction away)
    return model


def decode_step(model) -> dict:
    """The keywords of one cached decode step of ``model``, after an 8-token prompt."""
    from transformers import DynamicCache

    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    step = {cache_kwarg(model): DynamicCache(config=model.config), "use_cache": True}
    with torch.no_grad():
        model(input_ids=ids, **step)
    return {"input_ids": ids[:, :1], **step}


# -- kernels: inductor's Triton code for a GPU, written on the CPU ----------------------------------------
@contextlib.contextmanager
def triton_codegen_only(kernels: list):
    """inductor writes Triton kernels for CPU graphs and appends (name, source) to ``kernels`` in place of
    compiling them. Two private hooks: Triton's backend hash (which asks for a GPU driver) and the call that
    compiles a kernel's source."""
    import torch._inductor.async_compile as async_compile
    import torch._inductor.config as inductor_config
    import torch.utils._triton as torch_triton

    def collect(self, kernel_name, source_code, *args, **kwargs):
        kernels.append((kernel_name, source_code))

    saved = torch_triton.triton_hash_with_backend, async_compile.AsyncCompile.triton
    torch_triton.triton_hash_with_backend = lambda: "0" * 64
    async_compile.AsyncCompile.triton = collect
    try:
        with inductor_config.patch(cpu_backend="triton", fx_graph_cache=False, force_disable_caches=True):
            yield
    finally:
        torch_triton.triton_hash_with_backend, async_compile.AsyncCompile.triton = saved


def count_kernels(model, phase: str) -> tuple[int, int]:
    """(Triton kernels, extern calls) inductor writes for ``phase`` of ``model``: "decode", "prefill", or
    "train" (forward with the loss and its backward, heads-only as kernel_count.py sets it up)."""
    import torch._functorch.config as functorch_config
    from torch._dynamo.utils import counters

    kernels = []
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 1000, (4, 1024), generator=torch.Generator().manual_seed(0))
    if phase == "train":
        model = copy.deepcopy(model)
        heads = n_sites(model) > 0
        if heads:
            set_trainable(model, "heads")  # (in fp32, as deltafy train holds them)
        else:  # every weight frozen; the input requires a gradient, so the backward runs through every layer
            model.train().requires_grad_(False)
        embeds = model.get_input_embeddings()(ids[:2, :256]).detach().requires_grad_(not heads)
        step = {"inputs_embeds": embeds, "labels": ids[:2, :256], "use_cache": False}
    else:
        step = decode_step(model) if phase == "decode" else {"input_ids": ids}
    compiled = torch.compile(model)
    # the backward is written with the forward, not at the first backward (which the unrun forward never reaches)
    backward = functorch_config.patch(force_non_lazy_backward_lowering=True)
    grad = torch.enable_grad() if phase == "train" else torch.no_grad()
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=phase == "train")
    with triton_codegen_only(kernels), backward, grad, autocast:
        try:
            compiled(**step)
        except Exception:  # the step runs the kernels it did not compile: expected, once code was written
            if not kernels:
                raise
    if breaks := counters["graph_break"]:
        raise SystemExit(f"{phase}: a graph break ({next(iter(breaks))}); counts would mislead")
    if counters["stats"]["unique_graphs"] != 1:
        raise SystemExit(f"{phase}: {counters['stats']['unique_graphs']} graphs (a graph break?); counts would mislead")
    # (a compile after the first in a process hands each kernel over twice: a kernel is its name in the graph)
    return len({name for name, _ in kernels}), counters["inductor"]["extern_calls"]


PHASES = {"decode": "decode step, batch 1", "prefill": "prefill 4x1024", "train": "train step 2x256, heads"}


def kernels_table(recipe: str, phases=tuple(PHASES), name: str = "smollm2") -> dict:
    """Prints and returns {phase: ((Triton kernels, extern calls) original, (...) converted)}."""
    original = two_layers(name)
    model = converted(original, recipe)
    sites = n_sites(model)
    shape = {"smollm2": "SmolLM2-135M", "gpt2": "GPT-2 124M"}[name]
    print(f"kernels inductor writes (Triton, for a GPU) · {shape} shape, 2 layers ({sites} sites), bf16, {recipe}")
    print(f"{'phase':<24}{'original':>16}{'converted':>16}")
    counts = {}
    for phase in phases:
        (k0, e0), (k1, e1) = counts[phase] = count_kernels(original, phase), count_kernels(model, phase)
        print(f"{PHASES[phase]:<24}{f'{k0} + {e0} extern':>16}{f'{k1} + {e1} extern':>16}")
    return counts


# -- host: what a compiled decode step costs to issue --------------------------------------------------------
def guard_tree(compiled_code, frame_locals: dict) -> tuple[int, float]:
    """(nodes, µs of one evaluation) of the guard tree of the cache entry that ``frame_locals`` passes."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    for entry in _debug_get_cache_entry_list(compiled_code):
        manager = entry.guard_manager
        if manager.check(frame_locals):
            start = time.perf_counter()
            for _ in range(200):
                manager.check(frame_locals)
            return len(str(manager).splitlines()), (time.perf_counter() - start) / 200 * 1e6
    raise SystemExit("no compiled entry of the decode step passes its own inputs' guards")


def frame_locals(model, step: dict) -> dict:
    """The locals the compiled frame (the causal LM's forward, as its decorators wrap it) starts with."""
    forward = type(model).forward
    bound = inspect.signature(forward, follow_wrapped=False).bind(model, **step)
    bound.apply_defaults()
    values = dict(bound.arguments)
    if forward.__closure__:
        cells = (cell.cell_contents for cell in forward.__closure__)
        values |= dict(zip(forward.__code__.co_freevars, cells, strict=True))
    return values


class _Slices:
    """Stands for a site's gate or target: its weight and bias sliced from the site's one parameter at each read."""

    def __init__(self, site, name: str):
        self.site, self.name = site, name

    weight = property(lambda self: self.site.slice(f"{self.name}.weight"))
    bias = property(lambda self: self.site.slice(f"{self.name}.bias"))


def one_parameter_a_site(model):
    """``model`` (converted, in place) with each site's gate, target and alpha packed into one Parameter that the
    forward slices: the same arithmetic with one graph input a site where there were five. Not a checkpoint
    format deltafy writes: it measures what such a format would save a compiled step's host."""
    from deltafy.modeling_deltafy import DeltaSite

    class PackedSite(DeltaSite):
        strength = property(lambda self: self.slice("strength") if "strength" in self.layout else None)

        def slice(self, name: str) -> torch.Tensor:
            start, shape = self.layout[name]
            return self.packed[start : start + math.prod(shape)].view(shape)

    for site in [module for module in model.modules() if type(module) is DeltaSite]:
        heads = {f"{m}.{p}": getattr(getattr(site, m), p) for m in ("gate", "target") for p in ("weight", "bias")}
        heads |= {"strength": site.strength} if site.strength is not None else {}
        offsets = itertools.accumulate((t.numel() for t in heads.values()), initial=0)
        layout = {name: (start, tuple(t.shape)) for (name, t), start in zip(heads.items(), offsets, strict=False)}
        packed = torch.nn.Parameter(torch.cat([t.detach().reshape(-1) for t in heads.values()]))
        del site._modules["gate"], site._modules["target"]
        site._parameters.pop("strength", None)
        site.__class__, site.packed, site.layout = PackedSite, packed, layout
        object.__setattr__(site, "gate", _Slices(site, "gate"))  # (not a module: nn.Module would register it)
        object.__setattr__(site, "target", _Slices(site, "target"))
    return model


def host_table(recipe: str, rounds: int, steps: int, layers: int = 30, packed: bool = False) -> None:
    torch._dynamo.reset()  # (a step of the kernels' part raised on purpose: its code would be skipped from then on)
    torch.set_num_threads(1)
    width = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    original = llama(num_hidden_layers=layers, **width)
    models = {"original": original, "converted": converted(original, recipe)}
    if packed:
        models["1 param/site"] = one_parameter_a_site(copy.deepcopy(models["converted"]))
        with torch.no_grad():
            same = [model(**decode_step(model)).logits for model in list(models.values())[1:]]
        if not torch.equal(*same):
            raise SystemExit("the heads packed into one parameter a site do not give the converted model's logits")
    sites = n_sites(models["converted"])
    runs, trees = {}, {}
    with torch.no_grad():
        for name, model in models.items():
            compiled, step = torch.compile(model), decode_step(model)
            for _ in range(3):  # the static and the dynamic-length entries compiled
                compiled(**step)
            runs[name] = (compiled, step, [])
            trees[name] = guard_tree(type(model).forward.__code__, frame_locals(model, step))
        for _ in range(rounds):
            for compiled, step, times in runs.values():
                start = time.perf_counter()
                for _ in range(steps):
                    compiled(**step)
                times.append((time.perf_counter() - start) / steps * 1e6)
    print(f"compiled decode step on the host · {layers} layers of width 64 ({sites} sites), fp32, {recipe}, 1 thread")
    names = list(models)
    extra = [f"extra a site{' (' + name + ')' if len(names) > 2 else ''}" for name in names[1:]]
    print(f"{'':<28}" + "".join(f"{name:>14}" for name in names) + "".join(f"{e:>28}" for e in extra))
    rows = {
        "µs a token (median)": ({n: statistics.median(runs[n][2]) for n in names}, "{:.0f}", "{:.1f}"),
        "guard tree, nodes": ({n: trees[n][0] for n in names}, "{}", "{:.1f}"),
        "guard tree, µs to evaluate": ({n: trees[n][1] for n in names}, "{:.0f}", "{:.2f}"),
    }
    for label, (values, cell, per_site) in rows.items():
        line = "".join(f"{cell.format(values[n]):>14}" for n in names)
        line += "".join(f"{per_site.format((values[n] - values['original']) / sites):>28}" for n in names[1:])
        print(f"{label:<28}{line}")
    spread = ", ".join(f"{name} {min(r[2]):.0f}–{max(r[2]):.0f}" for name, r in runs.items())
    print(f"({rounds} rounds of {steps} steps; range: {spread} µs)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("kernels", "host"), help="one part only")
    parser.add_argument("--recipe", default="ddl-scalar")
    parser.add_argument("--model", choices=("smollm2", "gpt2"), default="smollm2", help="of the kernels' part")
    parser.add_argument("--phases", default="decode,prefill,train", help="of the kernels' part: decode, prefill, train")
    parser.add_argument("--layers", type=int, default=30, help="layers of the host's model (SmolLM2 has 30)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40, help="decode steps a round (host)")
    parser.add_argument(
        "--packed", action="store_true", help="host: also the converted model with one parameter a site (see above)"
    )
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}")
    phases = tuple(args.phases.split(","))
    if unknown := set(phases) - set(PHASES):
        parser.error(f"--phases takes {', '.join(PHASES)}; got {', '.join(sorted(unknown))}")
    # two models share the forward's code object, whose compiled entries (3 a model) count against this limit
    with torch._dynamo.config.patch(recompile_limit=64):
        if args.only != "host":
            kernels_table(args.recipe, phases, args.model)
        if args.only != "kernels":
            host_table(args.recipe, args.rounds, args.steps, args.layers, args.packed)


if __name__ == "__main__":
    sys.exit(main())
