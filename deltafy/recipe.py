"""The recipe: what a conversion builds (direction, gate, sites, channels) and the training defaults
it carries, read from a YAML file. Bundled recipes are referred to by name (``deltafy recipes`` lists
them); any other value of ``--recipe`` is read as a path.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import DeltafyError, first_line
from .modeling_deltafy import DeltaSpec

DEFAULT_RECIPE = "ddl-scalar"
SEED_MAX = 2**32 - 1  # numpy's and the data order's seeds are 32-bit
# Two d x r matrices per site: past d (at most 16384 in today's decoders) a full d x d head is smaller.
RANK_MAX = 16384
CHANNELS_MAX = 16  # the paper's d_v is 4; each channel is one more copy of the stream's activations
Mode = Literal["heads", "heads+lora", "lora", "ia3", "ln-tuning", "base", "all"]  # what a training run trains
ADAPTER_MODES = ("lora", "heads+lora", "ia3")  # the modes that train a peft adapter (merged or kept apart)
HEAD_MODES = ("heads", "heads+lora", "all")  # the modes that train the DDL heads (at the recipe's lr)


class TrainingDefaults(BaseModel):
    """Every ``deltafy train`` setting; the CLI's flags override a recipe's ``training`` section.

    This model is the one place that defines them: ``deltafy train`` builds one flag per field
    (``seq_len`` -> ``--seq-len``) with the field's type, default and description as its help, so
    the descriptions are written for ``--help``.
    The gate's own learning rate is what makes converted heads trainable (README, "Gates that open").
    """

    # allow_inf_nan: `--lr inf` or `lr: 1e400` (YAML reads it as a string, pydantic as inf) is a typo, not a setting.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lr: PositiveFloat = Field(1e-3, description="learning rate of the target and direction heads")
    gate_lr_scale: PositiveFloat = Field(
        100.0,
        description="the gate's learning rate is lr * gate_lr_scale: Adam moves a parameter about "
        "lr per step, and a logit gate starting at -18 must travel ~10 logits to open (100 in its recipe; 10 in "
        "the strength recipes, whose gate starts open)",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    steps: PositiveInt | None = Field(None, description="optimizer steps; 200 if neither steps nor tokens is set")
    tokens: PositiveInt | None = Field(None, description="token budget; sets the number of steps")
    seq_len: int = Field(256, ge=2, description="tokens per training block (a block predicts all but its first)")
    batch_size: PositiveInt = Field(8, description="blocks per device per micro-step")
    grad_accum: PositiveInt = Field(1, description="micro-steps per optimizer step")
    lora_lr: PositiveFloat = Field(
        2e-4,
        description="learning rate of the LoRA or (IA)^3 adapters (train: lora, heads+lora, ia3) and of the "
        "pretrained weights (train: ln-tuning, base, all)",
    )
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup")
    warmup: float = Field(0.05, ge=0.0, le=0.5, description="warmup, as a fraction of the steps")
    train: Mode = Field(
        "heads",
        description="what trains: the DDL heads, LoRA, both, peft's (IA)^3 (learned scales on keys, values and "
        "feed-forward inputs), the norms (ln-tuning: peft's LN-tuning targets), every pretrained weight with the "
        "heads left as they are (base), or every weight",
    )
    lora_r: PositiveInt = Field(8, le=RANK_MAX, description="LoRA rank")
    lora_alpha: PositiveFloat = Field(16.0, description="LoRA alpha; adapter updates are scaled by alpha / r")
    lora_targets: list[str] | None = Field(
        None, description="LoRA or (IA)^3 module names; unset: peft's for the model family"
    )
    lora_dora: bool = Field(False, description="DoRA: LoRA with a learned magnitude per output (peft's use_dora)")
    merge_lora: bool = Field(
        True,
        description="merge the LoRA or (IA)^3 adapter into the saved weights, or keep it apart in OUT/lora-adapter/",
    )
    held_out: float = Field(0.05, gt=0.0, lt=1.0, description="fraction of blocks held out without eval data")
    eval_every: PositiveInt = Field(50, description="optimizer steps between held-out evaluations")
    save_every: PositiveInt = Field(100, description="optimizer steps between resumable checkpoints in OUT/training/")
    max_eval_blocks: PositiveInt = Field(
        64, description="held-out blocks each evaluation reads, the first ones (eval of the output reads as many)"
    )
    seed: int = Field(
        0, ge=0, le=SEED_MAX, description="seed for LoRA init, the data order and the held-out split (0 to 2^32-1)"
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto",
        description="training precision (bf16: autocast, with a bf16 model's frozen weights held in bf16); auto: "
        "bf16 on a GPU that supports it, else fp32",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in the backward pass: less memory, more time"
    )
    text_field: str = Field(
        "text", description="field or column of the records (JSONL, JSON, CSV, Parquet, datasets) holding the text"
    )


class Recipe(BaseModel):
    """How every residual write of a model becomes a Deep Delta Learning write (the conversion's
    defaults are DeltaSpec's, the spec the surgery reads: one place holds them)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(description="short identifier, recorded in the checkpoint")
    description: str = Field("", description="one line shown by `deltafy recipes`")
    direction: Literal["sublayer", "learned"] = Field(
        DeltaSpec.direction,
        description="k = the sublayer's own write normalized (paper) or a learned head on the context",
    )
    rank: PositiveInt | None = Field(
        DeltaSpec.rank,
        le=RANK_MAX,
        description="rank of the learned direction head (None: full d x d); learned only",
    )
    sites: list[Literal["attn", "mlp"]] = Field(
        default_factory=lambda: ["attn", "mlp"], min_length=1, description="which writes to convert"
    )
    gate: Literal["logit", "strength"] = Field(
        DeltaSpec.gate,
        description="logit: the correction starts off through a very negative gate logit; strength: a "
        "zero-initialized scalar per site multiplies it (exactly the original at init), and beta starts at "
        "2*sigmoid(gate_bias)",
    )
    gate_bias: float = Field(
        DeltaSpec.gate_bias,
        le=60.0,
        ge=-60.0,
        description="initial gate logit; with gate: logit at most -4 (beta = 2*sigmoid(-18) = 3e-8 keeps the "
        "model unchanged even where residual norms reach 2e4, as in SmolLM2)",
    )
    eps: PositiveFloat = Field(DeltaSpec.eps, description="epsilon in k = h / sqrt(|h|^2 + eps^2)")
    channels: PositiveInt = Field(
        DeltaSpec.channels,
        le=CHANNELS_MAX,
        description="d_v, the channels of the residual stream: 1 is the scalar DDL, more the paper's expanded "
        "state (a d x d_v stream that every sublayer reads through its own read weights; each channel costs "
        "one more stream's worth of activation memory)",
    )

    erase: bool = Field(
        DeltaSpec.erase,
        description="false: the write-only control x + h + alpha*beta*v*k, without DDL's erase term -beta*(k.x)*k "
        "(what the erase term adds is the difference)",
    )

    @field_validator("gate_bias")
    @classmethod
    def _closed_at_init(cls, value: float, info: ValidationInfo) -> float:
        if info.data.get("gate", DeltaSpec.gate) == "logit" and value > -4.0:
            raise ValueError("must be at most -4 with gate: logit (the correction must start off)")
        return value

    training: TrainingDefaults = Field(default_factory=TrainingDefaults)

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.rank is not None and self.direction != "learned":
            raise ValueError("rank applies only to direction: learned")
        if len(set(self.sites)) != len(self.sites):
            raise ValueError("sites must not repeat")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _bundled_dir() -> Path:
    packaged = resources.files("deltafy") / "recipes"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "recipes"  # source checkout / editable install


def bundled_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(_bundled_dir().glob("*.yaml"))}


