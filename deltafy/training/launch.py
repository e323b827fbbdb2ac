"""What a run will do, settled before anything is loaded: the steps it plans, which process speaks
for a torchrun job, what else it reads (which its --out must not destroy), the precision it computes
in and the dtypes it holds and writes the model in, and the checks of its sequence length and of a
heads-only save."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import torch

from ..errors import DeltafyError
from ..options import TrainOptions
from ..recipe import ADAPTER_MODES


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def planned_steps(options: TrainOptions, world_size: int) -> int:
    if options.steps:
        return options.steps
    if options.tokens:
        per_step = options.seq_len * options.batch_size * options.grad_accum * world_size
        return max(1, math.ceil(options.tokens / per_step))
    return 200


def check_seq_len(config: dict, seq_len: int) -> None:
    """A block longer than the model's positions: GPT-2 would fail with an IndexError mid-run, a
    rotary model would train silently on positions it never saw."""
    from ..evaluate import position_limit

    found = position_limit(config)
    if found is not None and seq_len > found[1]:
        key, limit = found
        raise DeltafyError(
            f"--seq-len {seq_len} is longer than the model's {limit} positions ({key}); pass --seq-len {limit} or less"
        )


def read_by(model_dir: str, data: list[str], eval_data: list[str] | None, base=None) -> tuple[list, list]:
    """What a run reads besides ``model_dir``, which its --out must not destroy: its local text, and
    the local base a heads-only input loads (``base`` where it moved; where a heads-only output would
    point too)."""
    from ..checkpoint import read_config

    texts = [("the training data", Path(d)) for d in data] + [("the held-out data", Path(d)) for d in eval_data or ()]
    reads = [(what, path) for what, path in texts if path.expanduser().exists()]
    if base is not None:
        return reads, [("the base model", Path(base).expanduser())]
    try:
        record = read_config(model_dir)["deltafy"].get("base")
    except DeltafyError:
        record = None  # not a checkpoint: read_config says so in its turn
    path = record.get("path") if isinstance(record, dict) else None
    if not isinstance(path, str) or "package" in record:  # (a Hub base, or a bundled alias's file)
        return reads, []
    base = Path(path).expanduser()
    return reads, [("the base model", base if base.is_absolute() else Path(model_dir).expanduser() / base)]


def changes_base_weights(options: TrainOptions) -> bool:
    """Whether the run's output has other pretrained weights than its input: it trains them in place
    (ln-tuning, base, all), or merges an adapter into them."""
    return options.train in ("ln-tuning", "base", "all") or (options.train in ADAPTER_MODES and options.merge_lora)


def kept_dtype(config: dict, options: TrainOptions) -> torch.dtype:
    """The dtype a run writes its model in: the input's (a bf16 model stays bf16, its frozen weights exactly
    as they were), unless the run changed pretrained weights (a merged adapter, ln-tuning, base, all), whose
    steps, smaller than bf16's resolution, would round away: those are written in float32."""
    from ..sources.load import resolve_dtype

    return torch.float32 if changes_base_weights(options) else resolve_dtype("auto", SimpleNamespace(**config))


def computes_in_bf16(options: TrainOptions) -> bool:
    """Whether the run's forward and backward run under bf16 autocast: --precision bf16, or auto on a GPU
    that supports it."""
    if options.precision != "auto":
        return options.precision == "bf16"
    return torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def held_dtype(stored: torch.dtype, options: TrainOptions) -> torch.dtype:
    """The dtype a run holds the model in while it trains (``stored``: its kept_dtype); what trains is
    float32 whatever this is (see select_trainable). A bf16 input that trains in bf16 keeps its frozen
    weights in bf16: autocast runs its matmuls in bf16 either way, and a float32 copy would double the
    memory of what does not train (a 7B base: 28 GB, not 14). Otherwise float32: a run that changes
    pretrained weights, or trains in float32, computes on float32 weights (fp16's range is not trusted
    to a backward pass)."""
    return stored if stored == torch.bfloat16 and computes_in_bf16(options) else torch.float32


def check_heads_only(config: dict, options: TrainOptions, model_dir: str) -> None:
    """A heads-only save stores nothing of the base, so the base must stay exactly as it was."""
    if changes_base_weights(options):
        if options.train in ADAPTER_MODES:
            raise DeltafyError(
                f"--heads-only cannot save train: {options.train} with its adapter merged into the base weights; "
                f"pass --keep-adapter to save the adapter beside the heads, or drop --heads-only"
            )
        raise DeltafyError(
            f"--heads-only cannot save train: {options.train}, which changes the base weights; drop --heads-only"
        )
    if "base" not in config["deltafy"]:
        raise DeltafyError(
            f"--heads-only needs a heads-only model to train (its base is what the heads load onto), and "
            f"{model_dir} is a full checkpoint; convert the original with `deltafy convert --heads-only`"
        )
