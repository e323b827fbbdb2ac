"""Held-out loss and perplexity of any model deltafy can load, on any text deltafy can read."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import get_args

import torch

from .data import pack, token_stream
from .errors import DeltafyError
from .placement import input_device, place

# Where configs keep their context length: llama and most others, gpt2, older gpt2-style, some remote-code families.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length")


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int
    tokens_per_second: float
    blocks: int
    seq_len: int
    available_blocks: int | None = None  # the text's blocks before --max-blocks (None: every one was read)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def position_limit(config) -> tuple[str, int] | None:
    """The config key and the longest sequence ``config``'s model was built for (a config object or
    a config.json dict), or None where the config does not say."""
    for key in POSITION_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return key, value
    return None


def model_positions(config) -> int | None:
    """The longest sequence ``config``'s model was built for, or None where the config does not say."""
    limit = position_limit(config)
    return limit[1] if limit else None


def check_sizes(seq_len: int, batch_size: int, max_blocks: int | None = None, config=None) -> None:
    """Refuse sizes that cannot be evaluated, all of them in one line that names each option and
    what it takes; with ``config``, also a block longer than the model's positions (GPT-2's learned
    positions end at ``n_positions``: past them it fails; rotary models read positions they never
    saw and report a meaningless loss)."""
    problems = []
    if seq_len < 2:
        problems.append(f"--seq-len takes an integer ≥ 2 (a block predicts every token but its first); got {seq_len}")
    if batch_size < 1:
        problems.append(f"--batch-size takes an integer ≥ 1; got {batch_size}")
    if max_blocks is not None and max_blocks < 1:
        problems.append(f"--max-blocks takes an integer ≥ 1 (leave it out for every block); got {max_blocks}")
    positions = model_positions(config) if config is not None else None
    if positions is not None and seq_len > positions:
        problems.append(
            f"--seq-len {seq_len} is longer than the model's {positions} positions; pass at most {positions}"
        )
    if problems:
        raise DeltafyError("; ".join(problems))


def run_settings(source: str, flags: dict | None = None):
    """How to read text for ``source``: as its own training run read held-out text when it is a deltafy
    folder (its recipe's training section: block length, batch, text field; a trained one's run also
    capped the blocks), else as a run would by default; ``flags`` given (not None) win."""
    from .checkpoint import read_config
    from .files import METRICS_FILE
    from .options import EvalOptions, options_from
    from .sources.load import is_deltafy_folder

    section, folder = None, Path(source).expanduser()
    if is_deltafy_folder(folder):
        section = dict((read_config(source)["deltafy"].get("recipe") or {}).get("training") or {})
        # A run measured its "after" on its first max_eval_blocks held-out blocks, in the dtype it held the
        # model in (a bf16 model trained in fp32 on a CPU: fp32): eval of its folder does too. A conversion's
        # section holds the recipe's defaults, and no run: it reads every block, as the stock model does,
        # so the two stay comparable.
        if "max_eval_blocks" in section and (folder / METRICS_FILE).is_file():
            section["max_blocks"] = section.pop("max_eval_blocks")
            section["dtype"] = _measured_in(folder / METRICS_FILE)
    return options_from(section, EvalOptions, what="evaluation", **(flags or {}))


def _measured_in(metrics_file: Path) -> str:
    """The dtype a run's summary says its held-out losses were measured in ("auto" where an older run's says
    none)."""
    from .files import read_metrics, run_summary
    from .options import DTypeName

    try:
        dtype = run_summary(read_metrics(metrics_file)).get("dtype")
    except DeltafyError:
        return "auto"
    return dtype if dtype in get_args(DTypeName) else "auto"


def load_any(source: str, dtype: str = "auto", device: str | None = None, base: str | None = None):
    """(model, tokenizer) for a deltafy checkpoint, a stock HF folder, a .gguf file, an alias or a Hub id;
    ``base``: where a heads-only checkpoint's base model is, if it moved."""
    from .checkpoint import load, load_tokenizer
    from .sources.load import is_deltafy_folder, load_source

    if is_deltafy_folder(Path(source).expanduser()):  # deltafy's own classes: no code from the folder runs
        model = load(source, dtype=None if dtype == "auto" else dtype, base=base)
        tokenizer = load_tokenizer(source)
    else:
        if base is not None:
            raise DeltafyError(f"--base applies to a heads-only deltafy checkpoint, and {source} is not a deltafy one")
        # Quiet: load_source warns of a missing tokenizer for conversion's sake; evaluation refuses instead.
        sources_log = logging.getLogger("deltafy.sources.load")
        level = sources_log.level
        sources_log.setLevel(logging.ERROR)
        try:
            loaded = load_source(source, dtype)
        finally:
            sources_log.setLevel(level)
        model, tokenizer = loaded.model, loaded.tokenizer
    return place(model, device).eval(), tokenizer


@torch.no_grad()
def evaluate(model, blocks: torch.Tensor, batch_size: int = 8) -> EvalResult:
    """Mean next-token loss over every predicted token of ``blocks`` (n, seq_len)."""
    device = input_device(model)
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
    check_sizes(seq_len, batch_size, max_blocks, model.config)  # before the text is read
    blocks = pack(token_stream(data, tokenizer, text_field), seq_len)
    result = evaluate(model, blocks[:max_blocks], batch_size)
    result.available_blocks = len(blocks)
    return result
