"""A training run's state in ``--out``: the guard on the folder, its lock, checkpoints that are
either complete or absent, and the signals that stop a run at a step it can resume from."""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import json
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import torch

from .errors import DeltafyError
from .modeling_deltafy import HEADS_FILE  # also the DDL heads of a LoRA run's checkpoint (save_heads)

LOCK_FILE = ".deltafy-lock"
STAGING_DIR = ".saving"  # inside STATE_DIR: checkpoints are written here, then renamed into place
KEEP_CHECKPOINTS = 2
TRAINER_STATE = "trainer_state.json"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_model.safetensors",
    "pytorch_model.bin",
    "adapter_model.bin",
)

# -- the --out folder --------------------------------------------------------------------------


def guard_out(out: Path, model_dir: str, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything is loaded, an ``--out`` that would destroy the input or a file."""
    model = Path(model_dir).expanduser().resolve()
    target = out.resolve()
    if target == model:
        raise DeltafyError(
            f"--out {out} is the input model folder: the trained model would replace it; choose another --out"
        )
    if target in model.parents:
        raise DeltafyError(
            f"--out {out} contains the input model folder {model_dir}: the run would write over it; "
            f"choose another --out"
        )
    if out.exists() and not out.is_dir():
        raise DeltafyError(f"--out {out} is a file, not a folder; choose another --out")
    if not (resume or overwrite) and holds_files(out):
        raise DeltafyError(
            f"{out} already holds files; pass --resume to continue that run, --overwrite to replace its "
            f"model and run state, or choose another --out"
        )


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
        """A run that failed before writing anything leaves no empty --out behind."""
        if self.created_out and self.out.is_dir() and not any(p.name != LOCK_FILE for p in self.out.iterdir()):
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


# -- checkpoints ------------------------------------------------------------------------------------


def step_of(path: Path) -> int:
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def checkpoints(state_dir: Path) -> list[Path]:
    """Checkpoint folders, newest first."""
    found = [p for p in state_dir.glob("checkpoint-*") if p.is_dir() and step_of(p) >= 0]
    return sorted(found, key=step_of, reverse=True)


def missing_parts(checkpoint: Path) -> list[str]:
    missing = [name for name in (TRAINER_STATE, "optimizer.pt", "scheduler.pt") if not (checkpoint / name).is_file()]
    if not any((checkpoint / name).is_file() for name in WEIGHT_FILES):
        missing.append("model weights")
    if (checkpoint / "adapter_config.json").is_file() and not (checkpoint / HEADS_FILE).is_file():
        missing.append(HEADS_FILE)
    return missing


def newest_complete(state_dir: Path) -> tuple[Path | None, list[tuple[Path, list[str]]]]:
    """The newest checkpoint that holds everything a resume needs, and the incomplete newer ones."""
    skipped = []
    for checkpoint in checkpoints(state_dir):
        missing = missing_parts(checkpoint)
        if not missing:
            return checkpoint, skipped
        skipped.append((checkpoint, missing))
    return None, skipped


def set_aside(checkpoint: Path) -> Path:
    """Move an incomplete checkpoint out of the way (the resumed run saves that step again)."""
    target = checkpoint.with_name(f"incomplete-{checkpoint.name}")
    shutil.rmtree(target, ignore_errors=True)
    os.replace(checkpoint, target)
    return target


def publish(staged: Path, final: Path) -> None:
    """Rename a fully written checkpoint into place, then keep the newest KEEP_CHECKPOINTS."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        staged.parent.rmdir()
    for stale in checkpoints(final.parent)[KEEP_CHECKPOINTS:]:
        shutil.rmtree(stale, ignore_errors=True)


def write_failure(err: BaseException, what: str, state_dir: Path) -> DeltafyError | None:
    """One line for a failed write (a full disk, a file-size limit), naming what is still usable."""
    from .folders import _os_errno

    code = _os_errno(err)
    if code is not None:
        reason = "ran out of disk space" if code == errno.ENOSPC else os.strerror(code)
    elif isinstance(err, RuntimeError) and "write" in str(err).lower():  # torch.save reports no errno
        reason = "the write failed (is the disk full?)"
    else:
        return None
    usable, _ = newest_complete(state_dir)
    keep = f"{usable} is still usable: free space and rerun with --resume" if usable else "no checkpoint was saved"
    return DeltafyError(f"could not write {what}: {reason}; {keep}")


def atomic_trainer():
    """A transformers Trainer whose checkpoints are written into STAGING_DIR and renamed into
    place once complete, so a kill or a full disk mid-save never leaves one that looks complete."""
    import torch.distributed as dist
    from transformers import Trainer

    class AtomicCheckpointTrainer(Trainer):
        _staging = False

        def train(self, *args, **kwargs):
            # deltafy compared the whole run before resuming (compare_records) and said what changed.
            log = logging.getLogger("transformers.trainer_utils")
            log.addFilter(_checked_already)
            try:
                return super().train(*args, **kwargs)
            finally:
                log.removeFilter(_checked_already)

        def _get_output_dir(self, trial) -> str:
            root = super()._get_output_dir(trial)
            return os.path.join(root, STAGING_DIR) if self._staging else root

        def _save_checkpoint(self, model, trial) -> None:
            root = Path(self.args.output_dir)
            name = f"checkpoint-{self.state.global_step}"
            staged = root / STAGING_DIR / name
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
            self._staging = True
            try:
                super()._save_checkpoint(model, trial)
                if dist.is_available() and dist.is_initialized():
                    dist.barrier()  # every rank has written its RNG state into the staged folder
                if self.args.should_save:
                    publish(staged, root / name)
            except BaseException as err:
                if self.args.should_save:
                    shutil.rmtree(staged.parent, ignore_errors=True)
                failure = write_failure(err, f"checkpoint {root / name}", root)
                if failure is not None:
                    raise failure from err
                raise
            finally:
                self._staging = False

        def _save(self, output_dir=None, state_dict=None) -> None:
            super()._save(output_dir, state_dict)
            if self.args.should_save and _is_peft(self.model):
                save_heads(self.model, Path(output_dir or self.args.output_dir))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            if _is_peft(model or self.model):
                load_heads(model or self.model, Path(resume_from_checkpoint))

        def _issue_warnings_after_load(self, load_result) -> None:
            # Tied weights (lm_head sharing the embedding) are saved once: their absence from a
            # checkpoint is expected, not the "missing keys" alarm transformers would print.
            params = dict(self.model.named_parameters(remove_duplicate=False))
            missing = set(load_result.missing_keys)

            def tied(key: str) -> bool:
                p = params.get(key)
                return p is not None and any(q is p and n not in missing for n, q in params.items() if n != key)

            real = [k for k in load_result.missing_keys if not tied(k)]
            if len(real) < len(load_result.missing_keys):
                self.model.tie_weights()
            super()._issue_warnings_after_load(load_result._replace(missing_keys=real))

    return AtomicCheckpointTrainer


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config")


def save_heads(model, folder: Path) -> None:
    """A LoRA-wrapped model's checkpoint is its adapter alone (peft saves only adapter tensors): the
    DDL heads that train beside it go into their own file, or a resume would restart them from init."""
    from safetensors.torch import save_file

    heads = {k: v.detach().contiguous() for k, v in model.state_dict().items() if ".delta." in k}
    save_file(heads, str(folder / HEADS_FILE))


def load_heads(model, folder: Path) -> None:
    from safetensors.torch import load_file

    if not (folder / HEADS_FILE).is_file():
        raise DeltafyError(f"{folder} holds no {HEADS_FILE}: its DDL heads were not saved, so it cannot be resumed")
    heads = load_file(str(folder / HEADS_FILE))
    result = model.load_state_dict(heads, strict=False)
    missing = [k for k in result.missing_keys if ".delta." in k]
    if result.unexpected_keys or missing:
        raise DeltafyError(f"the DDL heads in {folder / HEADS_FILE} do not fit this model; it cannot be resumed")


def _checked_already(record: logging.LogRecord) -> bool:
    return "do not match the ones in the `trainer_state.json`" not in record.getMessage()


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