def format_validation(err: ValidationError, name: Callable[[tuple], str] | None = None) -> str:
    """Every problem in ``err`` on one line (``where: what; ...``), so that one run shows them all.

    ``name`` says where a problem is as the user wrote it (a flag, say); by default it is the
    dotted path of the key, ``recipe`` for the recipe as a whole.
    """
    parts = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = name(loc) if name else ".".join(map(str, loc)) or "recipe"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)  # (no where: a rule across fields, said whole)
    return "; ".join(parts)


def recipe_from_dict(data: dict, origin: str = "recipe") -> Recipe:
    if not isinstance(data, dict):
        raise DeltafyError(f"{origin} must be a YAML mapping of recipe keys")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise DeltafyError(f"invalid {origin}: {format_validation(err)}") from err


def load_recipe(name_or_path: str | Path | Recipe | dict | None = None) -> Recipe:
    """A bundled recipe by name, a YAML file by path, a dict of a recipe file's keys, or the default recipe for
    ``None``."""
    if isinstance(name_or_path, Recipe):
        return name_or_path
    if isinstance(name_or_path, dict):
        return recipe_from_dict(name_or_path)
    if not isinstance(name_or_path, (str, Path, type(None))):
        raise DeltafyError(
            f"a recipe is a deltafy.Recipe, a bundled recipe's name, a YAML file's path or a dict of its keys, "
            f"not {name_or_path!r}"
        )
    key = str(name_or_path) if name_or_path is not None else DEFAULT_RECIPE
    bundled = bundled_recipes()
    path = bundled.get(key, Path(key))
    if not path.is_file():
        names = f"use one of {', '.join(bundled)} or a path to a YAML file"
        if path.is_dir():
            raise DeltafyError(f"the recipe {key} is a folder; {names}")
        if path.suffix in (".yaml", ".yml") or "/" in key:  # meant as a file
            raise DeltafyError(f"the recipe file {key} does not exist; {names}")
        raise DeltafyError(f"no recipe named {key!r}; {names}")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise DeltafyError(f"could not read recipe {path}: {_yaml_problem(err)}") from err
    return recipe_from_dict(data, origin=f"recipe {path}")


def _yaml_problem(err: BaseException) -> str:
    """What the YAML parser found wrong, and where (its own message starts with the context it was in)."""
    mark = getattr(err, "problem_mark", None)
    if not isinstance(err, yaml.MarkedYAMLError) or mark is None or not err.problem:
        return first_line(err)
    return f"{err.problem} at line {mark.line + 1}, column {mark.column + 1}"
