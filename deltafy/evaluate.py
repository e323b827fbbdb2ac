"""Held-out loss and perplexity of any model deltafy can load, on any text deltafy can read."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .data import pack, token_stream


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int
    tokens_per_second: float
    blocks: int
    seq_len: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def load_any(source: str, dtype: str = "auto", device: str | None = None):
    """(model, tokenizer) for a deltafy checkpoint, a stock HF folder, a .gguf file, an alias or a Hub id."""
    from .checkpoint import load, load_tokenizer
    from .sources import is_deltafy_folder, load_source

    if is_deltafy_folder(Path(source).expanduser()):
        model = load(source, dtype=None if dtype == "auto" else dtype)
        tokenizer = load_tokenizer(source)
    else:
        loaded = load_source(source, dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
    if device:
        model.to(device)
    return model.eval(), tokenizer


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int = 8) -> EvalResult:
    """Mean next-token loss over every predicted token of ``blocks`` (n, seq_len)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    start = time.perf_counter()
    try:
        for i in range(0, len(blocks), batch_size):
            batch = blocks[i : i + batch_size].to(device)
            logits = model(input_ids=batch).logits[:, :-1].float()
            target = batch[:, 1:]
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
            ).item()
            count += target.numel()
    finally:
        model.train(was_training)
    elapsed = time.perf_counter() - start
    loss = total / count
    return EvalResult(
        loss=loss,
        perplexity=math.exp(min(loss, 700.0)),
        tokens=count,
        tokens_per_second=blocks.numel() / elapsed,
        blocks=len(blocks),
        seq_len=blocks.shape[1],
    )


def evaluate_text(
    model,
    tokenizer,
    data: list[str],
    seq_len: int = 256,
    batch_size: int = 8,
    max_blocks: int | None = None,
    text_field: str = "text",
) -> EvalResult:
    blocks = pack(token_stream(data, tokenizer, text_field), seq_len)
    if max_blocks is not None:
        blocks = blocks[:max_blocks]
    return evaluate(model, blocks, batch_size)
