"""Converted vs original forward speed, measured side by side in one process.

    python benchmarks/speed.py                       # SmolLM2-135M and random GPT-2 124M, fp32 CPU
    python benchmarks/speed.py --models gpt2 --rounds 9 --recipe ddl-learned
    python benchmarks/speed.py --open-gates          # heads as after training, not at init
    python benchmarks/speed.py --decode-batch 4      # decode four sequences at once
    python benchmarks/speed.py --via transformers    # the converted model saved, then loaded with plain
                                                     # transformers (the checkpoint's own code runs)

Prefill: batch 4 x 256 tokens, one forward per model per round, alternating which goes first.
Decode: batch 1 (--decode-batch), greedy with the KV cache, the two models in lockstep one
token at a time (alternating which goes first), so that the drift of a shared machine hits both
alike; this times the model's decode step itself, without generate()'s bookkeeping, which would
only dilute the difference. Both models are deep copies of one loaded model, so neither gets a
luckier memory layout. With --via transformers both are saved and loaded back with
AutoModelForCausalLM.from_pretrained (the converted one with trust_remote_code=True): transformers
maps a checkpoint's weights from the file, and matmuls over mapped weights run a few percent slower
than over a deep copy's, so loading only one of them that way would time the memory, not the code.
"ratio" is converted/original
tokens/s over all rounds (or tokens), "median" the median of the per-round (per-token) ratios and
"quartiles" their middle half, which shows how much a shared machine's noise moved them.
Targets: prefill >= 0.95, decode >= 0.90.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
from benchmark_models import cache_kwarg, load, open_gates  # (benchmarks/ is on a script's path)
from transformers import DynamicCache

import deltafy


def pair(loaded, recipe: str, via: str, workdir: str) -> dict:
    """The original and the converted model, both in memory or both as plain transformers loads them."""
    models = {"original": copy.deepcopy(loaded), "converted": deltafy.convert(copy.deepcopy(loaded), recipe)}
    if via == "transformers":
        from transformers import AutoModelForCausalLM

        dtype = next(loaded.parameters()).dtype
        models["original"].save_pretrained(f"{workdir}/original")
        deltafy.save(models["converted"], f"{workdir}/converted")
        models = {
            "original": AutoModelForCausalLM.from_pretrained(f"{workdir}/original", dtype=dtype),
            "converted": AutoModelForCausalLM.from_pretrained(
                f"{workdir}/converted", trust_remote_code=True, dtype=dtype
            ),
        }
        assert type(models["converted"]).__module__.startswith("transformers_modules"), "not the checkpoint's code"
    return {name: model.eval() for name, model in models.items()}


@torch.inference_mode()
def prefill(models: dict, ids: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds per forward, per model, over ``rounds`` alternating rounds (after one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(rounds + 1):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            models[name](input_ids=ids, use_cache=False)
            if r:
                times[name].append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def decode(models: dict, prompt: torch.Tensor, new_tokens: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per decoded token, per model, the models stepping in lockstep."""
    times: dict[str, list[float]] = {name: [] for name in models}
    names = list(models)
    for r in range(rounds + 1):
        caches = {name: {cache_kwarg(model): DynamicCache(config=model.config)} for name, model in models.items()}
        tokens = {
            name: model(input_ids=prompt, **caches[name], use_cache=True).logits[:, -1:].argmax(-1)
            for name, model in models.items()
        }
        for i in range(new_tokens):
            for name in names if i % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                logits = models[name](input_ids=tokens[name], **caches[name], use_cache=True).logits
                elapsed = time.perf_counter() - start
                tokens[name] = logits[:, -1:].argmax(-1)
                if r:  # round 0 warms up
                    times[name].append(elapsed)
    return times


def summarize(times: dict[str, list[float]], tokens_per_step: int) -> tuple[float, float, float, float, str]:
    """(original tok/s, converted tok/s, ratio of those, median and quartiles of the per-step ratios)."""
    orig, conv = times["original"], times["converted"]
    orig_speed, conv_speed = tokens_per_step * len(orig) / sum(orig), tokens_per_step * len(conv) / sum(conv)
    ratios = [o / c for o, c in zip(orig, conv, strict=True)]
    if len(ratios) < 2:  # (one prefill round: no spread to show)
        return orig_speed, conv_speed, conv_speed / orig_speed, ratios[0], "-"
    low, median, high = statistics.quantiles(ratios, n=4)
    return orig_speed, conv_speed, conv_speed / orig_speed, median, f"{low:.3f}-{high:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gpt2")
    parser.add_argument("--recipe", default="ddl-scalar")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--decode-batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--open-gates", action="store_true", help="time heads as after training")
    parser.add_argument(
        "--via", default="memory", choices=["memory", "transformers"], help="how the converted model is loaded"
    )
    args = parser.parse_args()
    for flag in ("rounds", "new_tokens", "decode_batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    dtype = getattr(torch, args.dtype)
    gates = "open gates" if args.open_gates else "gates at init"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {args.recipe}, {gates}, "
        f"via {args.via}"
    )
    print(
        f"{'model':10s} {'phase':8s} {'original tok/s':>15s} {'converted tok/s':>16s} {'ratio':>7s} {'median':>7s}"
        f" {'quartiles':>12s}"
    )
    for name in args.models.split(","):
        loaded = load(name, dtype)
        workdir = tempfile.TemporaryDirectory()
        models = pair(loaded, args.recipe, args.via, workdir.name)
        del loaded
        if args.open_gates:
            open_gates(models["converted"])
        vocab = models["original"].get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (4, 256), generator=gen)
        prompt = torch.randint(0, vocab, (args.decode_batch, 32), generator=gen)
        rows = [
            ("prefill", summarize(prefill(models, ids, args.rounds), ids.numel())),
            ("decode", summarize(decode(models, prompt, args.new_tokens, args.rounds), args.decode_batch)),
        ]
        for phase, (o, c, ratio, median, quartiles) in rows:
            print(f"{name:10s} {phase:8s} {o:15.1f} {c:16.1f} {ratio:7.3f} {median:7.3f} {quartiles:>12s}", flush=True)
        del models
        workdir.cleanup()


if __name__ == "__main__":
    main()
