"""Training and evaluation text: files, folders, globs, JSONL and `datasets`, packed into blocks.

Documents are tokenized with the model's tokenizer, joined with EOS between them and cut into
fixed blocks of ``seq_len`` tokens. The token stream of each input is cached on disk, keyed by the
files' paths, sizes and modification times and by the tokenizer, so a second run starts at once.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import DeltafyError
from .sources import cache_dir

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def expand(paths: list[str]) -> list[str]:
    """Files behind ``paths`` (files, folders searched recursively, globs), plus dataset ids."""
    found: list[str] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if any(ch in raw for ch in "*?["):
            matches = sorted(glob.glob(str(path), recursive=True))
            files = [m for m in matches if Path(m).is_file()]
            if not files:
                raise DeltafyError(f"no files match {raw}")
            found += files
        elif path.is_dir():
            if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
                found.append(str(path))  # a `datasets` folder saved with save_to_disk
                continue
            files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES)
            if not files:
                raise DeltafyError(f"{raw} holds no .txt, .md or .jsonl files")
            found += files
        elif path.is_file():
            found.append(str(path))
        elif (
            raw.startswith((".", "/", "~"))
            or Path(raw).suffix.lower() in TEXT_SUFFIXES + JSONL_SUFFIXES + (".json",)
            or raw.count("/") > 1
        ):
            raise DeltafyError(f"data not found: {raw} (no such file or folder)")
        else:
            found.append(raw)  # a dataset id on the Hugging Face Hub
    return found


def _read_text(path: Path) -> str:
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise DeltafyError(f"could not read {path}: {err.strerror or err}") from err
    if b"\x00" in raw[:8192]:
        raise DeltafyError(f"{path} looks binary; pass UTF-8 text (.txt, .md) or JSONL")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DeltafyError(f"{path} is not UTF-8 text; convert it to UTF-8 first") from err


def documents(source: str, text_field: str = "text") -> Iterator[str]:
    """The documents of one input: a text file is one document, a JSONL line is one document."""
    path = Path(source)
    if path.is_file():
        text = _read_text(path)
        if path.suffix.lower() in JSONL_SUFFIXES:
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as err:
                    raise DeltafyError(f"{path}:{n} is not valid JSON") from err
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    raise DeltafyError(f"{path}:{n} has no string field {text_field!r} (set --text-field)")
                yield record[text_field]
        else:
            yield text
        return
    yield from _dataset_documents(source, text_field)


def _dataset_documents(source: str, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as err:  # kept as the cause: datasets may be installed but fail to import
        raise DeltafyError("reading datasets needs the datasets package: pip install datasets") from err
    try:
        if Path(source).is_dir():
            data = datasets.load_from_disk(source)
        else:
            data = datasets.load_dataset(source, split="train")
    except Exception as err:
        raise DeltafyError(f"could not load dataset {source}: {str(err).splitlines()[0]}") from err
    if isinstance(data, datasets.DatasetDict):
        data = data["train"] if "train" in data else next(iter(data.values()))
    if text_field not in data.column_names:
        raise DeltafyError(f"dataset {source} has no column {text_field!r}; columns: {', '.join(data.column_names)}")
    for text in data[text_field]:
        if isinstance(text, str):
            yield text


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab).encode())
    digest.update(str((type(tokenizer).__name__, tokenizer.eos_token_id)).encode())
    return digest.hexdigest()[:16]


def _input_key(source: str, text_field: str, tokenizer_fp: str) -> str:
    path = Path(source)
    if path.is_file():
        stat = path.stat()
        ident = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    else:
        ident = (source,)
    return hashlib.sha256(json.dumps([ident, text_field, tokenizer_fp]).encode()).hexdigest()[:24]


def token_stream(sources: list[str], tokenizer, text_field: str = "text", use_cache: bool = True) -> torch.Tensor:
    """All documents of ``sources`` as one int32 stream of token ids, EOS after every document."""
    if tokenizer.eos_token_id is None:
        raise DeltafyError("the tokenizer has no EOS token to separate documents")
    fp = _tokenizer_fingerprint(tokenizer)
    root = cache_dir() / "tokens"
    parts = []
    for source in expand(sources):
        cached = root / f"{_input_key(source, text_field, fp)}.pt"
        if use_cache and cached.is_file():
            parts.append(torch.load(cached))
            continue
        ids: list[int] = []
        for doc in documents(source, text_field):
            if doc.strip():
                ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if not ids:
            raise DeltafyError(f"{source} holds no text")
        stream = torch.tensor(ids, dtype=torch.int32)
        if use_cache:
            root.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".tmp-{os.getpid()}")
            torch.save(stream, tmp)
            os.replace(tmp, cached)
        parts.append(stream)
    return torch.cat(parts)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a token stream into ``(n, seq_len)`` int64 blocks (the ragged tail is dropped)."""
    n = stream.numel() // seq_len
    if n == 0:
        raise DeltafyError(f"only {stream.numel()} tokens of text: fewer than one block of --seq-len {seq_len}")
    return stream[: n * seq_len].view(n, seq_len).long()


def split_held_out(blocks: torch.Tensor, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A reproducible random split of blocks into (train, held-out)."""
    if not 0 < fraction < 1:
        raise DeltafyError("--held-out must be between 0 and 1")
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    n_eval = max(1, int(round(len(blocks) * fraction)))
    if n_eval >= len(blocks):
        raise DeltafyError(f"only {len(blocks)} blocks of text: too few to hold out {fraction:.0%} for evaluation")
    return blocks[order[n_eval:]], blocks[order[:n_eval]]
