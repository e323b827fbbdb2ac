"""A training run's ``--out``: the guard on the folder, what ``--overwrite`` clears, ``metrics.jsonl``
and the run record a ``--resume`` is checked against (the checkpoints themselves:
deltafy.training.checkpoints; the run's lock on the folder: deltafy.sources.lock)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import DeltafyError
from ..files import ADAPTER_DIR, METRICS_FILE, RECORD_FILE, STAGING_DIR
from ..options import TrainOptions

# -- the --out folder --------------------------------------------------------------------------


def check_resume(resume: bool, overwrite: bool) -> None:
    """--resume keeps what --overwrite would replace: a run (or a bench) takes one of them."""
    if resume and overwrite:
        raise DeltafyError("--resume and --overwrite contradict each other; pass one of them")


def guard_out(out: Path, model_dir: str, resume: bool, overwrite: bool, reads=(), within=()) -> None:
    """Refuse, before anything is loaded, an ``--out`` that would destroy the input or the user's files:
    whatever the flags, one that is or holds the input model folder or another path the run reads
    (``reads``: its data, a base; ``within``: the base a heads-only output loads, which ``--out`` may
    not lie inside either); without --resume or --overwrite, one that holds files; with --overwrite,
    one that deltafy did not write."""
    from ..sources.folders import (
        check_writable,
        holds_files,
        is_output,
        refuse_bench,
        refuse_non_folder,
        refuse_overlap,
    )

    check_resume(resume, overwrite)
    refuse_overlap(out, [("the input model folder", Path(model_dir)), *reads], within)
    refuse_non_folder(out)
    if holds_files(out):
        if not (resume or overwrite):
            raise DeltafyError(
                f"{out} already holds files; pass --resume to continue that run, --overwrite to replace its "
                f"model and run state, or choose another --out"
            )
        refuse_bench(out, "--resume" if resume else "--overwrite")
        if not is_output(out):
            raise DeltafyError(
                f"{out} holds files that deltafy did not write (no deltafy config.json or run record): "
                f"{'--resume' if resume else '--overwrite'} applies only to a deltafy run's folder; choose another "
                f"--out"
            )
    check_writable(out)


def clear_run_state(out: Path, state_dir: Path, metrics: Path) -> None:
    """What ``--overwrite`` replaces: a previous run's checkpoints, record, metrics and adapter, so
    a later ``--resume`` can never pick up a checkpoint of the run that was overwritten."""
    shutil.rmtree(state_dir, ignore_errors=True)
    shutil.rmtree(out / ADAPTER_DIR, ignore_errors=True)
    metrics.unlink(missing_ok=True)


def remove_leftovers(out: Path, state_dir: Path, notice) -> None:
    """Half-written folders of killed runs on this ``--out`` (under its lock, so none is in use): a
    checkpoint's staging folder, and what a killed save left beside ``--out`` (clear_leftovers)."""
    from ..sources.folders import clear_leftovers

    staging = state_dir / STAGING_DIR
    if staging.is_dir() and any(staging.iterdir()):
        notice(f"removed {staging}, a checkpoint half-written by an interrupted run")
    shutil.rmtree(staging, ignore_errors=True)
    clear_leftovers(out)


# -- metrics.jsonl -------------------------------------------------------------------------------


def append_metrics(out: Path, record: dict) -> None:
    with open(out / METRICS_FILE, "a") as fh:
        fh.write(json.dumps(record) + "\n")


# -- the run record -------------------------------------------------------------------------------

# Settings a resumed run may change: they decide how long it runs and how often it reports or
# saves, not what a step computes. Every other recorded field must match the saved run.
CHANGEABLE = (
    "steps",
    "tokens",
    "eval_every",
    "save_every",
    "max_eval_blocks",
    "gradient_checkpointing",
    "merge_lora",
    "compile",
)


def model_identity(model_dir: str) -> str:
    """A cheap identity of a checkpoint folder: config.json's bytes (a conversion or a training run
    writes its provenance, with a timestamp, there) plus each weight file's size and safetensors
    header (names, dtypes, shapes, offsets). A full content hash would read every weight on every
    start and resume, minutes for a large model, to catch only a rewrite that kept config.json."""
    folder = Path(model_dir).expanduser()
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as fh:
            head = fh.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else 0
            digest.update(f"{file.name}:{file.stat().st_size}:".encode() + fh.read(min(length, 100_000_000)))
    return digest.hexdigest()[:24]


def run_record(model_dir: str, spec: dict, options, data: list[str], eval_data, data_fp: str, eval_fp) -> dict:
    recipe = {k: v for k, v in spec.get("recipe", {}).items() if k != "training"}  # its training: section is below
    return {
        "model": model_identity(model_dir),
        "model_dir": str(model_dir),
        "recipe": recipe,
        "data": data_fp,
        "data_sources": list(data),
        "eval_data": eval_fp,
        "eval_sources": list(eval_data or []),
        "options": options.model_dump(mode="json"),
    }


def read_record(state_dir: Path) -> dict | None:
    try:
        return json.loads((state_dir / RECORD_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise DeltafyError(f"could not read {state_dir / RECORD_FILE}: {err}; the run cannot be checked") from err


def write_record(state_dir: Path, record: dict) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{RECORD_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, state_dir / RECORD_FILE)


def compare_records(old: dict, new: dict, out: Path) -> list[str]:
    """Refuse a resume whose run is not the saved one; return what legitimately changed."""
    refused, changed = [], []
    if old["model"] != new["model"]:
        refused.append(f"model {old['model_dir']} → {new['model_dir']} (a different checkpoint)")
    if old["recipe"] != new["recipe"]:
        refused.append("conversion recipe")
    for key, sources in (("data", "data_sources"), ("eval_data", "eval_sources")):
        if old[key] != new[key]:
            before, after = ", ".join(old[sources]) or "none", ", ".join(new[sources]) or "none"
            what = f"{before} → {after}" if before != after else "the same inputs now hold different text"
            refused.append(f"--{key.replace('_', '-')} {what}")
    for key in sorted(set(old["options"]) | set(new["options"])):
        # A setting newer than the saved run's deltafy: that run had its default.
        default = TrainOptions.model_fields[key].default if key in TrainOptions.model_fields else None
        a, b = old["options"].get(key, default), new["options"].get(key, default)
        if a != b:
            (changed if key in CHANGEABLE else refused).append(f"--{key.replace('_', '-')} {a} → {b}")
    if refused:
        raise DeltafyError(
            f"cannot resume {out}: the run was started with other settings ({'; '.join(refused)}); rerun with "
            f"the original settings, or start a new run in another --out"
        )
    return changed
