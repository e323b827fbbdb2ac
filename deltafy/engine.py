"""The ``deltafy train`` job: data, trainable parameters, Trainer, callbacks, final save."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from .errors import DeltafyError
from .train import (
    METRICS_FILE,
    STATE_DIR,
    TrainOptions,
    TrainResult,
    append_metrics,
    is_main_process,
    mean_beta_per_layer,
    planned_steps,
    select_trainable,
    unwrap_lora,
)


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class NonFiniteLoss(DeltafyError):
    pass


def _monitor(out: Path, total_steps: int, tokens_per_step: int, show_progress: bool):
    from transformers import TrainerCallback

    class Monitor(TrainerCallback):
        """Metrics as JSON lines, a rich progress bar, and a stop on a non-finite loss."""

        def __init__(self):
            self.progress = None
            self.started = None
            self.last_step_time = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()
            self.first_step = state.global_step
            if show_progress and state.is_world_process_zero:
                from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

                self.progress = Progress(
                    TextColumn("[bold]train[/]"),
                    BarColumn(),
                    TextColumn("{task.completed}/{task.total}"),
                    TextColumn("{task.fields[info]}"),
                    TimeRemainingColumn(),
                    transient=False,
                )
                self.task = self.progress.add_task("train", total=total_steps, completed=state.global_step, info="")
                self.progress.start()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(loss):
                control.should_training_stop = True
                control.should_save = False
                state.deltafy_nonfinite = state.global_step
                return
            elapsed = time.perf_counter() - self.started
            done = max(state.global_step - self.first_step, 1)
            logs |= {"step": state.global_step, "tokens_per_second": done * tokens_per_step / elapsed}
            if state.is_world_process_zero:
                append_metrics(out, logs)
                if self.progress is not None and loss is not None:
                    speed, lr = logs["tokens_per_second"], logs.get("learning_rate", 0.0)
                    info = f"loss {loss:.4f} · {speed:.0f} tok/s · lr {lr:.2e}"
                    self.progress.update(self.task, completed=state.global_step, info=info)
                elif self.progress is not None:
                    self.progress.update(self.task, completed=state.global_step)

        def on_train_end(self, args, state, control, **kwargs):
            self.stop()

        def stop(self):
            if self.progress is not None:
                self.progress.stop()
                self.progress = None

    return Monitor()


def run_training(
    model_dir: str,
    data: list[str],
    out: str | Path,
    options: TrainOptions,
    eval_data: list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
    show_progress: bool = True,
    status=lambda message: None,
) -> TrainResult:
    from transformers import Trainer, TrainingArguments, get_scheduler

    from .checkpoint import load, load_tokenizer, save
    from .data import pack, split_held_out, token_stream
    from .evaluate import evaluate

    out = Path(out).expanduser()
    state_dir = out / STATE_DIR
    if out.is_dir() and any(out.iterdir()) and not (resume or overwrite):
        raise DeltafyError(f"{out} already holds files; pass --resume to continue that run or --overwrite")
    if resume and not any(state_dir.glob("checkpoint-*")):
        raise DeltafyError(f"nothing to resume in {out}: no checkpoint was saved there yet")
    torch.manual_seed(options.seed)
    status(f"loading {model_dir}")
    model = load(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise DeltafyError(f"{model_dir} has no tokenizer; training needs one to read text")
    status("tokenizing")
    blocks = pack(token_stream(data, tokenizer, options.text_field), options.seq_len)
    if eval_data:
        train_blocks = blocks
        eval_blocks = pack(token_stream(eval_data, tokenizer, options.text_field), options.seq_len)
    else:
        train_blocks, eval_blocks = split_held_out(blocks, options.held_out, options.seed)
    eval_blocks = eval_blocks[: options.max_eval_blocks]

    cuda = torch.cuda.is_available()
    bf16 = options.precision == "bf16" or (options.precision == "auto" and cuda and torch.cuda.is_bf16_supported())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = planned_steps(options, world)
    model, groups = select_trainable(model, options.train, options)
    trainable = sum(p.numel() for g in groups for p in g["params"])

    if is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        if not resume:
            (out / METRICS_FILE).unlink(missing_ok=True)
    status("held-out loss before training")
    before = evaluate(model, eval_blocks, options.batch_size).loss if is_main_process() else float("nan")

    args = TrainingArguments(
        output_dir=str(state_dir),
        max_steps=steps,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="steps",
        save_steps=options.save_every,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=options.eval_every,
        per_device_eval_batch_size=options.batch_size,
        prediction_loss_only=True,
        seed=options.seed,
        data_seed=options.seed,
        bf16=bf16,
        gradient_checkpointing=options.gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if options.gradient_checkpointing else None,
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        save_only_model=False,
        use_cpu=not cuda,
    )
    optimizer = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in groups])
    scheduler = get_scheduler(
        options.schedule if options.schedule != "constant" else "constant_with_warmup",
        optimizer,
        num_warmup_steps=int(options.warmup * steps),
        num_training_steps=steps,
    )
    tokens_per_step = options.seq_len * options.batch_size * options.grad_accum * world
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_Blocks(train_blocks),
        eval_dataset=_Blocks(eval_blocks),
        optimizers=(optimizer, scheduler),
        callbacks=[monitor := _monitor(out, steps, tokens_per_step, show_progress)],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the Monitor callback reports progress instead
    started = time.perf_counter()
    try:
        trainer.train(resume_from_checkpoint=True if resume else None)
    except KeyboardInterrupt:  # Ctrl-C is the user's doing, not a failure: no cause to show (from None below)
        monitor.stop()
        if trainer.state.global_step > 0:
            trainer._save_checkpoint(trainer.model, trial=None)
        raise DeltafyError(
            f"interrupted at step {trainer.state.global_step}; a checkpoint was saved in {state_dir}: "
            f"continue with the same command plus --resume"
        ) from None
    bad = getattr(trainer.state, "deltafy_nonfinite", None)
    if bad is not None:
        raise DeltafyError(
            f"the loss became NaN/inf at step {bad}; training stopped without saving a model. Checkpoints "
            f"from before are in {state_dir}: resume from one with a lower --lr or --gate-lr-scale"
        )
    done = max(trainer.state.global_step, 1)
    seconds = (time.perf_counter() - started) / done
    result = TrainResult(
        steps=trainer.state.global_step,
        loss_before=before,
        loss_after=float("nan"),
        seconds_per_step=seconds,
        trainable_params=trainable,
        out=out,
    )
    if is_main_process():
        status("held-out loss after training")
        # The model as trained (with its LoRA adapters, when it has any): what the run produced.
        result.loss_after = evaluate(trainer.model, eval_blocks, options.batch_size).loss
        result.mean_beta_per_layer = mean_beta_per_layer(trainer.model, eval_blocks)
        append_metrics(
            out,
            {
                "event": "summary",
                "loss_before": before,
                "loss_after": result.loss_after,
                "mean_beta_per_layer": result.mean_beta_per_layer,
                "steps": result.steps,
            },
        )
        status(f"writing {out}")
        model = unwrap_lora(trainer.model, options.merge_lora, out / "lora-adapter")
        save(model, out, tokenizer=tokenizer, provenance=model.config.deltafy.get("provenance"), into=True)
    _leave_process_group()
    return result


def _leave_process_group() -> None:
    """In a distributed run, every rank waits for the main process to write the model, then leaves
    the process group: a gloo group left to interpreter shutdown can abort its process (SIGABRT,
    "terminate called without an active exception"), which fails the whole torchrun job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
