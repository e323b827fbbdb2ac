"""Training and evaluation text: files, folders, globs, files of records and `datasets`, packed into blocks.

Documents are tokenized with the model's tokenizer, joined with EOS between them and cut into
fixed blocks of ``seq_len`` tokens. The token stream of each input is cached on disk (see
:mod:`deltafy.sources.cache`), keyed by a hash of the bytes it came from, the tokenizer and every option
that changes the tokens, so a second run starts at once and an edited input is never read stale.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import glob
import hashlib
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import DeltafyError, first_line
from .sources.cache import file_digest, folder_digest, load_tokens, store_tokens

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
# files of records, each record's --text-field a document (read as text, a .json array's markup would be trained on)
RECORD_SUFFIXES = (*JSONL_SUFFIXES, ".json", ".csv", ".tsv", ".parquet")
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes

# Part of every cache key: bump it when reading or joining documents changes, and old entries miss.
CACHE_FORMAT = 3  # (3: .json, .csv, .tsv and .parquet files are read as records, no longer as text)


def expand(paths: list[str]) -> list[str]:
    """Files behind ``paths`` (files, folders searched recursively, globs), plus dataset ids.

    A path that exists is a path even when its name holds ``[``, ``*`` or ``?`` (``notes [draft].txt``);
    only one that does not exist is read as a glob.
    """
    found: list[str] = []
    for raw in paths:
        if not raw.strip():  # Path("") is the current folder: an unset variable would read all that is there
            raise DeltafyError("an empty path was given as text to read; pass a file, a folder, a glob or a dataset")
        typed = os.path.expanduser(raw)
        path = Path(typed)
        if path.is_dir():
            if any((path / marker).is_file() for marker in DATASETS_MARKERS):
                found.append(typed)  # a `datasets` folder saved with save_to_disk
                continue
            files = sorted(str(p) for p in path.rglob("*") if p.suffix.lower() in TEXT_SUFFIXES + RECORD_SUFFIXES)
            if not files:
                raise DeltafyError(
                    f"{raw} holds no text files (.txt, .md) or files of records (.jsonl, .json, .csv, …)"
                )
            found += files
        elif path.is_file():
            found.append(typed)
        elif any(ch in raw for ch in "*?["):
            files = _glob(typed)
            if not files:
                raise DeltafyError(f"no files match {raw} (and no file or folder has that name)")
            found += files
        elif path.exists():  # a device, a pipe, a socket: nothing to read texts from
            raise DeltafyError(f"{raw} is not a file or a folder; pass a text file, a folder of them or a dataset")
        elif (
            raw.startswith((".", "/", "~"))
            or Path(raw).suffix.lower() in TEXT_SUFFIXES + RECORD_SUFFIXES
            or raw.count("/") > 1
        ):
            raise DeltafyError(f"data not found: {raw} (no such file or folder)")
        else:
            found.append(raw)  # a dataset id on the Hugging Face Hub
    return found


def _glob(pattern: str) -> list[str]:
    # The longest leading folder that exists is taken literally: `runs [v2]/*.txt` globs in `runs [v2]`.
    parts = Path(pattern).parts
    literal = next((i for i in range(len(parts) - 1, 0, -1) if Path(*parts[:i]).is_dir()), 0)
    head = [glob.escape(str(Path(*parts[:literal])))] if literal else []
    matches = glob.glob(os.path.join(*head, *parts[literal:]), recursive=True)
    return sorted(m for m in matches if Path(m).is_file())


# Messages name each input as the user typed it (``source``), not as a normalized Path.
def _read_bytes(source: str) -> bytes:
    try:
        return Path(source).read_bytes()
    except OSError as err:
        raise DeltafyError(f"could not read {source}: {err.strerror or err}") from err


def _decode(source: str, raw: bytes) -> str:
    if b"\x00" in raw[:8192] or raw[:2] == b"\x1f\x8b":
        if (kind := Path(source).suffix.lower()) in (".gz", ".bz2", ".xz", ".zst", ".zip"):
            raise DeltafyError(f"{source} is compressed ({kind}); decompress it first and pass the file inside")
        raise DeltafyError(
            f"{source} looks binary; pass UTF-8 text (.txt, .md) or records (.jsonl, .json, .csv, .parquet)"
        )
    try:
        return raw.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not text
    except UnicodeDecodeError as err:
        raise DeltafyError(f"{source} is not UTF-8 text (byte {err.start}); convert it to UTF-8 first") from err


def _file_documents(source: str, raw: bytes, text_field: str) -> Iterator[str]:
    suffix = Path(source).suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_documents(source, raw, text_field)
        return
    text = _decode(source, raw)
    if suffix in (".csv", ".tsv"):
        yield from _table_documents(source, text, text_field, "\t" if suffix == ".tsv" else ",")
    elif suffix == ".json":
        yield from _json_documents(source, text, text_field)
    elif suffix in JSONL_SUFFIXES:
        yield from _jsonl_documents(source, text, text_field)
    else:
        yield text


def _field(source: str, where: str, record, text_field: str) -> str:
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise DeltafyError(f"{source}{where} has no string field {text_field!r} (set --text-field)")
    return record[text_field]


def _jsonl_documents(source: str, text: str, text_field: str) -> Iterator[str]:
    # Lines end at "\n" only: str.splitlines() would also split at U+2028 and friends, which JSON
    # strings may hold unescaped.
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DeltafyError(f"{source}:{n} is not valid JSON ({err.msg} at column {err.colno})") from err
        yield _field(source, f":{n}", record, text_field)


def _json_documents(source: str, text: str, text_field: str) -> Iterator[str]:
    """A .json file: a list of records (or one), or JSON Lines under a .json name, as `datasets` reads both."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # a second value after the first: one record per line
            yield from _jsonl_documents(source, text, text_field)
            return
        raise DeltafyError(f"{source} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno})") from err
    for n, record in enumerate(data if isinstance(data, list) else [data]):
        yield _field(source, f": record {n}" if isinstance(data, list) else "", record, text_field)


def _table_documents(source: str, text: str, text_field: str, delimiter: str) -> Iterator[str]:
    csv.field_size_limit(max(csv.field_size_limit(), sys.maxsize >> 32))  # a document is longer than 128 KiB
    rows = csv.DictReader(io.StringIO(text, newline=""), delimiter=delimiter)
    _need_column(source, text_field, rows.fieldnames or [])
    try:
        yield from (row[text_field] for row in rows if row[text_field])
    except csv.Error as err:
        raise DeltafyError(f"{source}:{rows.line_num} is not valid CSV ({err})") from err


def _need_column(source: str, text_field: str, columns: list[str]) -> None:
    if text_field not in columns:
        named = ", ".join(columns) or "none"
        raise DeltafyError(f"{source} has no column {text_field!r} (set --text-field); its columns: {named}")


def _parquet_documents(source: str, raw: bytes, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq  # (a dependency of datasets)

    try:
        table = pq.ParquetFile(io.BytesIO(raw))
        _need_column(source, text_field, table.schema_arrow.names)
        column = table.read(columns=[text_field]).column(0)
    except DeltafyError:
        raise
    except Exception as err:  # pyarrow's errors share no base class but Exception
        raise DeltafyError(f"could not read {source} as Parquet: {first_line(err)}") from err
    if str(column.type) not in ("string", "large_string", "string_view"):
        raise DeltafyError(f"{source}'s column {text_field!r} holds {column.type}, not text (set --text-field)")
    yield from (text for text in column.to_pylist() if text)


def documents(source: str, text_field: str = "text") -> Iterator[str]:
    """The documents of one input: a text file is one document, a JSONL line is one document."""
    if Path(source).is_file():
        yield from _file_documents(source, _read_bytes(source), text_field)
        return
    yield from _dataset_documents(source, text_field)


def _datasets():
    try:
        import datasets
    except ImportError as err:  # kept as the cause: datasets may be installed but fail to import
        raise DeltafyError("reading datasets needs the datasets package: pip install datasets") from err
    return datasets


def _load_dataset(source: str):
    """A `datasets` folder, or the train split of a Hub dataset."""
    datasets = _datasets()
    try:
        if Path(source).is_dir():
            data = datasets.load_from_disk(source)
        else:
            from .sources.load import hub_revision

            hub_revision(source, f"the dataset {source}", repo_type="dataset")  # no Hub, nothing cached: say so now
            data = datasets.load_dataset(source, split="train")
    except DeltafyError:
        raise
    except Exception as err:
        raise DeltafyError(f"could not load dataset {source}: {first_line(err)}") from err
    if isinstance(data, datasets.DatasetDict):
        data = data[_read_split(data)]
    return data


def _read_split(splits) -> str:
    """The split a `datasets` folder of several is read as: its train split, else its first."""
    return "train" if "train" in splits else next(iter(splits))


# A Hub dataset is loaded once per process, so its cache key (the revision it resolved to) and its
# documents come from the same load. A folder is keyed by its bytes and may change between calls.
_load_hub_dataset = functools.lru_cache(maxsize=4)(_load_dataset)


def _dataset_documents(source: str, text_field: str) -> Iterator[str]:
    data = _load_dataset(source) if Path(source).is_dir() else _load_hub_dataset(source)
    _need_column(f"dataset {source}", text_field, data.column_names)
    for text in data[text_field]:
        if isinstance(text, str):
            yield text


def _tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything about ``tokenizer`` that changes the ids of a text."""
    flags = (type(tokenizer).__name__, tokenizer.eos_token_id, getattr(tokenizer, "split_special_tokens", None))
    digest = hashlib.sha256(repr(flags).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The whole pipeline: vocab, merges, added tokens, normalizer, pre-tokenizer. Truncation and
        # padding are set per call and never apply to deltafy's calls.
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        digest.update(json.dumps(state, sort_keys=True).encode())
    else:  # a pure-Python tokenizer: what its ids are made of
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        if (sp_model := getattr(tokenizer, "sp_model", None)) is not None:
            digest.update(sp_model.serialized_model_proto())
        if (ranks := getattr(tokenizer, "bpe_ranks", None)) is not None:
            digest.update(json.dumps(sorted((list(k), v) for k, v in ranks.items())).encode())
        digest.update(repr(getattr(tokenizer, "do_lower_case", None)).encode())
    return digest.hexdigest()[:16]


def _identity(source: str, text_field: str) -> dict:
    """What one input's tokens depend on besides the tokenizer, by content, never by path or time."""
    path = Path(source)
    if path.is_file():
        records = path.suffix.lower() in RECORD_SUFFIXES
        ident = {"kind": "records" if records else "text", "sha256": file_digest(path), "bytes": path.stat().st_size}
        return ident | ({"text_field": text_field} if records else {})
    if path.is_dir():
        digest, size = folder_digest(path)
        return {"kind": "datasets", "sha256": digest, "bytes": size, "text_field": text_field}
    return _hub_identity(source, _load_hub_dataset(source), text_field)


def _hub_identity(source: str, data, text_field: str) -> dict:
    # `datasets` derives a loaded dataset's fingerprint from the files it resolved on the Hub (the
    # commit they were read at), so a new revision of the dataset is a new key.
    return {"kind": "hub", "id": source, "split": "train", "fingerprint": data._fingerprint, "text_field": text_field}


def _input_key(source: str, text_field: str, tokenizer_fp: str) -> str:
    return _key(_identity(source, text_field), tokenizer_fp)


def _key(identity: dict, tokenizer_fp: str) -> str:
    return hashlib.sha256(json.dumps([CACHE_FORMAT, identity, tokenizer_fp], sort_keys=True).encode()).hexdigest()[:24]


def fingerprint(sources: list[str], tokenizer, text_field: str = "text") -> str:
    """One hash of everything ``token_stream(sources, tokenizer, text_field)`` reads: each input's
    content and the tokenizer's identity (a training run records it to check what it resumes).
    Hashes bytes only; nothing is tokenized."""
    fp = _tokenizer_fingerprint(tokenizer)
    keys = [_input_key(source, text_field, fp) for source in expand(sources)]
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:24]


def _tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    return str(Path(name).resolve()) if Path(name).is_dir() else name  # `../model` names no folder in a listing


def _tokenize(docs: Iterator[str], tokenizer) -> list[int]:
    ids: list[int] = []
    for doc in docs:
        if doc.strip():
            ids += tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return ids


def token_stream(sources: list[str], tokenizer, text_field: str = "text", use_cache: bool = True) -> torch.Tensor:
    """All documents of ``sources`` as one int32 stream of token ids, EOS after every document."""
    if tokenizer.eos_token_id is None:
        raise DeltafyError("the tokenizer has no EOS token to separate documents")
    fp = _tokenizer_fingerprint(tokenizer) if use_cache else ""
    parts = []
    for source in expand(sources):
        path = Path(source)
        identity = _identity(source, text_field) if use_cache else None
        stream = load_tokens(_key(identity, fp)) if use_cache else None
        if stream is None:
            if path.is_file():
                raw = _read_bytes(source)
                if use_cache:  # key the entry by the bytes tokenized, even if the file changed since it was hashed
                    identity |= {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
                ids = _tokenize(_file_documents(source, raw, text_field), tokenizer)
            else:
                ids = _tokenize(_dataset_documents(source, text_field), tokenizer)
            if not ids:
                raise DeltafyError(f"{source} holds no text")
            stream = torch.tensor(ids, dtype=torch.int32)
            if use_cache:
                where = source if identity["kind"] == "hub" else str(path.resolve())
                about = {"source": where, "tokenizer": _tokenizer_name(tokenizer)}
                store_tokens(_key(identity, fp), stream, about | identity | {"tokenizer_fingerprint": fp})
        parts.append(stream)
    return torch.cat(parts)


def refuse_shared_text(train_inputs: list[str], held_inputs: list[str]) -> None:
    """The held-out text must not be trained on: refuse an input of --eval-data that is one of --data's
    (``expand``-ed lists), whatever either is called: a file with the same bytes (a copy, a link), the
    same `datasets` folder or split (a folder of splits is read as its train split), the same Hub id."""

    def read(source: str) -> tuple[str, str]:
        path = Path(source)
        if path.is_file():
            return "file", file_digest(path)
        if (path / "dataset_dict.json").is_file():  # a folder of splits, read as _load_dataset reads it
            with contextlib.suppress(OSError, ValueError, TypeError, KeyError, StopIteration):
                path = path / _read_split(json.loads((path / "dataset_dict.json").read_text())["splits"])
        return ("folder", os.path.realpath(path)) if path.is_dir() else ("hub", source)

    trained = {read(source): source for source in train_inputs}
    for source in held_inputs:
        if (twin := trained.get(read(source))) is not None:
            raise DeltafyError(
                f"--eval-data {source} holds the same text as --data {twin}: the held-out text must not be "
                f"trained on; hold out other text"
            )


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
        raise DeltafyError(
            f"only {len(blocks)} block{'s' * (len(blocks) != 1)} of text: too few to hold out {fraction:.0%} for "
            f"evaluation; pass more text or a shorter --seq-len"
        )
    return blocks[order[n_eval:]], blocks[order[:n_eval]]
