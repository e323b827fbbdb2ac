"""Sharded training (FSDP2 or DeepSpeed ZeRO through the Trainer) and getting a whole model back out of it.

Only the heads (and LoRA) train; the base is frozen, so after a sharded run the model to save is
the input's base plus the trained tensors. Rank 0 rebuilds it that way: every rank gathers just
the trained parameters (a few MB for heads, not the base's GB), and the base's tensors are read
back from the input, bitwise as they were.
"""

from __future__ import annotations

import contextlib
import os

import torch

from ..errors import DeltafyError


def launched_distributed() -> bool:
    """Whether torchrun / accelerate launch started this process (they set LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "-1")) >= 0


def check_launch(options) -> None:
    if options.fsdp and not launched_distributed():
        raise DeltafyError(
            "--fsdp shards the model over the processes of a distributed launch, and this is a single plain "
            "process; run it as `torchrun --nproc_per_node N -m deltafy train ... --fsdp`, or drop --fsdp"
        )


def decoder_layer_class(model) -> str:
    """The class FSDP wraps as one unit: a decoder layer, with its DDL heads inside it."""
    return model.get_submodule(model.config.deltafy["layers"])[0].__class__.__name__


def fsdp_arguments(model, options) -> dict:
    """TrainingArguments for FSDP2 over ``model`` (before any LoRA wrapping; peft keeps the class)."""
    if not options.fsdp:
        return {}
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            # One unit per decoder layer: its frozen weights and its trainable heads (and LoRA)
            # are gathered together for its forward and backward, then freed again.
            "transformer_layer_cls_to_wrap": [decoder_layer_class(model)],
            # The Trainer's checkpoints and the final save need whole tensors, gathered on rank 0.
            "state_dict_type": "FULL_STATE_DICT",
            "reshard_after_forward": True,
            # Every rank loaded the model itself (deltafy.load); FSDP shards what each holds.
            "cpu_ram_efficient_loading": False,
        },
    }


def is_sharded(trainer) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False))


def gather_trained(model) -> dict[str, torch.Tensor]:
    """The full value of every trainable parameter, on every rank (a collective: all ranks call it).

    FSDP2 holds each parameter as a DTensor shard; ``full_tensor`` all-gathers it. ZeRO-3 leaves an
    empty tensor in each partitioned parameter; ``GatheredParameters`` fills in the trainable ones
    for a moment (never the frozen base)."""
    trained = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    gathered = {}
    with _zero3_gathered([param for _, param in trained]):
        for name, param in trained:
            value = param.detach()
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            gathered[name] = value.cpu().clone()
    return gathered


def _zero3_gathered(params: list[torch.Tensor]):
    if not any(hasattr(p, "ds_id") for p in params):  # ZeRO-3 marks the parameters it partitions
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)  # read-only, on every rank


def rebuild(model_dir: str, options, trained: dict[str, torch.Tensor], dtype: torch.dtype, base=None):
    """The model as trained, unsharded: the input loaded again (the frozen base exactly as it is
    on disk; a heads-only input's from ``base`` where it moved), wrapped like the trained one (LoRA),
    with the trained tensors put in."""
    from ..checkpoint import load
    from .trainable import select_trainable

    _leave_zero3()
    model = load(model_dir, dtype=dtype, base=base, adapter=False)  # (as the run loaded it)
    model, _ = select_trainable(model, options.train, options)
    params = dict(model.named_parameters())
    missing = sorted(set(trained) - set(params))
    if missing:  # the wrapping differs from the trained model's: saving would drop trained tensors
        raise DeltafyError(f"the sharded run trained parameters the rebuilt model lacks: {', '.join(missing[:3])}")
    with torch.no_grad():
        for name, value in trained.items():
            params[name].copy_(value)
    return model


def _leave_zero3() -> None:
    """Under a ZeRO-3 run transformers builds every model it loads inside ``deepspeed.zero.Init``,
    partitioned over all ranks; the rebuilt model is rank 0's alone and the run is over, so models
    are loaded as plain ones from here on."""
    try:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
    except ImportError:  # no deepspeed: nothing was partitioned
        return
    unset_hf_deepspeed_config()


def sharded_trainer(trainer_class, make_optimizer, make_scheduler):
    """A maker of ``trainer_class`` instances (it takes the Trainer's keywords) that build deltafy's
    optimizer and schedule themselves, with FSDP kept on where accelerate would drop it, and DeepSpeed
    (an accelerate config) let through.

    The Trainer refuses ready-made ``optimizers`` under FSDP (the optimizer must be built on the
    parameters it is about to shard), so ``make_optimizer()`` and ``make_scheduler(optimizer)``
    are called when it asks. accelerate turns FSDP on only for GPU-like devices: on CPU processes
    (gloo) it would silently train with DDP, a full copy per rank; torch's FSDP2 runs on CPU, so
    the run is switched to it, along accelerate's own FSDP code path, as a GPU run would be."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class ShardedTrainer(trainer_class):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            # --compile: each decoder layer compiled on its own, the first layer's code serving the others
            # (accelerate's regional compilation): a deep model's first step compiles in a shallow one's time
            state.dynamo_plugin.use_regional_compilation = self.args.torch_compile
            if self.is_deepspeed_enabled:
                if self.args.torch_compile and state.deepspeed_plugin.zero_stage == 3:
                    # its forward would read the empty partitions: the hooks that gather them run outside the graph
                    raise DeltafyError(
                        "--compile does not work with DeepSpeed ZeRO-3, whose partitioned parameters torch.compile "
                        "cannot see; drop --compile, or shard with FSDP (torchrun ... --fsdp --compile)"
                    )
                _skip_shared_memory_kernel()
                return
            if state.distributed_type != DistributedType.MULTI_CPU:
                return
            if self.args.fsdp_plugin_args is not None:  # --fsdp
                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            elif os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":  # an accelerate FSDP config
                plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings accelerate launch exported
            else:
                return
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = plugin
            self.is_fsdp_enabled = True

        def train(self, resume_from_checkpoint=None, *args, **kwargs):
            if resume_from_checkpoint and self.is_deepspeed_enabled:
                # DeepSpeed reloads its module state strictly, and deltafy's checkpoints leave the frozen base out.
                raise DeltafyError(
                    "--resume does not work with DeepSpeed yet; start again in a new --out, or train with FSDP "
                    "(examples/accelerate_fsdp.yaml or torchrun ... --fsdp), whose runs resume"
                )
            return super().train(resume_from_checkpoint, *args, **kwargs)

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = self._make_optimizer()
            return self.optimizer

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = self._make_scheduler(optimizer or self.optimizer)
                self._created_lr_scheduler = True
            return self.lr_scheduler

    def make(**kwargs):
        # the makers live on the instance, not in the class's closure: a class is always in a reference cycle, and
        # the run they hold (its model and optimizer) would outlive it until the garbage collector ran
        trainer = ShardedTrainer.__new__(ShardedTrainer)
        trainer._make_optimizer, trainer._make_scheduler = make_optimizer, make_scheduler
        trainer.__init__(**kwargs)
        return trainer

    return make


def _skip_shared_memory_kernel() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce kernel when its comm starts
    (minutes, and a C++ compiler); only its inference all-reduce uses it, while ZeRO training talks
    through gloo. Marking the kernel unavailable (DeepSpeed's own probe result) skips the build."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


# The work of a run's latest barrier, kept until the next one or the interpreter's end (see barrier).
_LAST_BARRIER: list = []


def barrier() -> None:
    """dist.barrier(), its work kept referenced until the next barrier or the interpreter's end. A gloo
    worker thread drops its own reference just after the barrier completes; had it the last one, it would
    free the work's tensor from that thread, taking the GIL, and once the interpreter is shutting down that
    ends the thread inside a C++ destructor: the process aborts (SIGABRT, "terminate called without an
    active exception"). A rank exits right after its last barrier (after the model was written, or a stop's
    checkpoint), and under FSDP the group outlives destroy_process_group, held by the device mesh that
    DTensor's caches keep, so its threads are still running then."""
    import torch.distributed as dist

    work = dist.barrier(async_op=True)
    if work is not None:  # (None: a backend that waited in the call)
        work.wait()
        _LAST_BARRIER[:] = [work]


def leave_process_group() -> None:
    """In a distributed run, every rank waits for the main process to write the model, then leaves the
    process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        barrier()
        dist.destroy_process_group()
