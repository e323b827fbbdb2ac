"""safetensors files read and written one tensor at a time.

A safetensors header says where each tensor's bytes lie, so a conversion can link, copy or cast
a checkpoint of any size while holding at most one tensor in memory. Reads are plain ``readinto``
calls rather than a memory map: pages of a map stay in the process's resident set for as long
as the file is open, which for a multi-GB shard is the whole shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import DeltafyError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: its key, type, shape and byte range in the file."""

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of a safetensors file (key -> Entry) and its metadata, from its header alone."""
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(fh.read(length))
        size = path.stat().st_size
    except (OSError, ValueError, struct.error) as err:
        raise DeltafyError(f"{path.name} is not a readable safetensors file ({err})") from err
    metadata = header.pop("__metadata__", None) or {}
    entries = {}
    for key, info in header.items():
        begin, stop = info["data_offsets"]
        entry = Entry(path, key, info["dtype"], tuple(info["shape"]), 8 + length + begin, 8 + length + stop)
        if entry.dtype not in DTYPES or entry.end > size:
            raise DeltafyError(f"{path.name} is truncated or holds a tensor deltafy cannot read ({key})")
        entries[key] = entry
    return entries, metadata


def weight_files(folder: Path) -> list[Path] | None:
    """The safetensors files of a model folder in the order transformers reads them (a single
    model.safetensors first, else the index's shards), symlinks (the HF cache's) resolved; None
    when the folder has no safetensors weights."""
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single.resolve()]
    index = folder / INDEX_FILE
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DeltafyError(f"could not read {index}: {err}") from err
    files = []
    for name in dict.fromkeys(weight_map.values()):
        # (the HF cache's shards are links out of their folder: the name is checked, not where it leads)
        if not isinstance(name, str) or os.path.isabs(name) or os.path.normpath(name).startswith(".."):
            raise DeltafyError(
                f"{index} names {name!r}, which is not a file in {folder}: an index may only name the model's own "
                f"shards; fix the index or fetch the model again"
            )
        path = folder / name
        if not path.is_file():
            raise DeltafyError(f"{folder} is incomplete: its index names {name}, which is not there")
        files.append(path.resolve())
    return files


def read_tensor(fh, entry: Entry) -> torch.Tensor:
    """The tensor at ``entry`` in the open file ``fh``, read into fresh memory."""
    buffer = bytearray(entry.nbytes)
    fh.seek(entry.start)
    if fh.readinto(buffer) != entry.nbytes:
        raise DeltafyError(f"{entry.file.name} is truncated (tensor {entry.key})")
    if not buffer:
        return torch.empty(entry.shape, dtype=entry.torch_dtype)
    return torch.frombuffer(buffer, dtype=entry.torch_dtype).reshape(entry.shape)


def write_file(
    path: Path,
    layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    tensor: Callable[[str], torch.Tensor],
    progress: Callable[[int], None] = lambda nbytes: None,
) -> int:
    """Write a safetensors file whose tensors (key, dtype, shape) are known up front, asking
    ``tensor(key)`` for each in turn: the header is computed first, so only one tensor is ever held.
    Returns the bytes of tensor data written."""
    layout = list(layout)
    header, offset = {}, 0
    for key, dtype, shape in layout:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for key, dtype, shape in layout:
            value = tensor(key)
            if value.dtype != dtype or tuple(value.shape) != tuple(shape):
                got = f"{value.dtype} {tuple(value.shape)}"
                raise ValueError(f"tensor {key}: expected {dtype} {tuple(shape)}, got {got}")
            data = value.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            fh.write(memoryview(data))
            progress(data.nbytes)
    return offset
