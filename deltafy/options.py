"""The options of every command: the settings of a conversion, a push, a training run, an evaluation
and a bench. The flags of ``deltafy convert``/``train``/``eval``/``bench``/``push`` that set something
(not the paths they read and write) are fields here, generated from them; a training run's fields
are the recipe's training defaults (deltafy.recipe) plus how it is launched.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from .errors import DeltafyError
from .placement import usable_device, usable_placement
from .recipe import ADAPTER_MODES, HEAD_MODES, TrainingDefaults, format_validation

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]  # a precision to load (and convert) a model in
DeviceName = Annotated[str, AfterValidator(usable_device)]  # checked when the options are, before any work
PlacementName = Annotated[str, AfterValidator(usable_placement)]  # a DeviceName, or "auto"
SELF_CHECK_TOLERANCE = 1e-3  # the largest |Δlogits| a conversion's self-check accepts in fp32


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
    compile: bool = Field(
        False,
        description="run the training steps under torch.compile (inductor): each site's ops fuse into the "
        "kernels around it, at the cost of compiling first",
    )


class TrainOptions(TrainingDefaults, LaunchOptions):
    """Every ``deltafy train`` setting: the recipe's training defaults plus the launch options."""


# The flags only some --train modes read (a recipe's section sets them all; only a flag is checked): given
# beside another mode, the run would train without a word of them, e.g. --lr (the heads') with --train lora.
_LORA = ("lora", "heads+lora")
READ_BY: dict[str, tuple[str, ...]] = {
    "lr": HEAD_MODES,
    "gate_lr_scale": HEAD_MODES,
    "lora_lr": ("heads+lora", "lora", "ia3", "ln-tuning", "base", "all"),
    "lora_r": _LORA,
    "lora_alpha": _LORA,
    "lora_dora": _LORA,
    "lora_targets": (*_LORA, "ia3", "ln-tuning"),
    "merge_lora": ADAPTER_MODES,
}


def _spelled(name: str, value, spellings: dict[str, str]) -> str:
    flag = spellings.get(name, "--" + name.replace("_", "-"))
    return flag.split("/")[0 if value else 1] if "/" in flag else flag  # (--merge-lora/--keep-adapter: the one given)


def refuse_unread_flags(options: TrainOptions, flags: dict, spellings: dict[str, str]) -> None:
    """Refuse the ``flags`` given (not None) that ``options.train`` does not read, each named as the user
    spelled it (``spellings``: a field's flag where it is not ``--field-name``)."""
    unread = [name for name, modes in READ_BY.items() if flags.get(name) is not None and options.train not in modes]
    if unread:
        named = [f"{_spelled(n, flags[n], spellings)} ({TrainOptions.model_fields[n].description})" for n in unread]
        them = "it" if len(named) == 1 else "them"
        raise DeltafyError(
            f"--train {options.train} does not read {', '.join(named)}; drop {them} or choose a --train that does"
        )


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
    if "tokens" in given:  # a run's length given as tokens replaces the recipe's steps (which would win over it)
        section.pop("steps", None)
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
    dtype: DTypeName = Field(
        "auto",
        description="precision to load the model in; auto: as the checkpoint records it (a trained folder: as its "
        "run held it, so that its held-out loss is measured again)",
    )
    device: PlacementName | None = Field(
        None,
        description="device to evaluate on, e.g. cuda:1, or auto: spread over the GPUs as it fits (accelerate), "
        "the layers they cannot hold run from the CPU",
        json_schema_extra={"shown": "auto where there is a GPU, else cpu"},
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
