"""The fused site's Triton kernels built for the GPUs users have, on a machine without one: the registers
and spills of each built kernel per model width, and whether every variant compiles.

    python benchmarks/kernel_build.py                  # sm_90 (H100, H200), bf16: a row per model width
    python benchmarks/kernel_build.py --arch 80        # sm_80 (A100)
    python benchmarks/kernel_build.py --every-variant  # and every dtype, direction, gate and channel count

Triton's interpreter (TRITON_INTERPRET=1, how the tests run the kernels on CPU) checks what a kernel
computes, not that it compiles: it runs the kernel as Python, so code the compiler refuses (a loop
variable whose type changes) passes there and fails on the first GPU launch. triton.compile builds for
a named GPU without one, down to the cubin, with the ptxas that Triton ships. The kernels are built with
the Plan (block, warps, constants) that kernel.plan gives a real site, and with the pointer and integer
types of a real launch (kernel.write's). A kernel keeps a whole row of each vector it works on in
registers: past what a thread may hold (a block's threads share 65,536 registers), ptxas spills to local
memory, which the GPU caches but which costs time; how much is a number for a GPU run to judge.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns while the default is unset; 1 is it
os.environ["TRITON_INTERPRET"] = "0"  # (under the interpreter a kernel is Python, with nothing to compile)
import triton  # noqa: E402
from benchmark_models import one_site  # noqa: E402  (benchmarks/ is on a script's path)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deltafy.fused import kernel  # noqa: E402

# hidden sizes of the models people use: SmolLM2-135M, GPT-2, Llama-3.2-1B and 3B, Llama 7-8B, 13B and 70B
WIDTHS = {"smollm2-135m": 576, "gpt2": 768, "llama-1b": 2048, "llama-3b": 3072, "7b": 4096, "13b": 5120, "70b": 8192}
WIDTHS["widest"] = kernel.MAX_WIDTH  # the widest stream the kernels take (wider ones run the formula)
# shared memory a block may use: A100 (sm_80), H100 and H200 (sm_90)
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_KERNELS = {"forward": kernel._forward_kernel, "backward": kernel._backward_kernel}
_HEADS = ("wg_ptr", "bg_ptr", "wt_ptr", "bt_ptr", "alpha_ptr")  # the head parameters, in their own dtype
_FP32 = ("unit_ptr", "dgu_ptr")  # the backward's per-row outputs, fp32 always


def site_plan(width: int, channels: int, learned: bool, strength: bool) -> kernel.Plan:
    """kernel.plan of a real DeltaSite of this kind (built on the meta device: no memory)."""
    direction, gate = "learned" if learned else "sublayer", "strength" if strength else "logit"
    with torch.device("meta"):
        return kernel.plan(one_site(width, direction, gate, channels))


def signature(fn, plan: kernel.Plan, dtype: torch.dtype, params: torch.dtype, strength: bool):
    """The types kernel.write's launch gives ``fn``'s arguments, the values it fixes, and the alignment
    Triton's launcher would see: tensors from torch (16-byte aligned), integers by value."""
    rows = 1  # a decode step's one row: s_j = rows * d
    ints = {"s_j": rows * plan.d, "d": plan.d}
    types, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in _FP32 or (plan.learned and name in ("kr_ptr", "dkr_ptr")):  # a learned kr: fp32 matmul
                kind = torch.float32
            elif name in _HEADS:
                kind = params  # (without a strength the launch passes wg in alpha's place)
            else:  # x, c, h, out and their gradients; the sublayer direction's kr is h itself
                kind = dtype
            types[name], attrs[(i,)] = f"*{_NAMES[kind]}", [["tt.divisibility", 16]]
        elif name in ints:
            types[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            types[name] = "fp32"
    constants = {"CHANNELS": plan.channels, "LEARNED": plan.learned, "STRENGTH": strength, "BLOCK": plan.block}
    return types, constants, attrs


def build(which: str, arch: int, plan: kernel.Plan, dtype: torch.dtype, params: torch.dtype, strength: bool):
    """The kernel compiled for sm_``arch`` down to its cubin; raises where Triton or ptxas refuses it."""
    fn = _KERNELS[which]
    types, constants, attrs = signature(fn, plan, dtype, params, strength)
    source = ASTSource(fn=fn, signature=types, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": plan.num_warps})


def registers(compiled, arch: int) -> tuple[int, int]:
    """(registers a thread, bytes of stack a thread) of the cubin Triton built, as cuobjdump (shipped beside
    Triton's ptxas) reads them: these kernels keep no arrays, so their stack is what ptxas spilled. (ptxas run
    again on the PTX, without Triton's options, allocated registers differently.)"""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = Path(get_ptxas(arch).path).with_name("cuobjdump")
        report = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report.stdout)
    if usage is None:
        raise RuntimeError(f"cuobjdump did not report registers and stack: {report.stdout.strip()[:200]}")
    return int(usage.group(1)), int(usage.group(2))


def variants(every: bool):
    """(dtype, heads' dtype, channels, learned, strength): the ddl-scalar recipe's site in bf16, or every kind
    (the heads stored in the model's dtype, or held in fp32 while they train)."""
    if not every:
        return [(torch.bfloat16, torch.bfloat16, 1, False, True)]
    kinds = itertools.product((1, 4), (False, True), (False, True))
    heads = [(dtype, params) for dtype in _NAMES for params in dict.fromkeys((dtype, torch.float32))]
    return [(dtype, params, *kind) for (dtype, params), kind in itertools.product(heads, list(kinds))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_LIMIT), help="sm_80 or sm_90")
    parser.add_argument("--every-variant", action="store_true", help="every dtype, direction, gate, channels")
    parser.add_argument("--widths", default=",".join(WIDTHS), help=f"comma-separated, of {', '.join(WIDTHS)}")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", module="triton")
    print(f"sm_{args.arch}, triton {triton.__version__}: registers a thread / bytes of stack (spills) a thread")
    print(f"{'model':>14} {'width':>6} {'block':>6} {'warps':>5} {'kind':<34} {'forward':>11} {'backward':>11}")
    for model in args.widths.split(","):
        width = WIDTHS[model]
        for dtype, params, channels, learned, strength in variants(args.every_variant):
            plan = site_plan(width, channels, learned, strength)
            cells = []
            for which in _KERNELS:
                compiled = build(which, args.arch, plan, dtype, params, strength)
                if compiled.metadata.shared > SHARED_LIMIT[args.arch]:
                    sys.exit(f"{which} at {model} uses {compiled.metadata.shared} bytes of shared memory")
                cells.append("{} / {}".format(*registers(compiled, args.arch)))
            kind = (
                f"{_NAMES[dtype]} (heads {_NAMES[params]}), {'learned' if learned else 'sublayer'}, "
                f"{'strength' if strength else 'logit'}{f', {channels} ch' if channels > 1 else ''}"
            )
            row = f"{model:>14} {width:>6} {plan.block:>6} {plan.num_warps:>5} {kind:<34}"
            print(f"{row} {cells[0]:>11} {cells[1]:>11}")


if __name__ == "__main__":
    main()
