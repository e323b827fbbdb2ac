"""The options models: a recipe (what a conversion builds, and its training defaults) and the
settings of a conversion, a training run, an evaluation and a bench. The flags of ``deltafy
convert``/``train``/``eval``/``bench``/``push`` that set something (not the paths they read and write) are
fields here, generated from them.

A recipe is a YAML file. Bundled recipes are referred to by name (``deltafy recipes`` lists
them); any other value of ``--recipe`` is read as a path.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .errors import DeltafyError, first_line
from .modeling_deltafy import DeltaSpec
from .placement import usable_device

DEFAULT_RECIPE = "ddl-scalar"
SEED_MAX = 2**32 - 1  # numpy's and the data order's seeds are 32-bit
# Two d x r matrices per site: past d (at most 16384 in today's decoders) a full d x d head is smaller.
RANK_MAX = 16384
CHANNELS_MAX = 16  # the paper's d_v is 4; each channel is one more copy of the stream's activations
Mode = Literal["heads", "heads+lora", "lora", "ia3", "ln-tuning", "base", "all"]  # what a training run trains
ADAPTER_MODES = ("lora", "heads+lora", "ia3")  # the modes that train a peft adapter (merged or kept apart)
HEAD_MODES = ("heads", "heads+lora", "all")  # the modes that train the DDL heads (at the recipe's lr)
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]  # a precision to load (and convert) a model in
DeviceName = Annotated[str, AfterValidator(usable_device)]  # checked when the options are, before any work
SELF_CHECK_TOLERANCE = 1e-3  # the largest |Δlogits| a conversion's self-check accepts in fp32


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
        "auto", description="training precision; auto: bf16 on a GPU that supports it, else fp32"
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


# -- a conversion --------------------------------------------------------------------------------


class ConvertOptions(BaseModel):
    """Every setting of a conversion besides its source, folder and recipe: ``deltafy convert`` builds
    one flag per field, and ``convert_source`` checks its keywords with it."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    dtype: DTypeName = Field(
        "auto", description="precision to load the model in and save it in; auto: as the source records it"
    )
    verify: bool = Field(True, description="self-check the converted model against the original before writing")
    tolerance: NonNegativeFloat = Field(
        SELF_CHECK_TOLERANCE,
        description="largest |Δlogits| the self-check accepts at init, in fp32; in bf16/fp16 at least "
        "4·eps·max|logits| (the logits' own rounding)",
    )
    device: DeviceName | None = Field(
        None, description="device for conversion and self-check, e.g. cuda", json_schema_extra={"shown": "cpu"}
    )
    heads_only: bool = Field(
        False, description="write only the new heads; loading the folder fetches the source (pinned) and applies them"
    )
    streaming: bool | None = Field(
        None,
        description="--streaming: convert a local safetensors folder without loading it and self-check it a "
        "decoder layer at a time; --in-memory: load the whole model",
        json_schema_extra={"shown": "streaming where the source allows it, layer by layer above 2 GiB of weights"},
    )

    @model_validator(mode="after")
    def _streaming_on_cpu(self) -> ConvertOptions:
        if self.streaming and self.device:
            raise ValueError("streaming converts on the CPU; drop --device or --streaming")
        return self


def convert_options(**settings) -> ConvertOptions:
    """``settings`` (None: the default) as ConvertOptions, every bad value named as its flag."""
    return options_of(ConvertOptions, "conversion", **settings)


# -- a push --------------------------------------------------------------------------------------


class PushOptions(BaseModel):
    """Every setting of a push besides the folder and the repository: ``deltafy push`` builds one flag
    per field, and ``deltafy.hub.push.push`` checks its keywords with it."""

    model_config = ConfigDict(extra="forbid")

    private: bool = Field(False, description="create the repository private (an existing one keeps its own)")
    revision: str | None = Field(
        None,
        description="branch to push to, created from main if new; or refs/pr/N, an open pull request",
        json_schema_extra={"shown": "main"},
    )
    message: str | None = Field(
        None, description="commit message", json_schema_extra={"shown": "deltafy's version, base model, recipe"}
    )
    token: str | None = Field(
        None,
        description="Hub token with write access",
        json_schema_extra={"shown": "HF_TOKEN, else the `hf auth login` token"},
    )
    include_training: bool = Field(False, description="upload the training state too (training/, optimizer files)")


def push_options(**settings) -> PushOptions:
    """``settings`` (None: the default) as PushOptions, every bad value named as its flag."""
    return options_of(PushOptions, "push", **settings)


# -- a training run -------------------------------------------------------------------------------


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


