"""Heads-only training vs full fine-tuning: seconds per optimizer step, measured interleaved.

    python benchmarks/step_time.py                  # random GPT-2 124M, batch 4 x 256, fp32 CPU

Both runs use the same converted model, data and AdamW; "heads" trains only the DDL heads
(gate group at the recipe's scale), "full" trains every parameter. Steps alternate between the
two so machine noise hits both alike. Target: heads/full <= 0.70.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import deltafy


def make_step(model, groups):
    for p in model.parameters():
        p.requires_grad_(False)
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in groups])

    def step(batch) -> float:
        start = time.perf_counter()
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    base = deltafy.convert(AutoModelForCausalLM.from_config(GPT2Config()))
    heads_model, full_model = base.train(), copy.deepcopy(base).train()
    heads = make_step(heads_model, deltafy.head_parameter_groups(heads_model))
    full = make_step(full_model, [{"params": list(full_model.parameters()), "lr": 1e-4}])
    batch = torch.randint(0, 50257, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    heads(batch), full(batch)  # warm-up
    t_heads, t_full = [], []
    for _ in range(args.steps):
        t_heads.append(heads(batch))
        t_full.append(full(batch))
    h, f = statistics.median(t_heads), statistics.median(t_full)
    n_heads = sum(p.numel() for p in heads_model.parameters() if p.requires_grad)
    print(f"GPT-2 124M, batch {args.batch}x{args.seq_len}, {torch.get_num_threads()} threads, fp32")
    print(f"heads-only: {h:.2f} s/step ({n_heads:,} trainable)   full: {f:.2f} s/step   ratio {h / f:.2f}")


if __name__ == "__main__":
    main()
