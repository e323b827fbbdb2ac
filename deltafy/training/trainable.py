"""Which parameters of a converted model train: its DDL heads (with the gate's own learning rate),
LoRA adapters from peft, or everything; and the plain model back after LoRA training."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..errors import DeltafyError, first_line
from ..options import TrainOptions
from ..placement import input_device
from ..recipe import ADAPTER_MODES, HEAD_MODES, Mode
from ..sources.folders import readable
from ..surgery import mean_betas


def select_trainable(model, mode: Mode, options: TrainOptions):
    """Freeze what must not train; wrap in LoRA when asked. Returns (model, optimizer groups)."""
    from ..recipe import Recipe
    from ..surgery import head_parameter_groups

    recipe = Recipe.model_validate(model.config.deltafy["recipe"]).model_copy(update={"training": options})
    for p in model.parameters():
        p.requires_grad_(False)
    groups = []
    if mode in ADAPTER_MODES:
        model = (_with_ia3 if mode == "ia3" else _with_lora)(model, options)
        adapter = [p for n, p in model.named_parameters() if "lora_" in n or "ia3_" in n]
        name = "ia3" if mode == "ia3" else "lora"
        groups.append({"params": adapter, "lr": options.lora_lr, "weight_decay": options.weight_decay, "name": name})
    if mode in HEAD_MODES:
        groups += head_parameter_groups(model, recipe)
    if mode == "ln-tuning":
        norms = _norm_parameters(model, options)
        groups.append({"params": norms, "lr": options.lora_lr, "weight_decay": options.weight_decay, "name": "norms"})
    if mode in ("base", "all"):  # base: the original trained in full (the heads stay as they are: off at init)
        heads = {id(p) for g in head_parameter_groups(model, recipe) for p in g["params"]}
        base = [p for p in model.parameters() if id(p) not in heads]
        groups.append({"params": base, "lr": options.lora_lr, "weight_decay": options.weight_decay, "name": "base"})
    for group in groups:
        for p in group["params"]:
            # Adam's steps on bf16 weights would round away below 1/256 of the weight: what trains is float32
            # (a model held in bf16 keeps only its frozen weights so; the heads read them in float32)
            if p.dtype != torch.float32:
                p.data = p.data.float()
            p.requires_grad_(True)
    return model, [g for g in groups if g["params"]]


def _with_lora(model, options: TrainOptions):
    from peft import LoraConfig
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
        use_dora=options.lora_dora,
    )
    return _adapted(model, config, defaults, "LoRA")


def _with_ia3(model, options: TrainOptions):
    """peft's (IA)^3: a learned scale on each target's output (on its input for the feed-forward ones)."""
    from peft import IA3Config
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_FEEDFORWARD_MODULES_MAPPING as FEEDFORWARD
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as TARGETS

    family = model.config.deltafy["base_model_type"]
    targets = options.lora_targets or TARGETS.get(family)
    if not targets:
        raise DeltafyError("peft has no default (IA)^3 targets for this family; pass --lora-targets")
    feedforward = [m for m in FEEDFORWARD.get(family, ()) if m in targets]
    config = IA3Config(target_modules=targets, feedforward_modules=feedforward, task_type="CAUSAL_LM")
    return _adapted(model, config, TARGETS.get(family), "(IA)^3")


def _norm_parameters(model, options: TrainOptions) -> list:
    """LayerNorm tuning: the parameters of the norms peft's LN tuning targets for the family, trained in
    place. peft's own LNTuningLayer trains a deep copy of each norm and swaps it in at merge, the same
    model in the end; but the copy would carry the forward deltafy installed on the norm, with copies of
    its sites, and the stream those sites read would never reach the writes."""
    from peft import LNTuningConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LNTUNING_TARGET_MODULES_MAPPING as TARGETS

    targets = options.lora_targets or TARGETS.get(model.config.deltafy["base_model_type"])
    if not targets:
        raise DeltafyError("peft has no default LN-tuning targets for this family; pass --lora-targets")
    config = LNTuningConfig(target_modules=targets)
    found = [m for name, m in model.named_modules() if name and check_target_module_exists(config, name)]
    params = [p for module in found for p in module.parameters(recurse=False)]
    if not params:
        raise DeltafyError(f"LN tuning: no module of this model matches {','.join(targets)} (check --lora-targets)")
    return params


def _adapted(model, config, defaults, what: str):
    from peft import get_peft_model

    _refuse_site_modules(model, config, defaults)
    try:
        with warnings.catch_warnings():  # peft reads the attribute transformers 5 deprecated: nothing to act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
            return get_peft_model(model, config)
    except ValueError as err:
        raise DeltafyError(f"{what}: {first_line(err)} (check --lora-targets)") from err


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
        _without_local_paths(adapter_dir)
        readable(adapter_dir)
    return model.unload()


def _without_local_paths(adapter_dir: Path) -> None:
    """peft writes where the model came from (a path on this machine) into the adapter's config, and a
    template card naming it: the checkpoint's own card describes the adapter, and no file of a folder
    that may be pushed names a place on this machine (the adapter's base is the model beside it)."""
    import json

    (adapter_dir / "README.md").unlink(missing_ok=True)
    config = adapter_dir / "adapter_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"base_model_name_or_path": None}, indent=2) + "\n")


BETA_BLOCKS = 4  # the held-out blocks a run's mean betas are measured on


def site_betas(model, blocks: torch.Tensor) -> tuple[dict[str, float], str]:
    """Mean beta per site (qualified name) on the first held-out blocks, and what it was measured on (the
    figure and the printed line say it: a beta is a per-token factor, its mean depends on the text)."""
    blocks = blocks[:BETA_BLOCKS]
    model.eval()
    with torch.no_grad():
        betas = mean_betas(model, lambda: model(input_ids=blocks.to(input_device(model))))
    first = "the first held-out block" if len(blocks) == 1 else f"the first {len(blocks)} held-out blocks"
    return betas, f"{first} of {blocks.shape[-1]} tokens"


def per_layer(betas: dict[str, float]) -> list[float]:
    """Site betas averaged over each layer's sites, in layer order."""
    layers: dict[int, list[float]] = {}
    for name, value in betas.items():
        layers.setdefault(int(name.split(".delta.")[0].rsplit(".", 1)[1]), []).append(value)
    return [sum(v) / len(v) for _, v in sorted(layers.items())]
