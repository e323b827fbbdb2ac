"""What a training run reports and leaves in ``--out`` once its steps are done: the held-out loss after
training, the summary line of metrics.jsonl, the figures and the saved model (``finish``), or, for a
resumed run that had already finished, its summary read back (``finished_result``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import DeltafyError
from ..files import ADAPTER_DIR, METRICS_FILE, read_metrics, run_summary
from ..options import LaunchOptions
from ..recipe import ADAPTER_MODES
from .checkpoints import newest_complete, write_failure
from .plots import factor_label, write_training_figures
from .run_folder import append_metrics
from .sharding import gather_trained, is_sharded, rebuild
from .trainable import per_layer, site_betas, unwrap_lora


@dataclass
class TrainResult:
    steps: int
    loss_before: float
    loss_after: float
    seconds_per_step: float  # over this session's steps, the first left out where it compiled (and others followed)
    trainable_params: int
    mean_beta_per_layer: list[float] = field(default_factory=list)
    mean_beta_on: str = ""  # the text mean_beta_per_layer was measured on
    out: Path | None = None
    already_finished: bool = False  # a resume found the run done: nothing trained, the losses are its summary's
    first_step_seconds: float | None = None  # --compile: the first step (compiling), left out of seconds_per_step


def finished_result(out: Path, steps: int) -> TrainResult:
    """What a finished run reported, from its metrics' summary (NaN losses if it has none)."""
    try:
        summary = run_summary(read_metrics(out / METRICS_FILE))
    except DeltafyError:  # no metrics to read: the run is finished all the same
        summary = {}
    nan = float("nan")
    return TrainResult(
        steps=steps,
        loss_before=summary.get("loss_before", nan),
        loss_after=summary.get("loss_after", nan),
        seconds_per_step=0.0,
        trainable_params=0,
        mean_beta_per_layer=summary.get("mean_beta_per_layer", []),
        mean_beta_on=summary.get("mean_beta_on", ""),
        out=out,
        already_finished=True,
    )


def finish(run, trainer, timing: tuple[float, float | None], status) -> TrainResult:
    """After the last step of ``run`` (the job's _Run): the trained model gathered (FSDP), evaluated,
    reported in metrics.jsonl and figures, and saved into ``--out`` with the run's settings as its
    recipe's training section."""
    from ..checkpoint import save
    from ..evaluate import evaluate

    options, out, state_dir = run.options, run.out, run.state_dir
    result = TrainResult(
        steps=trainer.state.global_step,
        loss_before=run.before,
        loss_after=float("nan"),
        seconds_per_step=timing[0],
        first_step_seconds=timing[1],
        trainable_params=run.trainable,
        out=out,
    )
    trained = trainer.unwrapped(trainer.model)  # (--compile without FSDP: a copy whose layers torch.compile wraps)
    if is_sharded(trainer):  # FSDP (--fsdp, or an accelerate config): each rank holds a shard only
        status("gathering the trained parameters")
        gathered = gather_trained(trained)  # a collective: every rank takes part
        trained = rebuild(run.model_dir, options, gathered, run.held, run.base) if run.main else None
    if not run.main:
        return result
    if run.stored != torch.float32:  # the values the output holds (the heads rounded, in fp32 still)
        with torch.no_grad():
            for param in trained.parameters():
                param.copy_(param.to(run.stored))
    status("held-out loss after training")
    # The model as trained (with its LoRA adapters, when it has any): what the run produced.
    result.loss_after = evaluate(trained, run.eval_blocks, options.batch_size).loss
    betas, result.mean_beta_on = site_betas(trained, run.eval_blocks)
    result.mean_beta_per_layer = per_layer(betas)
    append_metrics(
        out,
        {
            "event": "summary",
            "loss_before": run.before,
            "loss_after": result.loss_after,
            "mean_beta_per_layer": result.mean_beta_per_layer,
            "mean_beta_on": result.mean_beta_on,
            "steps": result.steps,
            "dtype": str(run.held).removeprefix("torch."),  # the losses' (eval of the folder reads it so)
        },
    )
    status(f"writing {out}")
    label = factor_label(trained.config.deltafy)
    figures = write_training_figures(out, betas, label, result.mean_beta_on)  # loss.png and beta.png, shown by the card
    training = {
        "mode": options.train,
        "steps": result.steps,
        "tokens": result.steps * run.tokens_per_step,
        "trainable_params": run.trainable,
        "data": list(run.data),
        "eval_data": list(run.eval_data or []),
        "loss_before": run.before,
        "loss_after": result.loss_after,
    }
    if not options.merge_lora and options.train in ADAPTER_MODES:
        training["adapter"] = ADAPTER_DIR  # part of the model trained: the card loads it
    try:
        model = unwrap_lora(trained, options.merge_lora, out / ADAPTER_DIR).to(run.stored)
        # The saved recipe's training section is this run's settings: eval, inspect and a next run
        # read text as this run did (a held-out file too short for the default 256 tokens included).
        spec = model.config.deltafy
        spec["recipe"] = {
            **spec["recipe"],
            "training": options.model_dump(mode="json", exclude=set(LaunchOptions.model_fields)),
        }
        save(
            model,
            out,
            tokenizer=run.tokenizer,
            provenance=spec.get("provenance"),
            into=True,
            heads_only=run.heads_only,
            training=training,
            figures=figures,
        )
    except Exception as err:
        last, _ = newest_complete(state_dir)
        if isinstance(err, DeltafyError) and last is not None:
            raise DeltafyError(f"{err}; {last} is still usable: free space and rerun with --resume") from err
        failure = write_failure(err, f"the model into {out}", state_dir)
        if failure is not None:
            raise failure from err
        raise
    return result
