"""Output folders: the guard on ``--out`` (never a folder the command reads, never the user's own
files), written atomically (a temporary folder renamed into place, or filled into an existing one;
leftovers of killed saves cleared by the next run), and the OS error behind a failed write."""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from .. import interrupts
from ..errors import DeltafyError, first_line
from ..files import BENCH_FILE, HEADS_FILE, LOCK_FILE, RECORD_FILE, STATE_DIR, owned
from .lock import refuse_live_run

log = logging.getLogger(__name__)


def output_path(out: str | Path) -> Path:
    """The folder an ``--out`` names: ``~`` expanded, and a symbolic link followed to where it points
    (that folder is written into, made or replaced; the link stays as it is). Replacing the link
    itself would leave the folder it points at as it was, and the link gone."""
    out = Path(out).expanduser()
    if not out.is_symlink():
        return out
    try:
        return Path(os.path.realpath(out, strict=True))
    except FileNotFoundError:  # a link to a folder yet to be made
        return Path(os.path.realpath(out))
    except OSError as err:
        raise DeltafyError(
            f"--out {out} is a symbolic link that cannot be followed ({err.strerror}); fix it or choose another --out"
        ) from err


def is_output(folder: Path) -> bool:
    """Whether ``folder`` is something deltafy wrote: a checkpoint (its config.json says deltafy), or
    a training run's --out (its run record), finished or not."""
    from .load import is_deltafy_folder

    return is_deltafy_folder(folder) or (folder / STATE_DIR / RECORD_FILE).is_file()


def refuse_bench(out: Path, flag: str) -> None:
    """A bench's folder is deltafy's but holds no model: a model written over it would sit among its runs."""
    if (out / BENCH_FILE).is_file():
        raise DeltafyError(
            f"{out} holds a deltafy bench ({BENCH_FILE}), not a model or a training run for {flag} to "
            f"{'continue' if flag == '--resume' else 'replace'}; choose another --out (or delete the bench first)"
        )


def holds_files(out: Path) -> bool:
    """Whether an --out folder holds anything but a run's lock: an output (or the user's files) is there."""
    return out.is_dir() and any(p.name != LOCK_FILE for p in out.iterdir())


def refuse_non_folder(out: Path) -> None:
    """An --out that exists as a file (or a device): every command's output is a folder."""
    if out.exists() and not out.is_dir():
        raise DeltafyError(f"--out {out} exists and is not a folder; choose another --out")


def check_output_dir(out: Path, overwrite: bool, merge: bool = False) -> bool:
    """Refuse early (before any heavy work) to write over something the user already has, and say
    whether the output replaces ``out`` (else it is new, or fills the existing folder). ``merge``: the
    output joins the files of ``out`` (a training run's own folder) instead of replacing them."""
    clear_leftovers(out)
    refuse_non_folder(out)
    held = holds_files(out)
    if held:
        if not overwrite:
            raise DeltafyError(f"{out} already holds files; choose an empty or new folder, or pass --overwrite")
        refuse_bench(out, "--overwrite")
        if not is_output(out):
            raise DeltafyError(
                f"--overwrite replaces only a folder deltafy wrote, and {out} is not one (no deltafy config.json or "
                f"run record); choose an empty or new --out"
            )
    replaces = held and not merge
    if replaces:
        refuse_live_run(out)
    if replaces and (fixed := _fixed(out)):
        raise DeltafyError(
            f"--overwrite replaces {out} with a new folder, which cannot be done to {fixed}; empty it first (an "
            f"empty folder is written into) or choose another --out"
        )
    check_writable(out, replaces)
    return replaces


def _fixed(folder: Path) -> str | None:
    """What keeps ``folder`` from being renamed away: a mount point cannot be, and the folder a command
    runs in can, but the shell that started it would be left in the deleted one."""
    if os.path.ismount(folder):
        return "a mount point"
    return "the folder this command runs in" if _same(_real(folder), _real(Path.cwd())) else None


