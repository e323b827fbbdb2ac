"""Resumable checkpoints of a training run: what they hold (only the tensors that train, never a
copy of the frozen base), written into a staging folder and renamed into place so that each one is
complete or absent, and found again (the newest complete one) by ``--resume``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from ..errors import DeltafyError, out_of_memory
from ..files import HEADS_FILE, STAGING_DIR  # HEADS_FILE: also the trained heads in a checkpoint (save_trainable)
from ..sources.folders import readable
from .launch import is_main_process
from .sharding import barrier

KEEP_CHECKPOINTS = 2
TRAINER_STATE = "trainer_state.json"
MODEL_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The Trainer's optimizer state; under FSDP, accelerate's (one file, or a folder of shards). DeepSpeed's: see
# _deepspeed_state.
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin", "optimizer_0")


# -- checkpoints ------------------------------------------------------------------------------------


def step_of(path: Path) -> int:
    tail = path.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def checkpoints(state_dir: Path) -> list[Path]:
    """Checkpoint folders, newest first."""
    found = [p for p in state_dir.glob("checkpoint-*") if p.is_dir() and step_of(p) >= 0]
    return sorted(found, key=step_of, reverse=True)


def missing_parts(checkpoint: Path) -> list[str]:
    """What a resume needs and ``checkpoint`` lacks. A run whose base is frozen keeps only what
    trains: the DDL heads (HEADS_FILE) and, for LoRA, peft's adapter beside them; ``train: all``
    and the checkpoints of earlier deltafy versions hold the whole model."""
    missing = [name for name in (TRAINER_STATE, "scheduler.pt") if not (checkpoint / name).is_file()]
    if not any((checkpoint / name).exists() for name in OPTIMIZER_FILES) and not _deepspeed_state(checkpoint):
        missing.insert(1, OPTIMIZER_FILES[0])
    if (checkpoint / "adapter_config.json").is_file():
        if not any((checkpoint / name).is_file() for name in ADAPTER_FILES):
            missing.append("adapter weights")
        if not (checkpoint / HEADS_FILE).is_file():
            missing.append(HEADS_FILE)
    elif not any((checkpoint / name).is_file() for name in (*MODEL_FILES, HEADS_FILE)):
        missing.append("model weights")
    return missing


def _deepspeed_state(checkpoint: Path) -> bool:
    """Whether DeepSpeed's engine state (its optimizer's partitions) is there: ``latest`` names the
    folder it wrote, and is written after it."""
    latest = checkpoint / "latest"
    return latest.is_file() and (checkpoint / latest.read_text().strip()).is_dir()


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


def resume_point(out: Path, state_dir: Path, notice) -> Path:
    """The checkpoint a --resume continues from: the newest complete one, the incomplete ones after
    it set aside (by the main process) and named; none at all is an error that says why."""
    checkpoint, skipped = newest_complete(state_dir)
    if checkpoint is None:
        if skipped:
            names = ", ".join(f"{p.name} (no {', '.join(m)})" for p, m in skipped)
            raise DeltafyError(
                f"nothing to resume in {out}: every checkpoint is incomplete: {names}; start over with --overwrite"
            )
        raise DeltafyError(f"nothing to resume in {out}: no checkpoint was saved there yet")
    for path, missing in skipped:
        aside = set_aside(path) if is_main_process() else path
        notice(
            f"skipping {path.name}: incomplete (no {', '.join(missing)}; an interrupted save), moved to "
            f"{aside.name}; resuming from {checkpoint.name}"
        )
    return checkpoint


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


def write_failure(err: BaseException, what: str, state_dir: Path, need: int | None = None) -> DeltafyError | None:
    """One line for a failed write (a full disk, a file-size limit, memory running out while it was written),
    naming what is still usable."""
    from ..sources.folders import FULL_DISK, write_error

    memory = out_of_memory(err)
    reason = write_error(err, state_dir, need) or memory
    if reason is None:
        return None
    usable, _ = newest_complete(state_dir)
    first = "free space and " if reason.startswith(FULL_DISK) else "free memory and " if memory else ""
    rerun = f"{first}rerun with --resume"
    keep = f"{usable} is still usable: {rerun}" if usable else "no checkpoint was saved"
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
                    barrier()  # every rank has written its RNG state into the staged folder
                if self.args.should_save:
                    publish(staged, root / name)
            except BaseException as err:
                if self.args.should_save:
                    shutil.rmtree(staged.parent, ignore_errors=True)
                previous, _ = newest_complete(root)  # as big as this one would have been
                need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) if previous else None
                failure = write_failure(err, f"checkpoint {root / name}", root, need)
                if failure is not None:
                    raise failure from err
                raise
            finally:
                self._staging = False

        def unwrapped(self, model):
            """The model itself: no DDP, DeepSpeed or torch.compile (--compile) wrapper, which add to its names."""
            return self.accelerator.unwrap_model(model, keep_torch_compile=False)

        def save_model(self, output_dir=None, _internal_call=False) -> None:
            if not self._staging or not frozen_base(self.model):
                return super().save_model(output_dir, _internal_call)
            # A checkpoint of a frozen base holds what trains, not a copy of the base (GBs a save).
            state = trainable_state(self.model, sharded=self.is_fsdp_enabled)  # every rank: a gather
            if self.args.should_save:
                save_trainable(self.unwrapped(self.model), state, Path(output_dir))

        def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
            if self.is_deepspeed_enabled and frozen_base(self.model):
                # DeepSpeed's engine state would also hold each rank's partition of the frozen base.
                self.model_wrapped.save_checkpoint(output_dir, exclude_frozen_parameters=True)
                if self.args.should_save:
                    torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
                return
            if not (self.is_fsdp_enabled and frozen_base(self.model)):
                return super()._save_optimizer_and_scheduler(output_dir)
            # What the Trainer does under FSDP, less save_fsdp_model: another whole copy of the base.
            from accelerate.utils import save_fsdp_optimizer

            plugin = self.accelerator.state.fsdp_plugin
            save_fsdp_optimizer(plugin, self.accelerator, self.optimizer, self.model, output_dir)
            if self.args.should_save:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
            model = model if model is not None else self.model
            if not frozen_base(model):  # train: all, whose checkpoints are the whole model
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
            load_trainable(model, self.unwrapped(model), Path(resume_from_checkpoint), self.is_fsdp_enabled)

        def _load_optimizer_and_scheduler(self, checkpoint) -> None:
            super()._load_optimizer_and_scheduler(checkpoint)
            # The optimizer comes back at the rate the saved schedule gave its last step. A resume that changed
            # --steps or --tokens has a schedule of another length: the next step takes that one's rate (else a
            # finished cosine run extended would train its first added step at 0).
            scheduler = self.lr_scheduler
            if checkpoint is not None and isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                rates = [
                    base * rate(scheduler.last_epoch)
                    for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
                ]
                for group, lr in zip(self.optimizer.param_groups, rates, strict=True):
                    group["lr"] = lr
                scheduler._last_lr = rates  # what it reports (the logged lr), as torch's own step() sets it

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


# -- what a checkpoint of a frozen base holds ------------------------------------------------------

# Wrappers FSDP (use_orig_params), activation checkpointing and torch.compile put into parameter names.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def frozen_base(model) -> bool:
    """Whether some of the model does not train (every mode but ``train: all``): then a checkpoint
    holds the trainable tensors alone, since the rest is what the run loaded and never changes."""
    return any(not p.requires_grad for p in model.parameters())


def _name(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


def trainable_state(model, sharded: bool = False) -> dict[str, torch.Tensor]:
    """The tensors that train, whole and on the CPU, under the names of the unwrapped model. A
    sharded (FSDP) model's are gathered from their shards: every rank must call this, and only the
    first gets them; the frozen base is never gathered. ZeRO-3's partitions are gathered too (on
    every rank, which must all call this as well)."""
    if not sharded:
        from .sharding import gather_trained

        return {_name(n): value.contiguous() for n, value in gather_trained(model).items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return get_model_state_dict(model, options=options)


def _is_adapter(key: str) -> bool:
    return "lora_" in key  # peft's LoRA tensors, as select_trainable finds them


def save_trainable(model, state: dict[str, torch.Tensor], folder: Path) -> None:
    """``state`` (trainable_state) into ``folder``: a LoRA adapter as peft saves it (so peft can
    read it), every other trainable tensor (the DDL heads) in HEADS_FILE."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if _is_peft(model):
        model.save_pretrained(str(folder), state_dict={k: v for k, v in state.items() if _is_adapter(k)})
    heads = {k: v for k, v in state.items() if not _is_adapter(k)}
    save_file(heads, str(folder / HEADS_FILE), metadata={"format": "pt"})
    readable(folder)


