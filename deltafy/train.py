"""Train a converted model's DDL heads (optionally with LoRA) with the transformers Trainer.

The Trainer brings gradient accumulation, schedules, DDP under torchrun / accelerate, bf16
autocast, gradient checkpointing and exact resumption; deltafy adds what is specific to DDL: which
parameters train, the gate's own learning rate, a clean output folder, and the run record that
``--resume`` checks (a resume with other data or settings would silently train another run).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import DeltafyError, first_line
from .folders import readable
from .modeling_deltafy import delta_sites, mean_betas
from .recipe import TrainingDefaults, format_validation

Mode = Literal["heads", "heads+lora", "lora", "all"]
STATE_DIR = "training"  # resumable Trainer checkpoints, inside --out
METRICS_FILE = "metrics.jsonl"
RECORD_FILE = "run.json"  # inside STATE_DIR: the settings a --resume must match

# Settings a resumed run may change: they decide how long it runs and how often it reports or
# saves, not what a step computes. Every other recorded field must match the saved run.
CHANGEABLE = ("steps", "tokens", "eval_every", "save_every", "max_eval_blocks", "gradient_checkpointing", "merge_lora")


class LaunchOptions(BaseModel):
    """How a run is spread over processes and devices: not a recipe's business (the same recipe
    trains on one GPU or on sixteen), so these are flags only, never in a ``training:`` section."""

    model_config = ConfigDict(extra="forbid")

    fsdp: bool = Field(
        False,
        description="shard the model (frozen base, heads, LoRA) over the processes of a torchrun / accelerate "
        "launch with FSDP2, one unit per decoder layer, instead of a full copy on each (DDP)",
    )


class TrainOptions(TrainingDefaults, LaunchOptions):
    """Every ``deltafy train`` setting: the recipe's training defaults plus the launch options."""


