"""One DDL site's training step on its own, formula vs fused, at the widths of the models people train:
a forward and a backward over a step's tokens, as `deltafy train` runs a site of a bf16 model.

    python benchmarks/site_step.py --device cuda                  # widths 576 to 16384, 8x1024 tokens
    python benchmarks/site_step.py --device cuda --direction learned --channels 4
    TRITON_INTERPRET=1 python benchmarks/site_step.py --tokens 8 --widths 64,576   # on CPU (what a test runs)

A site of the chosen kind (by default the ddl-scalar recipe's: sublayer direction, strength gate) with
opened gates, its heads held in fp32 on inputs x, c and h in bf16 (--dtype), all three needing gradients
(the stream carries the gradient to every earlier layer's heads), under autocast as `deltafy train` runs a
bf16 model. A row times the site's forward and backward (`backward` of a fixed random output gradient),
the median of --reps after a warm-up, with a synchronize around each: the formula (DeltaSite.formula)
and the fused path (deltafy.fused: one Triton kernel forward, one backward, then a matmul and a sum for the
heads' gradients). The fused kernels keep a row of each vector in registers; benchmarks/kernel_build.py
shows where ptxas spills them (from a 13B's width on, before 2026-12-06): this shows what that costs
against the formula. Each row also prints the largest difference of the fused output and input
gradients, and (the largest) of its heads' gradients, from the formula's, relative to the largest value.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
from benchmark_models import one_site, open_gates  # (benchmarks/ is on the path of a script run from it)

import deltafy.fused
from deltafy.modeling_deltafy import DeltaSite

WIDTHS = "576,2048,4096,5120,8192,16384"  # SmolLM2, Llama-3.2-1B, 7-8B, 13B, 70B, the widest the kernels take


def make_site(width: int, direction: str, channels: int, device: str) -> DeltaSite:
    site = one_site(width, direction, channels=channels).to(device)  # the heads in fp32, as a run holds them
    open_gates(site)  # the work a trained site does
    return site


def step_inputs(width: int, tokens: int, channels: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(width)
    shape = (tokens, width)

    def leaf(*size):
        return torch.randn(size, generator=gen).to(device, dtype).requires_grad_()

    x = leaf(channels, *shape) if channels > 1 else leaf(*shape)
    return x, leaf(*shape), leaf(*shape), torch.randn(x.shape, generator=gen).to(device, dtype)


def run_step(site: DeltaSite, inputs, device: str, dtype: torch.dtype):
    x, c, h, grad = inputs
    for tensor in (x, c, h, *site.parameters()):
        tensor.grad = None
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        out = site(x, c, h)
    out.backward(grad)
    return out


def timed(fn, reps: int, sync) -> float:
    fn()  # warm-up: triton compiles its kernels on the first call
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def results(out: torch.Tensor, site: DeltaSite, inputs) -> list[torch.Tensor]:
    """The step's output, its inputs' gradients (x, c, h) and each head parameter's gradient."""
    return [out.detach(), *(t.grad.clone() for t in inputs[:3]), *(p.grad.clone() for p in site.parameters())]


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--widths", default=WIDTHS, help="comma-separated hidden sizes")
    parser.add_argument("--tokens", type=int, default=8 * 1024, help="rows a step: batch x sequence")
    parser.add_argument("--direction", default="sublayer", choices=["sublayer", "learned"])
    parser.add_argument("--channels", type=int, default=1, help="the expanded state's d_v (1: the scalar DDL)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), args.device
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fused = deltafy.fused.supported(device)
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{where}, {args.dtype}, {args.tokens} tokens, {args.direction} direction, {args.channels} channel(s)")
    if not fused:
        print("fused: deltafy.fused.supported() is False here (CUDA with triton, or TRITON_INTERPRET=1 on CPU)")
    print(f"{'width':>6} {'formula ms':>11} {'fused ms':>9} {'ratio':>6} {'max rel. gap out, dx, dc, dh, heads':>40}")
    for width in map(int, args.widths.split(",")):
        print(row(width, args, dtype, fused, sync))
        if device == "cuda":
            torch.cuda.empty_cache()


def row(width: int, args, dtype: torch.dtype, fused: bool, sync) -> str:
    """One width's row: the formula's and the fused path's step in ms, their ratio and the fused path's gaps."""
    site = make_site(width, args.direction, args.channels, args.device)
    inputs = step_inputs(width, args.tokens, args.channels, args.device, dtype)
    step = functools.partial(run_step, site, inputs, args.device, dtype)
    formula = timed(step, args.reps, sync)
    if not fused:
        return f"{width:>6} {formula:>11.3f}"
    reference = results(step(), site, inputs)
    deltafy.fused.enable(site, force=True)
    took = timed(step, args.reps, sync)
    got = results(step(), site, inputs)
    deltafy.fused.disable(site)
    gaps = [relative_gap(a, b) for a, b in zip(got, reference, strict=True)]
    gaps = ", ".join(f"{gap:.1e}" for gap in (*gaps[:4], max(gaps[4:])))
    return f"{width:>6} {formula:>11.3f} {took:>9.3f} {took / formula:>6.2f} {gaps:>40}"


if __name__ == "__main__":
    main()
