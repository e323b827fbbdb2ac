"""Converted vs original forward speed, measured interleaved in one process.

    python benchmarks/speed.py                       # SmolLM2-135M and random GPT-2 124M, fp32 CPU
    python benchmarks/speed.py --models gpt2 --rounds 9 --recipe ddl-learned

Prefill: batch 4 x 256 tokens, one forward. Decode: batch 1, 32-token prompt, greedy generation
of 64 tokens with the KV cache. Each round times the original and the converted model back to
back (alternating which goes first), so machine noise hits both alike. "ratio" compares the best
round of each (tokens/s), "median" is the median of the per-round ratios (targets: prefill >= 0.95,
decode >= 0.93).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import deltafy
from deltafy.sources import load_source


def load(name: str, dtype: torch.dtype):
    if name == "smollm2":
        return load_source("smollm2-135m", "float32").model.to(dtype)
    if name == "gpt2":
        from transformers import AutoModelForCausalLM, GPT2Config

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(GPT2Config()).to(dtype).eval()
    raise SystemExit(f"unknown model {name!r}; use smollm2 or gpt2")


@torch.inference_mode()
def prefill(model, ids) -> float:
    start = time.perf_counter()
    model(input_ids=ids, use_cache=False)
    return ids.numel() / (time.perf_counter() - start)


@torch.inference_mode()
def decode(model, prompt, new_tokens: int) -> float:
    start = time.perf_counter()
    model.generate(
        input_ids=prompt,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=0,
    )
    return new_tokens / (time.perf_counter() - start)


def interleaved(fn, original, converted, rounds: int) -> tuple[float, float, float, float]:
    """Best and median tokens/s over rounds of back-to-back timings.

    Returns (original best, converted best, ratio of bests, median of per-round ratios). The best
    of several runs is the least noisy estimate of what the code costs on a shared machine.
    """
    fn(original), fn(converted)  # warm-up
    ratios, orig, conv = [], [], []
    for r in range(rounds):
        pair = (original, converted) if r % 2 == 0 else (converted, original)
        speeds = {id(m): fn(m) for m in pair}
        orig.append(speeds[id(original)])
        conv.append(speeds[id(converted)])
        ratios.append(conv[-1] / orig[-1])
    return max(orig), max(conv), max(conv) / max(orig), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gpt2")
    parser.add_argument("--recipe", default="ddl-scalar")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, recipe {args.recipe}")
    print(f"{'model':10s} {'phase':8s} {'original tok/s':>15s} {'converted tok/s':>16s} {'ratio':>7s} {'median':>7s}")
    for name in args.models.split(","):
        original = load(name, dtype)
        converted = deltafy.convert(copy.deepcopy(original), args.recipe).eval()
        vocab = original.get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (4, 256), generator=gen)
        prompt = torch.randint(0, vocab, (1, 32), generator=gen)
        rows = [
            ("prefill", interleaved(lambda m, ids=ids: prefill(m, ids), original, converted, args.rounds)),
            (
                "decode",
                interleaved(lambda m, p=prompt: decode(m, p, args.new_tokens), original, converted, args.rounds),
            ),
        ]
        for phase, (o, c, ratio, median) in rows:
            print(f"{name:10s} {phase:8s} {o:15.1f} {c:16.1f} {ratio:7.3f} {median:7.3f}", flush=True)
        del original, converted


if __name__ == "__main__":
    main()
