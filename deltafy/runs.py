"""A training run's hold on ``--out``: the guard on the folder, its lock, and the signals that stop
a run at a step it can resume from (the checkpoints themselves: deltafy.resume)."""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import torch

from .errors import DeltafyError
from .resume import STAGING_DIR
from .train import RECORD_FILE

LOCK_FILE = ".deltafy-lock"

# -- the --out folder --------------------------------------------------------------------------


def guard_out(out: Path, model_dir: str, resume: bool, overwrite: bool, reads=(), within=()) -> None:
    """Refuse, before anything is loaded, an ``--out`` that would destroy the input or the user's files:
    whatever the flags, one that is or holds the input model folder or another path the run reads
    (``reads``: its data, a base; ``within``: the base a heads-only output loads, which ``--out`` may
    not lie inside either); without --resume or --overwrite, one that holds files; with --overwrite,
    one that deltafy did not write."""
    from .folders import check_writable, is_output, refuse_overlap

    refuse_overlap(out, [("the input model folder", Path(model_dir)), *reads], within)
    if out.exists() and not out.is_dir():
        raise DeltafyError(f"--out {out} is a file, not a folder; choose another --out")
    if holds_files(out):
        if not (resume or overwrite):
            raise DeltafyError(
                f"{out} already holds files; pass --resume to continue that run, --overwrite to replace its "
                f"model and run state, or choose another --out"
            )
        if not is_output(out):
            raise DeltafyError(
                f"{out} holds files that deltafy did not write (no deltafy config.json or run record): "
                f"{'--resume' if resume else '--overwrite'} applies only to a deltafy run's folder; choose another "
                f"--out"
            )
    check_writable(out)


def holds_files(out: Path) -> bool:
    return out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir())


def clear_run_state(out: Path, state_dir: Path, metrics: Path) -> None:
    """What ``--overwrite`` replaces: a previous run's checkpoints, record, metrics and adapter, so
    a later ``--resume`` can never pick up a checkpoint of the run that was overwritten."""
    shutil.rmtree(state_dir, ignore_errors=True)
    shutil.rmtree(out / "lora-adapter", ignore_errors=True)
    metrics.unlink(missing_ok=True)


def remove_leftovers(out: Path, state_dir: Path, notice) -> None:
    """Half-written folders of killed runs on this ``--out`` (under its lock, so none is in use): a
    checkpoint's staging folder, and what a killed save left beside ``--out`` (clear_leftovers)."""
    from .folders import clear_leftovers

    staging = state_dir / STAGING_DIR
    if staging.is_dir() and any(staging.iterdir()):
        notice(f"removed {staging}, a checkpoint half-written by an interrupted run")
    shutil.rmtree(staging, ignore_errors=True)
    clear_leftovers(out)


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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_lock(fd):
                holder = _read_holder(self.path)
                os.close(fd)
                self._cleanup_out()
                raise DeltafyError(
                    f"{self.out} is in use by another deltafy run ({holder}); wait for it to finish or choose "
                    f"another --out"
                )
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


def _try_lock(fd: int) -> bool:
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


def _read_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        return f"pid {holder['pid']} on {holder['host']}, started {holder['started']}: {holder['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has not said which yet"


# -- signals --------------------------------------------------------------------------------------


class Stop:
    """SIGINT and SIGTERM during training: the first asks the run to save and stop at the next step
    boundary, a second aborts at once. Outside training both abort at once (nothing to save).

    In a distributed run every rank stops at the same step: the ranks agree on the flag each step,
    since a rank that left the loop alone would leave the others waiting in a collective forever.
    """

    def __init__(self):
        self.signal: int | None = None
        self.training = False
        self.previous = {}

    def __enter__(self) -> Stop:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                self.previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: signals stay Python's
                break
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if not self.training or self.signal is not None:
            from .interrupts import note

            note(signum)
            raise KeyboardInterrupt
        self.signal = signum

    def requested(self) -> bool:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.signal is not None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([0 if self.signal is None else self.signal], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and self.signal is None:
            self.signal = int(flag.item())
        return bool(flag.item())