def options_from(recipe_training: dict | None, model: type[BaseModel] = TrainOptions, *, what="training", **flags):
    """A recipe's ``training`` section overlaid by explicit flags (``None`` flags keep the recipe's),
    as ``model`` (the section's keys that ``model`` has, for a command that reads only some of them);
    ``what`` names the options in an error ("invalid evaluation options: ...").

    Every bad value is reported at once, named where the user can fix it: ``--seq-len`` for a
    flag, ``training.seq_len`` for the recipe's section.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    # The training settings ``model`` does not read are left out; an unknown key (a typo) is not.
    section = {
        k: v
        for k, v in (recipe_training or {}).items()
        if k in model.model_fields or k not in TrainingDefaults.model_fields
    }
    try:
        return model.model_validate({**section, **given})
    except ValidationError as err:

        def where(loc: tuple) -> str:
            if loc and loc[0] in given:
                return "--" + str(loc[0]).replace("_", "-")
            return ".".join(map(str, ("training", *loc)))

        raise DeltafyError(f"invalid {what} options: {format_validation(err, where)}") from err


# -- reading held-out text ------------------------------------------------------------------------


def _as_trained(name: str, description: str):
    return Field(TrainingDefaults.model_fields[name].default, description=description)


class EvalOptions(BaseModel):
    """How ``deltafy eval`` and ``inspect`` read text: by default as the checkpoint's run did (its
    recipe's ``training`` section records the run's settings), else as a run would by default; and
    what ``eval`` loads the model in and on. The sizes' rules are ``evaluate.check_sizes``, which
    names each flag and what it takes."""

    model_config = ConfigDict(extra="forbid")

    seq_len: int = _as_trained("seq_len", "tokens per block, at least 2 and at most the model's positions")
    batch_size: int = _as_trained("batch_size", "blocks per forward, at least 1")
    max_blocks: int | None = Field(None, description="evaluate the first N blocks at most (unset: all of them)")
    text_field: str = _as_trained(
        "text_field", "field or column of the records (JSONL, JSON, CSV, Parquet, datasets) holding the text"
    )
    dtype: DTypeName = Field("auto", description="precision to load the model in; auto: as the checkpoint records it")
    device: DeviceName | None = Field(
        None, description="device to evaluate on, e.g. cuda", json_schema_extra={"shown": "cpu"}
    )


# -- a bench --------------------------------------------------------------------------------------
# Budgets as presets; a flag given beside one overrides its value. cpu-small is the scale docs/bench.md
# measured on 2 CPU cores; gpu trains 64 x 16 x 1024 = 1,048,576 tokens an arm and evaluates on 100
# blocks of 1024 (102,400 tokens), 3 seeds.
BENCH_PRESETS: dict[str, dict] = {
    "cpu-small": dict(steps=12, seeds=2, seq_len=128, batch_size=4, max_eval_blocks=16, lrs=[1.0, 3.0, 10.0]),
    "gpu": dict(steps=64, seeds=3, seq_len=1024, batch_size=16, max_eval_blocks=100, lrs=[0.3, 1.0, 3.0]),
}


class BenchOptions(BaseModel):
    """Every setting of ``deltafy bench`` besides its inputs, arms and folder: ``deltafy bench`` builds
    one flag per field. The sizes every run trains with are checked as a run's (TrainOptions)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    preset: Literal["cpu-small", "gpu"] | None = Field(
        None,
        description="a budget: cpu-small (12 steps of 4x128 tokens, 2 seeds) or gpu (64 steps of 16x1024 tokens "
        "= 1M a run, 100 held-out blocks of 1024, 3 seeds); flags given beside it override its values",
    )
    steps: PositiveInt = Field(100, description="optimizer steps of every run")
    seeds: PositiveInt = Field(3, description="seeds per arm, 0 … K-1 (standard errors need 2 or more)")
    lrs: list[PositiveFloat] = Field(
        [0.3, 1.0, 3.0], description="multipliers of each arm's default learning rate to sweep"
    )
    sweep_seeds: PositiveInt = Field(
        2, description="seeds each swept rate trains on; a rate scores the mean of their validation losses"
    )
    lr_extend: int = Field(
        4, ge=0, description="rates a sweep may add past an end of --lrs where its best sits (0: exactly --lrs)"
    )
    seq_len: int = _as_trained("seq_len", "tokens per block")
    batch_size: int = _as_trained("batch_size", "blocks per step")
    eval_every: PositiveInt | None = Field(None, description="steps between held-out evaluations; unset: steps/5")
    max_eval_blocks: int = _as_trained("max_eval_blocks", "held-out blocks evaluated")
    lora_targets: list[str] | None = Field(
        None, description="LoRA or (IA)^3 module names; unset: peft's for the model family"
    )
    text_field: str = _as_trained(
        "text_field", "field or column of the records (JSONL, JSON, CSV, Parquet, datasets) holding the text"
    )

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, given):
        if isinstance(given, dict) and given.get("preset") in BENCH_PRESETS:
            return BENCH_PRESETS[given["preset"]] | given
        return given

    @field_validator("lrs")
    @classmethod
    def _a_grid(cls, value: list[float]) -> list[float]:
        if not value or len(set(value)) != len(value):
            raise ValueError("takes distinct multipliers, e.g. 0.3,1,3")
        return sorted(value)


def bench_options(**settings) -> BenchOptions:
    """``settings`` (None: the default) as BenchOptions, every bad value named as its flag."""
    return options_of(BenchOptions, "bench", **settings)


def options_of(model: type[BaseModel], what: str, **settings):
    """``settings`` given to a command (None: unset, so the model's default) as ``model``; every bad
    value is reported at once, named as its flag."""
    given = {k: v for k, v in settings.items() if v is not None}
    try:
        return model.model_validate(given)
    except ValidationError as err:

        def flag(loc: tuple) -> str:
            return "--" + str(loc[0]).replace("_", "-") if loc else ""

        raise DeltafyError(f"invalid {what} options: {format_validation(err, flag)}") from err
