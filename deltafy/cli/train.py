from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..recipe import load_recipe
from ._console import console, err_console
from ._options import OverwriteOpt


def _opt(*names: str, help: str):
    return typer.Option(*names, help=help, show_default=False)


def train_command(
    ctx: typer.Context,
    model_dir: Annotated[str, typer.Argument(help="A deltafy checkpoint folder (from `deltafy convert`).")],
    data: Annotated[
        list[str],
        typer.Option(
            "--data",
            "-d",
            help="Text: .txt/.md/.jsonl files, folders, globs, or a datasets folder / Hub id. Repeat for several.",
        ),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for the trained checkpoint and run state.")],
    eval_data: Annotated[
        list[str] | None, _opt("--eval-data", help="Held-out text (default: --held-out of --data).")
    ] = None,
    recipe: Annotated[
        str | None, _opt("--recipe", "-r", help="Recipe name or YAML whose training section sets defaults.")
    ] = None,
    steps: Annotated[int | None, _opt("--steps", help="Optimizer steps [default: 200].")] = None,
    tokens: Annotated[int | None, _opt("--tokens", help="Token budget instead of --steps.")] = None,
    seq_len: Annotated[int | None, _opt("--seq-len", help="Tokens per block [default: 256].")] = None,
    batch_size: Annotated[
        int | None, _opt("--batch-size", help="Blocks per device per micro-step [default: 8].")
    ] = None,
    grad_accum: Annotated[int | None, _opt("--grad-accum", help="Micro-steps per optimizer step [default: 1].")] = None,
    lr: Annotated[float | None, _opt("--lr", help="Head learning rate [default: the recipe's, 1e-3].")] = None,
    gate_lr_scale: Annotated[
        float | None, _opt("--gate-lr-scale", help="Gate lr = lr × this [default: recipe's].")
    ] = None,
    lora_lr: Annotated[float | None, _opt("--lora-lr", help="LoRA (and --train all) lr [default: 2e-4].")] = None,
    schedule: Annotated[str | None, _opt("--schedule", help="cosine | linear | constant [default: cosine].")] = None,
    warmup: Annotated[float | None, _opt("--warmup", help="Warmup fraction of the steps [default: 0.05].")] = None,
    train: Annotated[str | None, _opt("--train", help="heads | heads+lora | lora | all [default: heads].")] = None,
    lora_r: Annotated[int | None, _opt("--lora-r", help="LoRA rank [default: 8].")] = None,
    lora_alpha: Annotated[float | None, _opt("--lora-alpha", help="LoRA alpha [default: 16].")] = None,
    lora_targets: Annotated[str | None, _opt("--lora-targets", help="Comma-separated module names for LoRA.")] = None,
    keep_adapter: Annotated[
        bool, typer.Option("--keep-adapter", help="Save LoRA separately instead of merging.")
    ] = False,
    held_out: Annotated[
        float | None, _opt("--held-out", help="Held-out fraction without --eval-data [default: 0.05].")
    ] = None,
    eval_every: Annotated[int | None, _opt("--eval-every", help="Steps between held-out evaluations.")] = None,
    save_every: Annotated[
        int | None, _opt("--save-every", help="Steps between resumable checkpoints [default: 100].")
    ] = None,
    seed: Annotated[int | None, _opt("--seed", help="Seed for init, data order and split [default: 0].")] = None,
    precision: Annotated[str | None, _opt("--precision", help="auto (fp32 CPU, bf16 GPU) | fp32 | bf16.")] = None,
    gradient_checkpointing: Annotated[
        bool, typer.Option("--gradient-checkpointing", help="Trade compute for memory.")
    ] = False,
    text_field: Annotated[
        str | None, _opt("--text-field", help="JSONL/dataset field holding the text [default: text].")
    ] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run saved in --out.")] = False,
    overwrite: OverwriteOpt = False,
) -> None:
    """Train the DDL heads of a converted model (optionally with LoRA) and save the result.

    [bold]Examples[/]

      deltafy train ./smol-delta --data corpus/*.txt --out ./smol-trained --steps 500
      deltafy train ./smol-delta --data data.jsonl --eval-data heldout.txt --train heads+lora --lora-r 8 --out ./run2
      torchrun --nproc_per_node 8 -m deltafy train ./big-delta --data corpus/ --out ./run3
      deltafy train ./smol-delta --data corpus/ --out ./run1 --resume
    """
    from ..engine import run_training

    data = list(data) + list(ctx.args)  # `--data corpus/*.txt`: the shell expands one flag into many paths
    from ..train import options_from

    base = load_recipe(recipe).training.model_dump() if recipe else None
    if base is None:
        from ..checkpoint import read_config

        base = read_config(model_dir)["deltafy"]["recipe"].get("training")
    options = options_from(
        base,
        steps=steps,
        tokens=tokens,
        seq_len=seq_len,
        batch_size=batch_size,
        grad_accum=grad_accum,
        lr=lr,
        gate_lr_scale=gate_lr_scale,
        lora_lr=lora_lr,
        schedule=schedule,
        warmup=warmup,
        train=train,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        lora_targets=lora_targets.split(",") if lora_targets else None,
        merge_lora=False if keep_adapter else None,
        held_out=held_out,
        eval_every=eval_every,
        save_every=save_every,
        seed=seed,
        precision=precision,
        gradient_checkpointing=True if gradient_checkpointing else None,
        text_field=text_field,
    )
    with err_console.status("") as spinner:

        def status(message: str) -> None:
            spinner.update(message + " …")

        result = run_training(
            model_dir, data, out, options, eval_data=eval_data, resume=resume, overwrite=overwrite, status=status
        )
    if result.loss_after == result.loss_after:  # not NaN: this is the process that evaluated
        delta = result.loss_after - result.loss_before
        console.print(
            f"held-out loss {result.loss_before:.4f} → {result.loss_after:.4f} ({delta:+.4f} nats) after "
            f"{result.steps} steps, {result.seconds_per_step:.2f} s/step, {result.trainable_params:,} trained"
        )
        betas = " ".join(f"{b:.2g}" for b in result.mean_beta_per_layer)
        console.print(f"mean β per layer: {betas}")
        console.print(f"wrote [bold]{result.out}[/]")