def options_from(recipe_training: dict | None, **flags) -> TrainOptions:
    """A recipe's ``training`` section overlaid by explicit flags (``None`` flags keep the recipe's).

    Every bad value is reported at once, named where the user can fix it: ``--seq-len`` for a
    flag, ``training.seq_len`` for the recipe's section.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    try:
        return TrainOptions.model_validate({**(recipe_training or {}), **given})
    except ValidationError as err:

        def where(loc: tuple) -> str:
            if loc and loc[0] in given:
                return "--" + str(loc[0]).replace("_", "-")
            return ".".join(map(str, ("training", *loc)))

        raise DeltafyError(f"invalid training options: {format_validation(err, where)}") from err


@dataclass
class TrainResult:
    steps: int
    loss_before: float
    loss_after: float
    seconds_per_step: float
    trainable_params: int
    mean_beta_per_layer: list[float] = field(default_factory=list)
    out: Path | None = None
    already_finished: bool = False  # a resume found the run done: nothing trained, the losses are its summary's


def select_trainable(model, mode: Mode, options: TrainOptions):
    """Freeze what must not train; wrap in LoRA when asked. Returns (model, optimizer groups)."""
    from .recipe import Recipe
    from .surgery import head_parameter_groups

    recipe = Recipe.model_validate(model.config.deltafy["recipe"]).model_copy(update={"training": options})
    for p in model.parameters():
        p.requires_grad_(False)
    groups = []
    if mode in ("heads+lora", "lora"):
        model = _with_lora(model, options)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        groups.append({"params": lora, "lr": options.lora_lr, "weight_decay": options.weight_decay, "name": "lora"})
    if mode in ("heads", "heads+lora", "all"):
        head_groups = head_parameter_groups(model, recipe)
        groups += head_groups
    if mode == "all":
        heads = {id(p) for g in groups for p in g["params"]}
        base = [p for p in model.parameters() if id(p) not in heads]
        groups.append({"params": base, "lr": options.lora_lr, "weight_decay": options.weight_decay, "name": "base"})
    for group in groups:
        for p in group["params"]:
            p.requires_grad_(True)
    return model, [g for g in groups if g["params"]]


def _with_lora(model, options: TrainOptions):
    from peft import LoraConfig, get_peft_model
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    defaults = TARGETS.get(model.config.deltafy["base_model_type"])
    targets = options.lora_targets or defaults
    if not targets:
        raise DeltafyError("peft has no default LoRA targets for this family; pass --lora-targets")
    config = LoraConfig(
        r=options.lora_r,
        lora_alpha=options.lora_alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    _refuse_site_modules(model, config, defaults)
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        raise DeltafyError(f"LoRA: {first_line(err)} (check --lora-targets)") from err


def _refuse_site_modules(model, config, defaults) -> None:
    """LoRA must not wrap a module whose forward deltafy wraps: peft would add its update after
    the site saw the write (or the context), so the model trained would not be the model merged."""
    from peft.tuners.tuners_utils import check_target_module_exists

    spec = model.config.deltafy
    for name, _ in model.get_submodule(spec["layers"]).named_children():
        for site in spec["sites"]:
            watched = [site["write"]]
            if site.get("stream") and site.get("context") != "input":  # the heads read its output
                watched.append(site["stream"])
            for module in watched:
                if check_target_module_exists(config, f"{spec['layers']}.{name}.{module}"):
                    hint = f" (peft's default here: {','.join(defaults)})" if defaults else ""
                    raise DeltafyError(
                        f"--lora-targets: LoRA on {module!r} would bypass the DDL correction of the "
                        f"{site['name']!r} site, which wraps that module; target modules inside the sublayer{hint}"
                    )


def unwrap_lora(model, merge: bool, adapter_dir: Path | None = None):
    """The plain deltafy model after LoRA training: the adapters merged into its weights, or (first
    saved to ``adapter_dir`` when given) removed, leaving the base weights as they were.

    ``get_base_model()`` would not do for the second case: peft injects its layers into the base
    model in place, so that model still holds ``base_layer``/``lora_A`` tensors and saves them.
    """
    if not hasattr(model, "peft_config"):
        return model
    if merge:
        return model.merge_and_unload()
    if adapter_dir is not None:
        model.save_pretrained(adapter_dir)
        readable(adapter_dir)
    return model.unload()


def site_betas(model, blocks: torch.Tensor) -> dict[str, float]:
    """Mean beta per site (qualified name) on a few blocks."""
    model.eval()
    with torch.no_grad():
        return mean_betas(model, lambda: model(input_ids=blocks[:4].to(next(model.parameters()).device)))


def per_layer(betas: dict[str, float]) -> list[float]:
    """Site betas averaged over each layer's sites, in layer order."""
    layers: dict[int, list[float]] = {}
    for name, value in betas.items():
        layers.setdefault(int(name.split(".delta.")[0].rsplit(".", 1)[1]), []).append(value)
    return [sum(v) / len(v) for _, v in sorted(layers.items())]


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def append_metrics(out: Path, record: dict) -> None:
    with open(out / METRICS_FILE, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def read_metrics(metrics_file: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (as append_metrics wrote them)."""
    records = []
    try:
        lines = Path(metrics_file).read_text().splitlines()
    except OSError as err:
        raise DeltafyError(f"could not read {metrics_file}: {err.strerror or err}") from err
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a killed run: the others still count
        if isinstance(record, dict):
            records.append(record)
    return records


def run_summary(records: list[dict]) -> dict:
    """The last summary record (held-out loss before and after, mean beta per layer), or {}."""
    return next((r for r in reversed(records) if r.get("event") == "summary"), {})


def planned_steps(options: TrainOptions, world_size: int) -> int:
    if options.steps:
        return options.steps
    if options.tokens:
        per_step = options.seq_len * options.batch_size * options.grad_accum * world_size
        return max(1, math.ceil(options.tokens / per_step))
    return 200


def check_seq_len(config: dict, seq_len: int) -> None:
    """A block longer than the model's positions: GPT-2 would fail with an IndexError mid-run, a
    rotary model would train silently on positions it never saw."""
    from .evaluate import position_limit

    found = position_limit(config)
    if found is not None and seq_len > found[1]:
        key, limit = found
        raise DeltafyError(
            f"--seq-len {seq_len} is longer than the model's {limit} positions ({key}); pass --seq-len {limit} or less"
        )


# -- the run record -------------------------------------------------------------------------------


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


__all__ = ["TrainOptions", "TrainResult", "options_from", "select_trainable", "unwrap_lora", "delta_sites"]
