"""vLLM offline batch generation, a deltafy checkpoint against its stock model, side by side in one
process: tokens/s of each and their ratio (target: converted >= 0.90x stock). Run with the Python of an
environment that has vLLM and deltafy (its plugin), e.g. vLLM's CPU build (docs/serving.md):

    python benchmarks/vllm_speed.py CONVERTED_DIR STOCK_DIR [--prompts 16] [--tokens 64] [--rounds 5]

Both engines stay up; rounds alternate between them so that drifts in the machine's speed hit both alike.
The median round of each is reported."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("converted")
    parser.add_argument("stock")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile (vLLM's default compiles)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engines = {
        name: LLM(
            model=folder,
            dtype=args.dtype,
            max_model_len=256,
            skip_tokenizer_init=True,
            seed=0,
            gpu_memory_utilization=0.4,
            enforce_eager=args.enforce_eager,
        )
        for name, folder in (("stock", args.stock), ("converted", args.converted))
    }
    prompts = [TokensPrompt(prompt_token_ids=[1 + (7 * i + j) % 500 for j in range(32)]) for i in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    for llm in engines.values():  # warm-up
        llm.generate(prompts[:2], params, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
    stock, converted = (statistics.median(rates[name]) for name in ("stock", "converted"))
    print(
        json.dumps(
            {
                "stock_tok_s": round(stock, 1),
                "converted_tok_s": round(converted, 1),
                "ratio": round(converted / stock, 3),
                "rounds": rates,
            }
        )
    )


if __name__ == "__main__":
    main()
