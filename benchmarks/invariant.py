"""The conversion invariant on the two reference models, as figures.

    python benchmarks/invariant.py                 # both recipes on SmolLM2-135M and random GPT-2 124M
    python benchmarks/invariant.py --dtype bfloat16  # the same, converted and checked in bf16

For each model and recipe: max |Δlogits| between original and converted at the default init
(four prompts, against the original in the same dtype, with the tolerance the self-check applies
in that dtype), whether beta = 0 is bitwise identical, and whether 32 greedy tokens with the KV
cache are the same.
"""

from __future__ import annotations

import argparse
import copy

import torch

import deltafy
from deltafy.conversion.verify import make_inputs, record_reference, self_check
from deltafy.sources.load import load_source


def models(dtype: str):
    source = load_source("smollm2-135m", dtype)
    yield "SmolLM2-135M", source.model, source.tokenizer
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    yield "GPT-2 124M (random)", AutoModelForCausalLM.from_config(GPT2Config()).to(getattr(torch, dtype)).eval(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default="ddl-scalar,ddl-learned")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    print(
        f"{'model':22s} {'recipe':12s} {'max |Δlogits|':>14s} {'tolerance':>10s} {'β=0 bitwise':>12s} "
        f"{'greedy 32':>10s}"
    )
    for name, model, tokenizer in models(args.dtype):
        reference = record_reference(model, *make_inputs(model, tokenizer), new_tokens=32)
        for recipe in args.recipes.split(","):
            converted = deltafy.convert(copy.deepcopy(model), recipe)
            report = self_check(converted, reference)
            print(
                f"{name:22s} {recipe:12s} {report.max_abs_dlogits:14.2e} {report.tolerance:10.3g} "
                f"{str(report.beta_zero_bitwise):>12s} "
                f"{'same' if report.greedy_identical else 'DIFF':>10s}",
                flush=True,
            )
            del converted


if __name__ == "__main__":
    main()
