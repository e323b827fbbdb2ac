"""Output folders written atomically: a temporary sibling renamed into place, leftovers of killed
saves cleared by the next run, and the OS error behind a failed write."""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import signal
import stat
from contextlib import contextmanager
from pathlib import Path

from .errors import DeltafyError
from .modeling_deltafy import HEADS_FILE

log = logging.getLogger(__name__)


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse early (before any heavy work) to write over something the user already has."""
    clear_leftovers(out)
    if out.exists() and not out.is_dir():
        raise DeltafyError(f"{out} exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DeltafyError(f"{out} already holds files; choose an empty or new folder, or pass --overwrite")
    if not out.parent.exists() and out.parent != out:
        out.parent.mkdir(parents=True, exist_ok=True)


def _sibling(out: Path, kind: str, pid: int) -> Path:
    return out.parent / f".{out.name}.deltafy-{kind}-{pid}"


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # ours, from before this save: nothing of this process is writing it now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, under another user
        return True
    return True


def clear_leftovers(out: Path) -> None:
    """Remove what a killed save left beside ``out`` (``_atomic_dir``'s temporary folders), so that
    nothing model-sized stays hidden there; refuse while the process that made them still runs.

    A save that was killed between its two renames left ``out`` missing and the previous ``out``
    in its ``-old-`` folder: that one is put back, not removed.
    """
    if not out.parent.is_dir():
        return
    for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.deltafy-*-*")):
        kind, _, pid = path.name.removeprefix(f".{out.name}.deltafy-").partition("-")
        if kind not in ("partial", "old") or not pid.isdigit():
            continue
        if _running(int(pid)):
            raise DeltafyError(
                f"process {pid} is writing {out} (into {path.name}); wait for it to finish, or remove "
                f"{path} if no deltafy run is going on"
            )
        if kind == "old" and not out.exists():
            os.replace(path, out)
            log.warning("restored %s from %s, left by an interrupted save (process %s)", out, path.name, pid)
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left by an interrupted save (process %s)", path, pid)


def _os_errno(err: BaseException) -> int | None:
    """The OS error code behind a failed write: an OSError's own, or the one safetensors (Rust)
    reports only in its message, e.g. "I/O error: No space left on device (os error 28)"."""
    if isinstance(err, OSError):
        return err.errno
    match = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    return int(match.group(1)) if match else None


@contextmanager
def _atomic_dir(out: Path, overwrite: bool, merge: bool = False):
    """Yield a temporary sibling folder; on success it replaces ``out`` (or, with ``merge``, its
    files move into ``out``); on any failure it is removed."""
    check_output_dir(out, overwrite)
    tmp = _sibling(out, "partial", os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with sigterm_unwinds(), _replacing(tmp, out, merge):
        yield tmp


@contextmanager
def sigterm_unwinds():
    """SIGTERM (a scheduler killing the job, ``kill PID``) raises KeyboardInterrupt like Ctrl-C, so
    the ``finally`` and ``except`` blocks it passes through run; the previous handler is restored."""
    try:
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python


def file_mode() -> int:
    """The mode a new file gets here: 0o666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def readable(folder: Path) -> None:
    """Give the safetensors files deltafy wrote under ``folder`` the mode of every other new file.

    safetensors 0.8 writes through a temporary file created 0600 and renamed into place, so weights
    came out readable by their owner alone (safetensors/safetensors#782): a folder shared with
    another user or a container could not be loaded. A hard-linked source shard (more than one
    link) is the user's own file and keeps its mode."""
    mode = file_mode()
    for path in folder.rglob("*.safetensors"):
        info = path.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and info.st_mode & 0o777 == 0o600:
            path.chmod(mode)


@contextmanager
def _replacing(tmp: Path, out: Path, merge: bool):
    try:
        yield tmp
        readable(tmp)
        if merge and out.is_dir():
            _move_into(tmp, out)
            return
        old = None
        if out.exists():
            old = _sibling(out, "old", os.getpid())
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        code = _os_errno(err)
        if code == errno.ENOSPC:
            raise DeltafyError(f"ran out of disk space while writing {out}; nothing was written") from err
        if isinstance(err, OSError):
            raise DeltafyError(f"could not write {out}: {err.strerror or err}; nothing was written") from err
        if code is not None:
            raise DeltafyError(f"could not write {out}: {os.strerror(code)}; nothing was written") from err
        raise


def _move_into(src: Path, dest: Path) -> None:
    (dest / "config.json").unlink(missing_ok=True)
    # (deltafy 0.1 checkpoints also carried modeling_deltafy_inference.py and modeling_deltafy_native.py)
    stale = [
        *dest.glob("model*.safetensors"),
        *dest.glob("model*.safetensors.index.json"),
        *dest.glob("modeling_*.py"),
        *dest.glob(HEADS_FILE),
    ]
    for path in stale:
        path.unlink()
    entries = sorted(src.iterdir(), key=lambda p: p.name == "config.json")  # config.json last
    for entry in entries:
        target = dest / entry.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    src.rmdir()
