"""The OS lock a deltafy run (a training run, a bench) holds on its ``--out`` for as long as it runs:
taken without waiting, named with its holder (pid, host, start, command), released by the kernel
with the process; and the refusal to replace a folder that a live run holds."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import shutil
import socket
import sys
from pathlib import Path

from ..errors import DeltafyError
from ..files import LOCK_FILE, RECORD_FILE


def try_lock(fd: int) -> bool:
    """Take the exclusive OS lock on the open file ``fd`` without waiting: False where another process
    holds it. The kernel drops it with the file's last descriptor, or with the process."""
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError:
            return False
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise DeltafyError(f"could not lock {fd}: {err.strerror}") from err
    return True


def lock_holder(path: Path) -> str:
    """Who holds a run's lock file, as the run wrote it there."""
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said which yet"


def in_use(out: Path) -> str:
    """The message for a folder that another run holds."""
    holder = lock_holder(out / LOCK_FILE)
    return f"{out} is in use by another deltafy run ({holder}); wait for it to finish or choose another --out"


def refuse_live_run(out: Path) -> None:
    """Refuse to replace a folder that a deltafy run (a training run, a bench) holds locked: it would
    go on writing checkpoints into a deleted folder, and its end would fail."""
    try:
        fd = os.open(out / LOCK_FILE, os.O_RDWR)
    except OSError:  # no lock file: no run holds the folder
        return
    try:
        free = try_lock(fd)
    finally:
        os.close(fd)  # (and with it the lock, where this took it)
    if not free:
        raise DeltafyError(in_use(out))


class RunLock:
    """An OS lock on ``OUT/.deltafy-lock`` for the whole run: a second run on the same ``--out`` is
    refused, and a crash or kill releases it (the kernel drops the lock with the process)."""

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / LOCK_FILE
        self.fd = None
        self.created_out = False

    def __enter__(self) -> RunLock:
        self.created_out = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise DeltafyError(f"could not create --out {self.out}: {err.strerror or err}") from err
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:  # a folder that exists but cannot be written in
                self._cleanup_out()
                raise DeltafyError(
                    f"cannot write --out {self.out}: {err.strerror or err}; choose another --out"
                ) from err
            if not try_lock(fd):
                message = in_use(self.out)
                os.close(fd)
                self._cleanup_out()
                raise DeltafyError(message)
            # A run that finished unlinks the file; the lock we got may be on that unlinked inode.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.fd = fd
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": " ".join(["deltafy", *sys.argv[1:]]),
        }
        os.ftruncate(fd, 0)
        os.write(fd, (json.dumps(holder) + "\n").encode())
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # before the unlock: a waiting run then retries on a new file
        os.close(self.fd)
        self.fd = None
        self._cleanup_out()

    def _cleanup_out(self) -> None:
        """A run that failed or was interrupted before it trained a step leaves no --out behind (it held
        only the lock and the run's record: nothing to resume from)."""
        if not (self.created_out and self.out.is_dir()):
            return
        kept = [p for p in self.out.rglob("*") if p.is_file() and p.name not in (LOCK_FILE, RECORD_FILE)]
        if not kept:
            shutil.rmtree(self.out, ignore_errors=True)
