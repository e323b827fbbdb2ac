"""The ``deltafy train`` job: the run prepared (data, trainable parameters) and fitted (Trainer, callbacks,
the loss before); what it reports and saves at the end is result.py's."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import interrupts
from ..errors import DeltafyError, Interrupted, first_line
from ..files import ADAPTER_DIR, CONFIG_FILE, METRICS_FILE, STATE_DIR
from ..options import TrainOptions
from ..sources.folders import output_path
from ..sources.lock import RunLock
from .checkpoints import atomic_trainer, newest_complete, resume_point, step_of
from .launch import (
    check_heads_only,
    check_seq_len,
    computes_in_bf16,
    held_dtype,
    is_main_process,
    kept_dtype,
    planned_steps,
    read_by,
)
from .monitor import Stop, monitor, to_stderr
from .result import TrainResult, finish, finished_result
from .run_folder import (
    clear_run_state,
    compare_records,
    guard_out,
    read_record,
    remove_leftovers,
    run_record,
    write_record,
)
from .sharding import (
    check_launch,
    fsdp_arguments,
    leave_process_group,
    sharded_trainer,
)
from .trainable import select_trainable


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


class NonFiniteLoss(DeltafyError):
    """The loss became NaN or inf: the learning rate (or the data) sent training off the rails."""


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
    notice=to_stderr,
    heads_only: bool = False,
    base: str | Path | None = None,
) -> TrainResult:
    """Train ``model_dir`` into ``out``. ``status`` gets transient progress ("loading ..."),
    ``notice`` the lines the user should keep (what a resume changed or skipped). ``heads_only``
    saves a delta checkpoint over ``model_dir``'s base (which must be one itself); ``base`` is where
    a heads-only input's base is when it moved (checked against the hashes it recorded)."""
    from ..checkpoint import read_config

    reads, bases = read_by(model_dir, data, eval_data, base)
    if eval_data:
        from ..data import expand, refuse_shared_text

        refuse_shared_text(expand(data), expand(eval_data))  # (and a missing input, before anything is loaded)
    # before anything is loaded; a heads-only output points at the base: it may not be written inside it
    out = Path(out).expanduser()  # (the user's spelling, for the guard's messages; then where it leads)
    guard_out(out, model_dir, resume, overwrite, reads + ([] if heads_only else bases), bases if heads_only else [])
    out = output_path(out)
    config = read_config(model_dir)
    if heads_only:
        check_heads_only(config, options, model_dir)
    check_seq_len(config, options.seq_len)
    check_launch(options)
    # Rank 0 speaks for a torchrun job: it holds the lock and says what the run does.
    lock = RunLock(out) if is_main_process() else contextlib.nullcontext()
    notice = notice if is_main_process() else (lambda message: None)
    with lock, Stop() as stop:  # three stages: before the first step, the steps, after the last
        run = _prepare(
            model_dir, config, data, out, options, eval_data, resume, overwrite, status, notice, heads_only, base
        )
        if isinstance(run, TrainResult):  # a resumed run that had finished and written its model
            return run
        trainer, timing = _fit(run, show_progress, stop, status)
        result = finish(run, trainer, timing, status)
        leave_process_group()
        return result


@dataclass
class _Run:
    """What the three stages of a run hand on: prepared, it holds the model and its blocks; fit
    adds the trainer and the loss before; finish evaluates and saves."""

    model_dir: str
    out: Path
    options: TrainOptions
    data: list[str]
    eval_data: list[str] | None
    heads_only: bool
    base: str | Path | None
    main: bool
    state_dir: Path
    steps: int
    tokens_per_step: int
    checkpoint: Path | None  # the checkpoint a --resume continues from
    finished: bool  # that checkpoint is the last step: only its model remains to be written
    tokenizer: object = None
    model: object = None
    sharding: dict = field(default_factory=dict)  # TrainingArguments of an FSDP run
    groups: list = field(default_factory=list)  # the optimizer's parameter groups
    stored: torch.dtype = torch.float32  # the dtype the output is written in (see kept_dtype)
    held: torch.dtype = torch.float32  # the dtype the model is held in while it trains (see held_dtype)
    train_blocks: torch.Tensor | None = None
    eval_blocks: torch.Tensor | None = None
    trainable: int = 0
    before: float = float("nan")  # held-out loss before training (rank 0)


