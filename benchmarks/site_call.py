"""What one DDL site costs the host at decode: microseconds per call, formula vs fused, beside the modules
of the original layer it sits in.

    python benchmarks/site_call.py                       # CPU, fp32: the formula, a norm, a residual add
    python benchmarks/site_call.py --device cuda         # bf16: the fused path too
    python benchmarks/site_call.py --width 2048 --calls 2000
    python benchmarks/site_call.py --device cuda --decode   # and per site in a decode step, split up
    python benchmarks/site_call.py --device cuda --decode --profile fused   # and where its host time goes

A batch-1 decode step is host-bound on a GPU: every module call and kernel launch costs the CPU a few
microseconds while the GPU waits. kernel_count.py counts launches; this times what issuing them costs.
One site of the ddl-scalar recipe (strength gate, sublayer direction, gates open) at shape (1, 1, width),
called --calls times in a row with no autograd; "issue" is the host's time per call until the last call
returned, "total" until the device finished too (their difference is how far the GPU trailed). Yardsticks
from the original model's own layer: a LlamaRMSNorm call (one module, a few kernels) and the residual
add (one kernel). Rows alternate round by round; the median of --rounds rounds is printed. A row ending in
"cold" times the same call with the host's caches flushed before each one (64 MB of host memory written,
--calls / 10 calls): inside a model a site runs after the rest of its layer has evicted the data (and code) its
ops touch, and on CPU it costs about what its cold row says, two to three times its warm one.

--decode also times batch-1 decoding (KV cache, a synchronize after each token) of a random Llama of
this width (--layers, two sites a layer) and splits what the conversion adds per site and token: the
capture and write around the two modules each site hooks alone (every site's write returns h), the
formula, the fused path, and the fused path's call without its launch (its checks, plan and contiguity,
then h returned: what is left of the fused row is the launch). --profile VARIANT then runs cProfile over
--tokens decode tokens of that variant and prints the functions that took the most time of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import pstats
import statistics
import time

import torch
from benchmark_models import cache_kwarg, one_site, open_gates  # (benchmarks/ is on the path of a script run from it)
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import deltafy
import deltafy.fused
from deltafy.modeling_deltafy import DeltaSite


def site(width: int, device: str, dtype: torch.dtype) -> DeltaSite:
    module = one_site(width).to(device=device, dtype=dtype)
    open_gates(module)  # the work a trained site does
    return module


def timed(fn, calls: int, sync) -> tuple[float, float]:
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    sync()
    done = time.perf_counter()
    return (issued - start) / calls * 1e6, (done - start) / calls * 1e6


def timed_cold(fn, calls: int, sync, flush) -> tuple[float, float]:
    """As timed, with the host's caches flushed before each call and only the calls timed: inside a model a site
    runs after the rest of its layer has evicted what its ops touch, which a loop of calls keeps warm."""
    issue = total = 0.0
    for _ in range(calls):
        flush()
        sync()
        start = time.perf_counter()
        fn()
        issued = time.perf_counter()
        sync()
        issue, total = issue + issued - start, total + time.perf_counter() - start
    return issue / calls * 1e6, total / calls * 1e6


def _returns_h(site, x, c, h):
    return h


@contextlib.contextmanager
def _launch_skipped():
    """deltafy.fused.kernel.write as it is, but its launch returns h (a timing variant: the output is wrong)."""
    from deltafy.fused import kernel

    launch = kernel._forward
    kernel._forward = lambda x, c, h, *rest: h
    try:
        yield
    finally:
        kernel._forward = launch


COLD_BYTES = 64 * 2**20
VARIANTS = ("original", "capture and write alone", "formula", "fused", "fused, no launch")


def decode_costs(args, device: str, dtype: torch.dtype, sync) -> tuple[dict[str, float], int]:
    """Median µs per decoded token of each variant, and the number of sites."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    heads = max(1, args.width // 64)
    config = LlamaConfig(
        hidden_size=args.width,
        intermediate_size=2 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        vocab_size=256,
    )
    torch.manual_seed(0)
    with torch.device(device):
        original = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    variants = {"original": original}
    for name in VARIANTS[1:]:
        if name.startswith("fused") and not deltafy.fused.supported(device):
            continue
        model = deltafy.convert(copy.deepcopy(original), "ddl-scalar").eval()
        deltafy.fused.disable(model)  # (convert turns the fused path on where CUDA and triton are)
        open_gates(model)
        if name == "capture and write alone":
            for module in model.modules():
                if isinstance(module, DeltaSite):
                    module.fused = _returns_h
        elif name.startswith("fused"):
            deltafy.fused.enable(model)
        variants[name] = model
    prompt = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1)).to(device)
    kwarg = cache_kwarg(original)

    def decode(name: str, profiler: cProfile.Profile | None = None) -> list[float]:
        model, cache = variants[name], DynamicCache(config=config)
        with _launch_skipped() if name == "fused, no launch" else contextlib.nullcontext():
            token = model(input_ids=prompt, **{kwarg: cache}).logits[:, -1:].argmax(-1)
            steps = []
            for _ in range(args.tokens):
                sync()
                start = time.perf_counter()
                with profiler or contextlib.nullcontext():
                    token = model(input_ids=token, **{kwarg: cache}).logits[:, -1:].argmax(-1)
                    sync()
                steps.append(time.perf_counter() - start)
        return steps

    times: dict[str, list[float]] = {name: [] for name in variants}
    with torch.inference_mode():
        for r in range(args.rounds + 1):  # round 0 warms up
            names = list(variants)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                steps = decode(name)
                if r:
                    times[name].append(statistics.median(steps) * 1e6)
        if args.profile:
            if args.profile not in variants:
                raise SystemExit(f"--profile {args.profile!r}: this run has the variants {', '.join(variants)}")
            profiler = cProfile.Profile()
            decode(args.profile, profiler)
            what = f"{args.tokens} decode tokens, {args.profile}"
            print(f"\nprofile of {what} (cProfile: its overhead inflates each call)")
            pstats.Stats(profiler).strip_dirs().sort_stats("tottime").print_stats(args.profile_top)
    return {name: statistics.median(t) for name, t in times.items()}, 2 * args.layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--width", type=int, default=576, help="hidden size (SmolLM2-135M: 576)")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--decode", action="store_true", help="also split a decode step's cost per site")
    parser.add_argument("--layers", type=int, default=30, help="--decode: the model's layers (SmolLM2: 30)")
    parser.add_argument("--tokens", type=int, default=16, help="--decode: tokens decoded a round")
    parser.add_argument("--profile", choices=VARIANTS, help="--decode: cProfile this variant's decode tokens")
    parser.add_argument("--profile-top", type=int, default=25, help="--profile: the functions printed")
    args = parser.parse_args()
    if args.profile and not args.decode:
        parser.error("--profile needs --decode")
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x, c, h = (torch.randn(1, 1, args.width, device=device, dtype=dtype) for _ in range(3))
    formula = site(args.width, device, dtype)
    rows = {"site, formula": lambda: formula(x, c, h)}
    if deltafy.fused.supported(device):
        fused = site(args.width, device, dtype)
        deltafy.fused.enable(fused)
        rows["site, fused"] = lambda: fused(x, c, h)
    norm = LlamaRMSNorm(args.width).to(device=device, dtype=dtype)
    rows["RMSNorm (yardstick)"] = lambda: norm(x)
    for name in list(rows):
        rows[f"{name}, cold"] = rows[name]
    rows["residual add (yardstick)"] = lambda: x + h
    identity = nn.Identity()
    rows["empty module call"] = lambda: identity(x)
    scratch = torch.empty(COLD_BYTES // 4)  # host memory: writing it evicts the host's caches
    flush = lambda: scratch.fill_(1.0)  # noqa: E731
    results: dict[str, list] = {name: [] for name in rows}
    with torch.inference_mode():
        for fn in rows.values():  # warm-up: triton compiles its kernel on the first call
            timed(fn, 20, sync)
        for r in range(args.rounds):
            names = list(rows)
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if name.endswith(", cold"):
                    results[name].append(timed_cold(rows[name], max(1, args.calls // 10), sync, flush))
                else:
                    results[name].append(timed(rows[name], args.calls, sync))
    gpu = f", {torch.cuda.get_device_name()}" if device == "cuda" else ""
    print(f"torch {torch.__version__}{gpu}; {device} {str(dtype).removeprefix('torch.')}, shape (1, 1, {args.width})")
    print(f"{'call':26s} {'issue us':>9s} {'total us':>9s}")
    for name, values in results.items():
        issue = statistics.median(v[0] for v in values)
        total = statistics.median(v[1] for v in values)
        print(f"{name:26s} {issue:9.1f} {total:9.1f}")
    if "site, fused" not in rows:
        print("  site, fused: deltafy.fused.supported() is False here (CUDA with triton runs it)")
    if args.decode:
        per_token, sites = decode_costs(args, device, dtype, sync)
        base = per_token["original"]
        print(f"\ndecode, batch 1: a {args.layers}-layer Llama of width {args.width}, {sites} sites")
        print(f"{'model':26s} {'us/token':>9s} {'+us/site':>9s}")
        for name, us in per_token.items():
            print(f"{name:26s} {us:9.0f} {(us - base) / sites:9.1f}")


if __name__ == "__main__":
    main()