def check_writable(out: Path, replaces: bool = False) -> None:
    """Refuse an --out that cannot be written (a read-only disk, no permission) before any work: an
    existing --out itself (the output is written into it), else the folder it is created in; and
    that folder too where the output ``replaces`` an existing --out (it is renamed there)."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    for folder in (out, parent) if replaces else (out,) if out.is_dir() else (parent,):  # (replaces: out exists)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".deltafy-probe-", dir=folder))
        except OSError as err:
            raise DeltafyError(
                f"cannot write --out {out}: {folder} is not writable ({err.strerror or err}); choose another --out"
            ) from err


def _real(path: Path) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _same(a: Path, b: Path) -> bool:
    """One folder under two spellings: the same resolved path, or the same device and inode (a bind
    mount, a second mount of one disk)."""
    if a == b:
        return True
    try:
        x, y = a.stat(), b.stat()
    except OSError:
        return False
    return (x.st_dev, x.st_ino) == (y.st_dev, y.st_ino)


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it, under any spelling of either."""
    return any(_same(p, folder) for p in (path, *path.parents))


def refuse_overlap(out: Path, reads: Iterable[tuple[str, Path]], within: Iterable[tuple[str, Path]] = ()) -> None:
    """Refuse, whatever the flags, an ``out`` that is one of the paths a command reads or holds one (a
    parent folder): writing or replacing it would destroy the input. ``within`` are read too, and
    ``out`` may not lie inside them either (the base a heads-only output loads, deltafy's cache)."""
    target = _real(out)
    for what, path, inside in [(w, p, False) for w, p in reads] + [(w, p, True) for w, p in within]:
        path = _real(path)
        if _same(target, path):
            problem = f"is {what} {path}: the output would replace it"
        elif _within(path, target):
            problem = f"contains {what} {path}: the output would replace it"
        elif inside and _within(target, path):
            problem = f"is inside {what} {path}, which this command reads: the output may not be written there"
        else:
            continue
        raise DeltafyError(f"--out {out} {problem}; choose another --out")


def _sibling(out: Path, kind: str, pid: int) -> Path:
    return out.parent / f".{out.name}.deltafy-{kind}-{pid}"


INSIDE = ".deltafy-partial-"  # the staging folder of a save into an existing folder, inside it


def _leftovers(out: Path) -> list[tuple[Path, str, str]]:
    """(path, kind, pid) of the folders that saves of ``out`` write before they publish: beside it, and
    inside it."""
    found = []
    if out.parent.is_dir():
        for path in sorted(out.parent.glob(f".{glob.escape(out.name)}.deltafy-*-*")):
            kind, _, pid = path.name.removeprefix(f".{out.name}.deltafy-").partition("-")
            found.append((path, kind, pid))
    if out.is_dir():
        found += [(path, "partial", path.name.removeprefix(INSIDE)) for path in sorted(out.glob(f"{INSIDE}*"))]
    return found


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
    """Remove what a killed save left beside ``out`` (``atomic_dir``'s temporary folders), so that
    nothing model-sized stays hidden there; refuse while the process that made them still runs.

    A save that was killed between its two renames left ``out`` missing and the previous ``out``
    in its ``-old-`` folder: that one is put back, not removed; and the user's own files that an
    overwrite had not yet moved back from it are put back into ``out``.
    """
    for path, kind, pid in _leftovers(out):
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
        if kind == "old":
            _keep_foreign(path, out)
        shutil.rmtree(path, ignore_errors=True)
        log.warning("removed %s, left by an interrupted save (process %s)", path, pid)


def _keep_foreign(old: Path, out: Path) -> None:
    """Move the entries of ``old`` that deltafy did not write into ``out`` (unless ``out`` has one of
    that name): an overwrite replaces deltafy's files only."""
    for entry in old.iterdir():
        if not owned(entry.name) and not os.path.lexists(out / entry.name):
            os.replace(entry, out / entry.name)