def _prepare(model_dir, config, data, out, options, eval_data, resume, overwrite, status, notice, heads_only, base):
    """Before the first step: the run's folder made ready (leftovers cleared, a resume checked against
    its record), the model loaded with what trains selected, the text tokenized."""
    from ..checkpoint import kept_adapter, load, load_tokenizer
    from ..data import fingerprint, pack, split_held_out, token_stream

    state_dir = out / STATE_DIR
    main = is_main_process()
    if main:
        remove_leftovers(out, state_dir, notice)
    checkpoint = resume_point(out, state_dir, notice) if resume else None
    torch.manual_seed(options.seed)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is None:
        raise DeltafyError(f"{model_dir} has no tokenizer; training needs one to read text")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = planned_steps(options, world)
    if main and world == 1 and (gpus := torch.cuda.device_count()) > 1:  # (_fit keeps the run on one)
        notice(
            f"this machine has {gpus} GPUs and a single process trains on the first; to train on all of them, "
            f"launch it as `torchrun --nproc_per_node {gpus} -m deltafy train ...` (add --fsdp to shard the model)"
        )
    record = run_record(
        model_dir,
        config["deltafy"],
        options,
        data,
        eval_data,
        fingerprint(data, tokenizer, options.text_field),
        fingerprint(eval_data, tokenizer, options.text_field) if eval_data else None,
    )
    finished = False
    if checkpoint is not None:
        saved = read_record(state_dir)
        if saved is None:
            notice(f"{state_dir} has no run record (an older deltafy's run): its settings cannot be checked")
        else:
            for change in compare_records(saved, record, out):
                notice(f"resuming with {change}")
        trained = step_of(checkpoint)
        if trained >= steps:
            if (out / CONFIG_FILE).is_file():
                # Not an error: a job restarted after it finished (a preemptible queue) must succeed.
                notice(
                    f"nothing to train: the run in {out} already trained {trained} of {steps} steps and wrote its "
                    f"model; pass a larger --steps with --resume to train further"
                )
                return finished_result(out, trained)
            finished = True
            notice(f"the run already trained {trained} of {steps} steps: writing its model from {checkpoint.name}")
    if main:
        if overwrite and not resume:
            clear_run_state(out, state_dir, out / METRICS_FILE)
        write_record(state_dir, record)
    if main and kept_adapter(model_dir) is not None:
        notice(
            f"{model_dir} keeps a LoRA adapter apart ({ADAPTER_DIR}/), which this run leaves out: it trains the model "
            f"without it; to train that run further, rerun it with --resume and a larger --steps"
        )
    tokens_per_step = options.seq_len * options.batch_size * options.grad_accum * world
    run = _Run(model_dir, out, options, data, eval_data, heads_only, base, main, state_dir, steps, tokens_per_step,
               checkpoint, finished, tokenizer)  # fmt: skip
    run.stored = kept_dtype(config, options)
    run.held = held_dtype(run.stored, options)

    status(f"loading {model_dir}")
    # base: a heads-only input's base, if it moved; a LoRA the input kept apart is not trained on (said above)
    run.model = load(model_dir, dtype=run.held, base=base, adapter=False)
    run.sharding = fsdp_arguments(run.model, options)  # before LoRA wraps it: it reads the decoder layers' class
    status("tokenizing")
    blocks = pack(token_stream(data, tokenizer, options.text_field), options.seq_len)
    if eval_data:
        run.train_blocks = blocks
        run.eval_blocks = pack(token_stream(eval_data, tokenizer, options.text_field), options.seq_len)
    else:
        run.train_blocks, run.eval_blocks = split_held_out(blocks, options.held_out, options.seed)
    run.eval_blocks = run.eval_blocks[: options.max_eval_blocks]
    passes = steps * tokens_per_step / options.seq_len / len(run.train_blocks)
    if main and passes > 1 and not finished:  # (a few blocks can make every step a batch of copies of them)
        notice(
            f"{steps} step{'s' * (steps != 1)} of {tokens_per_step // options.seq_len} blocks read the "
            f"{len(run.train_blocks):,} training blocks {passes:.1f} times over; pass more text (or fewer --steps) "
            f"if the held-out loss rises"
        )
    run.model, run.groups = select_trainable(run.model, options.train, options)
    run.trainable = sum(p.numel() for g in run.groups for p in g["params"])
    return run