def load_trainable(model, unwrapped, folder: Path, sharded: bool = False) -> None:
    """Put a checkpoint's trainable tensors back into ``model`` (wrapped or not; ``unwrapped`` is the
    model itself), refusing one whose tensors do not fit it. Reads the format save_trainable writes
    and the whole-model ``model.safetensors`` of earlier versions, taking only what trains from it."""
    expected = _trainable_shapes(model, sharded)
    saved = _read_trainable(unwrapped, folder, expected)
    known = {_name(n) for n, _ in unwrapped.named_parameters(remove_duplicate=False)}
    missing = [k for k in expected if k not in saved]
    unknown = [k for k in saved if k not in known]
    misshapen = [k for k in expected if k in saved and tuple(saved[k].shape) != expected[k]]
    if missing or unknown or misshapen:
        odd = (missing or unknown or misshapen)[0]
        what = (
            "missing"
            if missing
            else "not in this model"
            if unknown
            else f"of shape {tuple(saved[odd].shape)}, the model's is {expected[odd]}"
        )
        raise DeltafyError(
            f"the trained tensors in {folder} do not fit this model ({len(missing)} missing, {len(unknown)} "
            f"unknown, {len(misshapen)} of another shape; e.g. {odd}, {what}); it cannot be resumed"
        )
    odd = next((k for k in expected if not saved[k].is_floating_point()), None)
    if odd is not None:  # load_state_dict would cast an integer tensor into the parameter without a word
        raise DeltafyError(
            f"the trained tensor {odd} in {folder} is {str(saved[odd].dtype).removeprefix('torch.')}, not a "
            f"floating-point tensor; it cannot be resumed"
        )
    # Only what trains is loaded: a frozen tensor a checkpoint also holds is the value the run loaded.
    state = {k: saved[k] for k in expected}
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        unwrapped.load_state_dict(state, strict=False)