def _os_errno(err: BaseException) -> int | None:
    """The OS error code behind a failed write: an OSError's own, or the one safetensors (Rust)
    reports only in its message, e.g. "I/O error: No space left on device (os error 28)"."""
    if isinstance(err, OSError):
        return err.errno
    match = re.search(r"\(os error (\d+)\)", str(err)) if type(err).__name__ == "SafetensorError" else None
    return int(match.group(1)) if match else None


# torch.save reports a failed write without an errno: "PytorchStreamWriter failed writing file ...",
# "[enforce fail at inline_container.cc:...] . unexpected pos ...", or "basic_ios::clear: iostream error".
TORCH_WRITE_ERRORS = ("write", "iostream error", "inline_container", "unexpected pos")
LOW_SPACE = 64 << 20  # free bytes below which a write that failed without a reason is put down to a full disk
FULL_DISK = "ran out of disk space"  # how write_error's reason for a full disk starts


def write_error(err: BaseException, where: Path, need: int | None = None) -> str | None:
    """What went wrong when writing under ``where`` failed with ``err``, in words ("ran out of disk
    space (it needs about 560.4 kB, 307.2 kB free)"), or None when ``err`` is no write failure."""
    code = _os_errno(err)
    if code is None and isinstance(err, RuntimeError) and any(s in str(err).lower() for s in TORCH_WRITE_ERRORS):
        if free_space(where) >= LOW_SPACE:
            return f"the write failed ({first_line(err)})"
        code = errno.ENOSPC
    if code is None:
        return None
    if code in (errno.ENOSPC, errno.EDQUOT):
        needs = f"it needs about {size(need)}, " if need else ""
        return f"{FULL_DISK} ({needs}{size(free_space(where))} free)"
    return os.strerror(code) if not isinstance(err, OSError) else (err.strerror or os.strerror(code))


def free_space(where: Path) -> int:
    where = Path(where)
    while not where.exists() and where != where.parent:
        where = where.parent
    return shutil.disk_usage(where).free


def size(nbytes: float) -> str:
    """A size people read at a glance: 512 B, 3.4 MB, 1.21 GB (never "0.0 GiB" for a small one)."""
    from .cache import human_size

    return human_size(nbytes)


@contextmanager
def atomic_dir(out: Path, overwrite: bool, merge: bool = False, need: int | None = None):
    """Yield a temporary folder; on success it becomes ``out``, on any failure it is removed. A new
    ``out``, or one it replaces (--overwrite), is a sibling renamed into place. An existing folder
    that is empty, or that ``merge`` writes into, is staged inside and filled, config.json last: a
    folder made for the output, the one the command runs in, a container's mounted volume keep their
    identity (a mount point cannot be renamed, nor moved across into). ``need``: about how many bytes
    the output takes, for the message of a full disk."""
    inside = not check_output_dir(out, overwrite, merge) and out.is_dir()
    tmp = out / f"{INSIDE}{os.getpid()}" if inside else _sibling(out, "partial", os.getpid())
    with interrupts.unwinding(), _replacing(tmp, out, inside, need):
        yield tmp


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
def _replacing(tmp: Path, out: Path, inside: bool, need: int | None):
    try:  # (from its creation on: an interrupt right after the mkdir must not leave it behind)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        yield tmp
        readable(tmp)
        with interrupts.deferred():  # the folder changes hands in one piece, whatever signal comes
            if inside:
                _move_into(tmp, out)
                return
            old = None
            if out.exists():
                refuse_live_run(out)  # (again: a run may have started on it while this one worked)
                old = _sibling(out, "old", os.getpid())
                os.replace(out, old)
            os.replace(tmp, out)
            if old is not None:
                _keep_foreign(old, out)
                shutil.rmtree(old, ignore_errors=True)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        reason = write_error(err, out.parent, need)
        if reason is not None:
            remedy = "free space or choose another --out" if reason.startswith(FULL_DISK) else "choose another --out"
            raise DeltafyError(f"could not write {out}: {reason}; nothing was written: {remedy}") from err
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