def _fit(run: _Run, show_progress: bool, stop: Stop, status):
    """The Trainer over the run's blocks, the held-out loss before its first step (on the device it put the
    model on), trained to ``run.steps`` (or loaded at a finished run's last checkpoint); a non-finite loss
    or a signal ends it with the error that says what is kept."""
    from transformers import TrainingArguments, get_scheduler
    from transformers.trainer_callback import PrinterCallback

    from ..evaluate import evaluate

    options, steps, state_dir = run.options, run.steps, run.state_dir
    cuda = torch.cuda.is_available()

    args = TrainingArguments(
        output_dir=str(state_dir),
        max_steps=steps,
        per_device_train_batch_size=options.batch_size,
        gradient_accumulation_steps=options.grad_accum,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="steps",
        save_steps=options.save_every,
        save_total_limit=None,  # AtomicCheckpointTrainer keeps the newest KEEP_CHECKPOINTS itself
        eval_strategy="steps",
        eval_steps=options.eval_every,
        per_device_eval_batch_size=options.batch_size,
        prediction_loss_only=True,
        seed=options.seed,
        data_seed=options.seed,
        bf16=computes_in_bf16(options),
        report_to=[],
        disable_tqdm=True,
        remove_unused_columns=False,
        ddp_find_unused_parameters=False,
        save_only_model=False,
        use_cpu=not cuda,
        torch_compile=options.compile,
        **_checkpointing_args(options.gradient_checkpointing),
        **run.sharding,
    )
    if args.n_gpu > 1:  # one process that sees several GPUs: the Trainer would split each batch over them with
        # nn.DataParallel, whose replicas of a module share its forward, deltafy's site call, which runs the
        # original module (on the first GPU) on each replica's input; and the steps would hold n_gpu batches
        args._n_gpu = 1

    def make_optimizer():
        return torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in run.groups])

    def make_scheduler(optimizer):
        return get_scheduler(
            options.schedule if options.schedule != "constant" else "constant_with_warmup",
            optimizer,
            num_warmup_steps=int(options.warmup * steps),
            num_training_steps=steps,
        )

    trainer = sharded_trainer(atomic_trainer(), make_optimizer, make_scheduler)(
        model=run.model,
        args=args,
        train_dataset=_Blocks(run.train_blocks),
        eval_dataset=_Blocks(run.eval_blocks),
        callbacks=[progress := monitor(run.out, steps, run.tokens_per_step, show_progress, stop, _first_step(options))],
    )
    trainer.remove_callback(PrinterCallback)  # the Monitor callback reports progress instead
    status("held-out loss before training")
    # Where the Trainer put the model: a GPU; under FSDP or DeepSpeed, which shard it later, the CPU it was loaded
    # on, whole, on rank 0 (the after-training loss too: on the model rebuilt there), which costs a big model minutes
    if run.main:
        run.before = evaluate(run.model, run.eval_blocks, options.batch_size).loss
    if run.finished:
        trainer._load_from_checkpoint(str(run.checkpoint))
        trainer.state.global_step = step_of(run.checkpoint)
    else:
        stop.training = True
        try:
            with compiled_checkpointing() if options.compile else contextlib.nullcontext():
                trainer.train(resume_from_checkpoint=str(run.checkpoint) if run.checkpoint else None)
        except KeyboardInterrupt:  # a second signal: the user's doing, not a failure (from None below)
            last, _ = newest_complete(state_dir)
            kept = f"the last checkpoint is {last}" if last else "no checkpoint was saved"
            raise Interrupted(
                f"interrupted twice at step {trainer.state.global_step}: stopped at once without saving; {kept}",
                interrupts.received,
            ) from None
        except torch._dynamo.exc.TorchDynamoException as err:  # (only --compile runs torch.compile)
            raise DeltafyError(
                f"torch.compile could not compile the training step ({first_line(err, with_type=True)}); "
                f"train without --compile"
            ) from err
        finally:
            stop.training = False
            progress.stop()
    bad = getattr(trainer.state, "deltafy_nonfinite", None)
    if bad is not None:
        last, _ = newest_complete(state_dir)
        kept = f"the last checkpoint from before is {last}" if last else "no checkpoint was saved before it"
        raise NonFiniteLoss(
            f"the loss became NaN/inf at step {bad}; training stopped without saving a model ({kept}); start "
            f"again with a lower --lr or --gate-lr-scale in a new --out (or with --overwrite)"
        )
    if stop.signal is not None and trainer.state.global_step < steps:
        name = signal.Signals(stop.signal).name
        raise Interrupted(
            f"interrupted at step {trainer.state.global_step} by {name}; a checkpoint was saved in "
            f"{state_dir / f'checkpoint-{trainer.state.global_step}'}: continue with the same command plus --resume",
            stop.signal,
        )
    return trainer, progress.timing()


def _first_step(options) -> str:
    # a compiled run's first step takes minutes on a big model, with nothing shown: say why
    return "compiling the first step (torch.compile) …" * options.compile


def compiled_checkpointing():
    """Where torch.compile meets activation checkpointing: a layer's sites pass its stream from capture to write
    through the stash, a dict from outside the layer. Dynamo will not trace that mutation inside a checkpointed
    region (the recompute in the backward would replay it): it broke the graph there, and every layer ran
    eagerly. A layer leaves the stash as it found it, so the forward's effects, applied once, are what a replay
    would apply: dynamo may skip the replay, and each checkpointed layer compiles into one graph (a torch
    without the setting runs them eagerly, as before)."""
    if not hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def _checkpointing_args(enabled: bool) -> dict:
    """Activation checkpointing under the name this transformers reads: ``gradient_checkpointing``
    is a deprecated alias since v5, whose FutureWarning every run would otherwise print."""
    from dataclasses import fields

    from transformers import TrainingArguments

    names = {f.name for f in fields(TrainingArguments)}
    name = "activation" if "activation_checkpointing" in names else "gradient"
    kwargs = {"use_reentrant": False} if enabled else None
    return {f"{name}_checkpointing": enabled, f"{name}_checkpointing_kwargs": kwargs}
