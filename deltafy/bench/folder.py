"""The bench folder: the guard on it, and ``bench.json``, the state a resumed bench continues from
(its settings must be the ones it was started with)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import DeltafyError
from ..files import BENCH_FILE
from ..files import BENCH_PLOT as PLOT_FILE

OWNED = ("models", "runs", BENCH_FILE, PLOT_FILE)  # what --overwrite replaces; nothing else in the folder
FORMAT = 1


def guard(out: Path, resume: bool, overwrite: bool) -> dict | None:
    """The bench saved in ``out`` when resuming, after refusing what would write over the user's files."""
    from ..sources.folders import check_writable, holds_files, refuse_non_folder

    refuse_non_folder(out)
    check_writable(out)
    saved = read(out / BENCH_FILE)
    if not holds_files(out):
        return None
    theirs = [name for name in OWNED if (out / name).exists()] if saved is None else []
    if theirs:  # not a bench's: --overwrite would delete the user's own folder of that name
        raise DeltafyError(
            f"{out} holds {theirs[0]} but no {BENCH_FILE}, so it is not a bench deltafy wrote; choose another --out "
            f"(whatever the flags, a bench replaces its own {', '.join(OWNED)} only)"
        )
    if overwrite:
        return None
    if saved is None:
        raise DeltafyError(
            f"{out} already holds files and no {BENCH_FILE}; choose another --out, or pass --overwrite to bench "
            f"there anyway (it adds models/, runs/, {BENCH_FILE} and {PLOT_FILE} and leaves the rest alone)"
        )
    if not resume:
        raise DeltafyError(
            f"{out} holds a bench already; pass --resume to continue it (its finished runs are kept), --overwrite "
            f"to start over, or choose another --out"
        )
    return saved


def converted(source: str, folder: Path, recipe: str, status) -> Path:
    """The starting point of every arm of ``recipe``: converted once, kept for a resume."""
    from ..conversion.job import convert_source

    if not (folder / "config.json").is_file():  # a save is atomic: config.json means complete
        status(f"converting {source} with recipe {recipe}")
        convert_source(source, folder, recipe=recipe, overwrite=True, status=status)
    return folder


def read(path: Path) -> dict | None:
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DeltafyError(f"could not read {path}: {err}; pass --overwrite to start the bench over") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT or "settings" not in state:
        raise DeltafyError(f"{path} is not a bench this deltafy wrote; pass --overwrite to start the bench over")
    return state


_RECORDED_ONLY = ("device", "preset")  # what ran, not what the runs are: a bench may resume elsewhere


def compare(old: dict, new: dict, out: Path) -> None:
    changed = [
        f"--{key.replace('_', '-')} {show(old.get(key))} → {show(new[key])}"
        for key in new
        if key in old and old[key] != new[key] and not key.endswith("_fingerprint") and key not in _RECORDED_ONLY
    ]
    changed += [  # where the paths are the same: an edited file
        f"--{key.removesuffix('_fingerprint').replace('_', '-')}: the same inputs now hold different text"
        for key in new
        if key.endswith("_fingerprint")
        and key in old
        and old[key] != new[key]
        and old.get(key.removesuffix("_fingerprint")) == new.get(key.removesuffix("_fingerprint"))
    ]
    if changed:
        raise DeltafyError(
            f"{out} holds a bench run with other settings ({'; '.join(changed)}); rerun with its settings, pass "
            f"--overwrite to start over, or choose another --out"
        )


def show(value) -> str:
    if isinstance(value, list):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value) or "none"
    return "default" if value is None else str(value)


def clear(out: Path) -> None:
    """What ``--overwrite`` replaces: the bench's own entries, never the user's other files."""
    for name in OWNED:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def write(path: Path, state: dict) -> None:
    """Atomically: a kill mid-write leaves the previous state, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        os.replace(tmp, path)
    finally:  # (an interrupt mid-write: no temporary file stays beside it)
        tmp.unlink(missing_ok=True)
