from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..options import LaunchOptions
from ..recipe import TrainingDefaults, load_recipe
from ._console import console, err_console, spinner_status
from ._options import OFF, BaseOpt, OverwriteOpt, described, extra_text_paths, sentence, with_model_options

# Every training setting is a flag generated from TrainingDefaults, the model that also validates
# a recipe's `training:` section: one place holds each setting's name, type, default and help.
SPELLINGS = {
    "merge_lora": "--merge-lora/--keep-adapter",  # --keep-adapter: the spelling README and users know
    # On only: an off switch as long as --no-gradient-checkpointing widens every row of --help.
    "gradient_checkpointing": "--gradient-checkpointing",
}


@with_model_options(
    TrainingDefaults, panel="Training options (also settable in a recipe's training: section)", spellings=SPELLINGS
)
def train_command(
    ctx: typer.Context,
    model_dir: Annotated[str, typer.Argument(help="A deltafy checkpoint folder (from `deltafy convert`).")],
    data: Annotated[
        list[str],
        typer.Option(
            "--data",
            "-d",
            help="Text: .txt/.md files, records (.jsonl/.json/.csv/.parquet, --text-field), folders, globs, or a "
            "datasets folder / Hub id. Repeat for several.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the trained checkpoint and run state.")],
    eval_data: Annotated[
        list[str] | None,
        typer.Option("--eval-data", **described("Held-out text.", "the --held-out share of --data")),
    ] = None,
    recipe: Annotated[
        str | None,
        typer.Option(
            "--recipe",
            "-r",
            **described("Recipe name or YAML whose training section sets the defaults.", "the checkpoint's recipe"),
        ),
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", **described("Continue the run saved in --out.", OFF))] = False,
    overwrite: OverwriteOpt = False,
    heads_only: Annotated[
        bool,
        typer.Option(
            "--heads-only",
            **described("Save only the heads (and the kept LoRA adapter) over the input's base model.", OFF),
        ),
    ] = False,
    base_model: BaseOpt = None,  # (not `base`: below that is the recipe's training defaults)
    # A launch option, not a training one: how a run is spread over processes is no part of a recipe.
    fsdp: Annotated[
        bool,
        typer.Option("--fsdp", **described(sentence(LaunchOptions.model_fields["fsdp"].description), OFF)),
    ] = False,
    compile: Annotated[
        bool,
        typer.Option("--compile", **described(sentence(LaunchOptions.model_fields["compile"].description), OFF)),
    ] = False,
    **flags,
) -> None:
    """Train the DDL heads of a converted model (optionally with LoRA) and save the result.

    [bold]Examples[/]

      deltafy train ./smol-delta --data corpus/*.txt --out ./smol-trained --steps 500
      deltafy train ./smol-delta --data data.jsonl --eval-data heldout.txt --train heads+lora --lora-r 8 --out ./run2
      torchrun --nproc_per_node 8 -m deltafy train ./big-delta --data corpus/ --out ./run3 --fsdp
      deltafy train ./smol-delta --data corpus/ --out ./run4 --compile     # on a GPU: fewer kernels a step
      deltafy train ./smol-delta --data corpus/ --out ./run1 --resume
    """
    from ..options import options_from, refuse_unread_flags
    from ..training.job import run_training

    extra_data, extra_eval = extra_text_paths(ctx)  # `--data corpus/*.txt`: one flag, many paths
    data = list(data) + extra_data
    if eval_data is not None or extra_eval:
        eval_data = list(eval_data or []) + extra_eval
    if recipe:
        chosen = load_recipe(recipe)
        base = chosen.training.model_dump()
    else:
        from ..checkpoint import read_config

        base = read_config(model_dir)["deltafy"]["recipe"].get("training")
    options = options_from(base, fsdp=fsdp, compile=compile, **flags)  # (unset flags: None, the recipe's value)
    refuse_unread_flags(options, flags, SPELLINGS)
    if recipe and (kept := _heads_kept(model_dir, chosen)):
        err_console.print(
            f"note: --recipe {recipe} sets the training defaults only; this checkpoint keeps the heads it was "
            f"converted with ({kept}); convert with --recipe {recipe} for its heads",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    with spinner_status(err_console) as status:
        result = run_training(
            model_dir,
            data,
            out,
            options,
            eval_data=eval_data,
            resume=resume,
            overwrite=overwrite,
            heads_only=heads_only,
            base=base_model,
            status=status,
            # through the console that draws the spinner, so the line lands above it; paths verbatim
            notice=lambda message: err_console.print(message, markup=False, highlight=False, soft_wrap=True),
        )
    if result.already_finished:  # said so through notice: nothing was trained or written
        return
    if result.loss_after == result.loss_after:  # not NaN: this is the process that evaluated
        delta, steps = result.loss_after - result.loss_before, f"{result.steps} step{'s' * (result.steps != 1)}"
        speed = f"{result.seconds_per_step:.2f} s/step"
        if result.first_step_seconds is not None:  # --compile: its first step compiled
            speed += f" (the first, compiling: {result.first_step_seconds:.1f} s)"
        console.print(
            f"held-out loss {result.loss_before:.4f} → {result.loss_after:.4f} ({delta:+.4f} nats) after "
            f"{steps}, {speed}, {result.trainable_params:,} trained"
        )
        from ..checkpoint import read_config
        from ..training.plots import factor_label

        betas = " ".join(f"{b:.2g}" for b in result.mean_beta_per_layer)
        on = f" on {result.mean_beta_on}" if result.mean_beta_on else ""
        label = factor_label(read_config(result.out)["deltafy"])
        console.print(f"mean {label} per layer (its sites averaged){on}: {betas}")
        console.print(f"wrote [bold]{escape(str(result.out))}[/]")


def _heads_kept(model_dir: Path, chosen) -> str:
    """The conversion settings (direction, gate, ...) of the checkpoint that ``chosen`` sets otherwise, as
    ``key value`` pairs ("" where none does, or where the folder is unreadable: the run says so itself)."""
    from ..checkpoint import read_config
    from ..errors import DeltafyError

    try:
        converted = read_config(model_dir)["deltafy"].get("recipe", {})
    except DeltafyError:
        return ""
    # only what the recipe says: a recipe of a training section alone would otherwise "differ" by its defaults
    mine = chosen.model_dump(mode="json", include=chosen.model_fields_set - {"name", "description", "training"})

    def show(value) -> str:  # as a reader of the recipe's YAML says it
        if isinstance(value, list):
            return "[" + ", ".join(map(str, value)) + "]"
        return "none" if value is None else str(value)

    return ", ".join(
        f"{key} {show(converted[key])}" for key in mine if key in converted and converted[key] != mine[key]
    )