def _trainable_shapes(model, sharded: bool) -> dict[str, tuple[int, ...]]:
    """Names and whole shapes of the trainable tensors (a shard's global shape under FSDP)."""
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    else:
        state = {_name(n): p for n, p in model.named_parameters() if p.requires_grad}
    return {k: tuple(v.size()) for k, v in state.items()}


def _read_trainable(model, folder: Path, expected: dict) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    if (folder / HEADS_FILE).is_file():
        saved = load_file(str(folder / HEADS_FILE))
        if (folder / "adapter_config.json").is_file() and _is_peft(model):
            saved.update(_read_adapter(model, folder, expected))
        return saved
    # An earlier version's checkpoint: the whole model, of which only the trainable tensors are read.
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        shards = dict.fromkeys(expected, "model.safetensors")
    else:
        raise DeltafyError(f"{folder} holds neither {HEADS_FILE} nor model.safetensors; it cannot be resumed")
    saved = {}
    for shard in sorted({shards[k] for k in expected if k in shards}):
        with safe_open(str(folder / shard), framework="pt") as f:
            held = set(f.keys())
            saved.update({k: f.get_tensor(k) for k in expected if shards.get(k) == shard and k in held})
    return saved


def _read_adapter(model, folder: Path, expected: dict) -> dict[str, torch.Tensor]:
    """peft's adapter file, under the model's own names: peft drops the adapter's name from its
    keys, and its own key mapping, applied to placeholders of the model's keys, gives them back."""
    from peft import get_peft_model_state_dict
    from peft.utils import load_peft_weights

    placeholders = {k: torch.empty(0) for k in expected if _is_adapter(k)}
    stripped = get_peft_model_state_dict(model, state_dict=placeholders, save_embedding_layers=False)
    names = {id(v): k for k, v in placeholders.items()}
    to_model = {key: names[id(v)] for key, v in stripped.items()}
    return {to_model.get(k, k): v for k, v in load_peft_weights(str(folder), device="cpu").items()}


def _checked_already(record: logging.LogRecord) -> bool:
    return "do not match the ones in the `trainer_state.json`" not in record.getMessage()
