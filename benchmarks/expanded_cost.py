"""What the expanded state costs next to the scalar recipe and the original, measured in one process.

    python benchmarks/expanded_cost.py                      # SmolLM2-135M, batch 4 x 128, fp32 CPU
    python benchmarks/expanded_cost.py --channels 2 --rounds 5

For the original model, ddl-scalar and ddl-expanded (d_v = --channels) this prints:
- activation memory a heads-only training step keeps for its backward pass, per token: the bytes of
  every distinct tensor autograd saves during the forward (counted through saved_tensors_hooks, so
  it is what the step holds at its peak, not an estimate), and the same for a forward with no grad
  of the stream alone (the layer boundary: d_v x d values);
- prefill forward time and heads-only training-step time, as ratios to the original's, the models
  run in turn within each round so that a shared machine's drift hits all alike.
The original's step takes the gradient of its input embeddings (no parameter trains), so that its
backward pass runs through every layer as the heads' does: what any tuning of the frozen model
through all its layers costs, less the adapter.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import deltafy
from deltafy.modeling_deltafy import DeltaSpec
from deltafy.sources.load import load_source


def loss_of(model, batch, converted: bool):
    if converted:
        return model(input_ids=batch, labels=batch).loss
    embeds = model.get_input_embeddings()(batch).detach().requires_grad_(True)
    return model(inputs_embeds=embeds, labels=batch).loss


def saved_bytes(model, batch, converted: bool) -> int:
    """Bytes of the distinct storages autograd saves in one training forward of ``model``."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, batch, converted)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def trainable(model, converted: bool):
    for p in model.parameters():
        p.requires_grad_(False)
    if not converted:
        return None
    params = [p for g in deltafy.head_parameter_groups(model) for p in g["params"]]
    for p in params:
        p.requires_grad_(True)
    return torch.optim.AdamW(params, lr=1e-4)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    stock = load_source(args.model, "float32").model
    stock.eval()
    expanded = deltafy.load_recipe("ddl-expanded").model_copy(update={"channels": args.channels})
    models = {
        "original": stock,
        "ddl-scalar": deltafy.convert(copy.deepcopy(stock), "ddl-scalar"),
        f"ddl-expanded (d_v={args.channels})": deltafy.convert(copy.deepcopy(stock), expanded),
    }
    vocab = stock.config.vocab_size
    batch = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    tokens = batch.numel()
    optimizers = {name: trainable(m, name != "original") for name, m in models.items()}

    def step(name):
        model, opt = models[name], optimizers[name]
        loss_of(model, batch, opt is not None).backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def forward(name):
        with torch.no_grad():
            models[name](input_ids=batch)

    memory = {name: saved_bytes(m, batch, name != "original") for name, m in models.items()}
    times = {name: {"forward": [], "step": []} for name in models}
    for name in models:  # warm-up
        forward(name), step(name)
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name]["forward"].append(timed(lambda name=name: forward(name)))
            times[name]["step"].append(timed(lambda name=name: step(name)))
    d = stock.config.hidden_size
    base = memory["original"]
    print(f"{args.model}, batch {args.batch} x {args.seq_len}, fp32, {torch.get_num_threads()} threads")
    print(f"{'model':26s} {'saved KiB/token':>16s} {'vs original':>12s} {'forward':>8s} {'step':>8s}")
    for name in models:
        f = statistics.median(times[name]["forward"]) / statistics.median(times["original"]["forward"])
        s = statistics.median(times[name]["step"]) / statistics.median(times["original"]["step"])
        print(f"{name:26s} {memory[name] / tokens / 1024:16.1f} {memory[name] / base:11.2f}x {f:7.2f}x {s:7.2f}x")
    print(
        f"the stream between sublayers: {d} values per token originally, {args.channels * d} with "
        f"d_v = {args.channels} (+{(args.channels - 1) * d * 4 / 1024:.1f} KiB per token in fp32); "
        f"DeltaSpec default channels = {DeltaSpec.channels}"
    )


if __name__ == "__main__":
    main()
