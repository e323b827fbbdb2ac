"""The name of every file and folder deltafy writes into a checkpoint, a training run's or a bench's ``--out``,
and which of them ``--overwrite`` may replace. Everything else in such a folder is the user's. And how a run's
metrics.jsonl reads back (eval of a trained folder, bench tables and figures read its summary)."""

from __future__ import annotations

import json
from fnmatch import fnmatch
from pathlib import Path

from .errors import DeltafyError
from .modeling_deltafy import HEADS_FILE  # (a heads-only checkpoint loads it, so the shipped file names it)

# -- a checkpoint folder (deltafy.save)
CONFIG_FILE = "config.json"
MODELING_FILE = "modeling_deltafy.py"
RECIPE_FILE = "recipe.yaml"
CARD_FILE = "README.md"

# -- a training run's --out: a checkpoint folder plus the run's state and report
STATE_DIR = "training"  # resumable Trainer checkpoints
RECORD_FILE = "run.json"  # inside STATE_DIR: the settings a --resume must match
STAGING_DIR = ".saving"  # inside STATE_DIR: checkpoints are written here, then renamed into place
METRICS_FILE = "metrics.jsonl"
ADAPTER_DIR = "lora-adapter"  # the LoRA adapters of a run that did not merge them
LOSS_FIGURE = "loss.png"
BETA_FIGURE = "beta.png"
LOCK_FILE = ".deltafy-lock"

# -- a bench's --out (deltafy.bench: its models and runs, and what it measured)
BENCH_FILE = "bench.json"
BENCH_PLOT = "bench.png"

OWN_FILES = (
    CONFIG_FILE,
    "generation_config.json",
    "modeling_deltafy*.py",  # (0.1 also wrote modeling_deltafy_inference.py and _native.py)
    RECIPE_FILE,
    CARD_FILE,
    "*.safetensors",
    "*.safetensors.index.json",
    HEADS_FILE,
    # the tokenizer, as save_pretrained writes it
    "tokenizer*.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.j*",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    # a training run's state and report
    STATE_DIR,
    METRICS_FILE,
    ADAPTER_DIR,
    LOSS_FIGURE,
    BETA_FIGURE,
    LOCK_FILE,
)


def owned(name: str) -> bool:
    """Whether deltafy writes an entry of this name (so ``--overwrite`` may replace it)."""
    return any(fnmatch(name, pattern) for pattern in OWN_FILES)


def read_metrics(metrics_file: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (as append_metrics wrote them)."""
    records = []
    try:
        lines = Path(metrics_file).read_text().splitlines()
    except OSError as err:
        raise DeltafyError(f"could not read {metrics_file}: {err.strerror or err}") from err
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed run: the others still count
        if isinstance(record, dict):
            records.append(record)
    return records


def run_summary(records: list[dict]) -> dict:
    """The last summary record (held-out loss before and after, mean beta per layer), or {}."""
    return next((r for r in reversed(records) if r.get("event") == "summary"), {})
