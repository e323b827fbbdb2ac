"""What deltafy keeps in its cache folder (``$DELTAFY_CACHE``, default ``~/.cache/deltafy``).

``tokens/`` holds token streams, each keyed by a hash of the bytes it came from and of the
tokenizer, with a JSON sidecar that says what it came from; ``gguf/`` holds dequantized copies of
GGUF files, keyed by the file's sha256; ``kernels/`` holds the C kernels that deltafy 0.1 compiled,
which nothing reads any more. Every entry is written to a temporary name and renamed, so a killed
run leaves at most a ``*.tmp-PID`` leftover, never an entry that looks complete.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG

import torch

from ..errors import DeltafyError
from .load import cache_dir
from .provenance import sha256_file

log = logging.getLogger(__name__)

KINDS = {
    "tokens": "token streams",
    "gguf": "dequantized GGUF weights",
    "kernels": "compiled kernels (deltafy 0.1)",
}

# Digests of files already hashed by this process, keyed by everything a write changes: a write
# always moves st_ctime, which no tool can put back (os.utime, cp -p and rsync -a restore only
# mtime). Training reads each input twice (its fingerprint, then its tokens) and pays one read.
_DIGESTS: dict[tuple, str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks (a large file costs one pass, never its size in memory)."""
    stat = path.stat()
    ident = (str(path.resolve()), stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if ident not in _DIGESTS:
        _DIGESTS[ident] = sha256_file(path)
    return _DIGESTS[ident]


def folder_digest(folder: Path) -> tuple[str, int]:
    """A hash of every file under ``folder`` (names and bytes) and their total size."""
    digest, total = hashlib.sha256(), 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")):
        digest.update(json.dumps([path.relative_to(folder).as_posix(), file_digest(path)]).encode())
        total += path.stat().st_size
    return digest.hexdigest(), total


def _tokens_dir() -> Path:
    return cache_dir() / "tokens"


def load_tokens(key: str) -> torch.Tensor | None:
    """The cached stream for ``key``, or None: a missing or unreadable entry is a miss, never an error."""
    path = _tokens_dir() / f"{key}.pt"
    if not path.is_file():
        return None
    try:
        stream = torch.load(path, weights_only=True)
    except Exception:  # damaged by hand or by the disk: tokenize again and replace it
        return None
    return stream if isinstance(stream, torch.Tensor) and stream.dtype == torch.int32 and stream.dim() == 1 else None


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def store_tokens(key: str, stream: torch.Tensor, about: dict) -> None:
    """Cache ``stream`` under ``key``, with ``about`` (what it came from) as its sidecar.

    A cache that cannot be written (full disk, read-only folder, a concurrent ``cache clear``) costs
    the next run a new tokenization, not this run: it is a warning, not an error.
    """
    root = _tokens_dir()
    about = {**about, "tokens": stream.numel(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        root.mkdir(parents=True, exist_ok=True)
        # The sidecar first: an entry is the .pt file, and it never exists without its description.
        _write_atomically(root / f"{key}.json", lambda tmp: tmp.write_text(json.dumps(about, indent=1) + "\n"))
        _write_atomically(root / f"{key}.pt", lambda tmp: torch.save(stream, tmp))
    except OSError as err:
        log.warning("could not cache the tokens of %s in %s: %s", about.get("source"), root, err.strerror or err)


@dataclass
class KindInfo:
    kind: str
    what: str
    folder: Path
    entries: int
    bytes: int
    linked: int = 0  # of those bytes, in files also linked from elsewhere (a checkpoint's shard): removing frees none


def _sizes(path: Path) -> tuple[int, int]:
    """The bytes of ``path``'s files, and of those whose data another hard link keeps on disk."""
    files = (
        [path] if path.is_symlink() or path.is_file() else [p for p in path.rglob("*") if p.is_symlink() or p.is_file()]
    )
    stats = [p.lstat() for p in files]
    return sum(s.st_size for s in stats), sum(s.st_size for s in stats if s.st_nlink > 1 and S_ISREG(s.st_mode))


# The names deltafy gives what it writes in each kind's folder; anything else there is not deltafy's,
# and neither `cache info` counts it nor `cache clear` removes it.
_OWN = {
    "tokens": re.compile(r"[0-9a-f]{24}\.(pt|json)"),  # a stream and its sidecar
    "gguf": re.compile(r"[0-9a-f]{16}"),  # a dequantized model's folder
    "kernels": re.compile(r"[^.].*\.so"),
}
_LEFTOVER = re.compile(r"\.tmp-\d+$")  # what a killed run left of an entry it was writing


def _own(folder: Path, kind: str) -> list[Path]:
    """deltafy's own files and folders in one kind's folder: entries, sidecars, killed runs' leftovers."""
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _OWN[kind].fullmatch(_LEFTOVER.sub("", p.name)))


def _entries(folder: Path, kind: str) -> list[Path]:
    """The complete entries of one kind (temporary leftovers of killed runs are not entries)."""
    own = (p for p in _own(folder, kind) if not _LEFTOVER.search(p.name))
    return [p for p in own if kind != "tokens" or p.suffix == ".pt"]


def _root() -> Path:
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise DeltafyError(f"the cache folder {root} is a file; point DELTAFY_CACHE at a folder")
    return root


def cache_info() -> list[KindInfo]:
    """Entries and bytes of each kind of cache (a missing folder holds nothing)."""
    root = _root()
    infos = []
    for kind, what in KINDS.items():
        folder = root / kind
        sizes = [_sizes(p) for p in _own(folder, kind)]
        infos.append(
            KindInfo(
                kind, what, folder, len(_entries(folder, kind)), sum(a for a, _ in sizes), sum(b for _, b in sizes)
            )
        )
    return infos


def token_entries() -> list[dict]:
    """What each cached token stream came from, newest first (from its sidecar; older entries have none)."""
    entries = []
    for path in _entries(_tokens_dir(), "tokens"):
        try:
            about = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            about = {}
        stat = path.stat()
        entries.append({**about, "key": path.stem, "cached_bytes": stat.st_size, "mtime": stat.st_mtime})
    return sorted(entries, key=lambda e: e["mtime"], reverse=True)


def clear_cache(everything: bool = False) -> list[KindInfo]:
    """Remove the token streams (``everything``: every kind), and say what went and how much space came back.

    Only what deltafy wrote is removed, and a kind's folder once it is empty, never the cache folder
    itself: DELTAFY_CACHE may point at a folder that holds other things too, even in these folders.
    """
    removed = []
    for info in cache_info():
        if not everything and info.kind != "tokens":
            continue
        for path in _own(info.folder, info.kind):  # (a file a live run renamed away meanwhile is no failure)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if _own(info.folder, info.kind):
            raise DeltafyError(f"could not remove all of {info.folder}; check its permissions")
        with contextlib.suppress(OSError):  # (not empty: it holds files deltafy did not write)
            info.folder.rmdir()
        removed.append(info)
    return removed


def human_size(n: float) -> str:
    if n < 1000:
        return f"{int(n)} B"
    for unit in ("kB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            break
    return f"{n:.1f} {unit}"
