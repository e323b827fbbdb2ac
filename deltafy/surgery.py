"""In-memory surgery: attach Deep Delta Learning heads to a loaded transformers model, and take them off."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .architectures import layout_for, site_specs
from .errors import DeltafyError
from .fused import enable_where_available
from .modeling_deltafy import DELTAFY_FORMAT_VERSION, DeltaSite, DeltaSpec, apply_deltafy, remove_deltafy
from .recipe import Recipe, load_recipe


def build_spec(config, recipe: Recipe, architecture: str | None = None) -> dict:
    """The ``deltafy`` config section that fully describes the surgery for ``config``'s model:
    the DeltaSpec (what the modeling file reads) plus what a reader of the checkpoint wants to know."""
    layout = layout_for(config)
    spec = DeltaSpec(
        layers=layout.layers,
        hidden_size=int(config.hidden_size),
        sites=site_specs(config, tuple(recipe.sites)),
        **{
            name: getattr(recipe, name)
            for name in ("direction", "rank", "gate_bias", "eps", "gate", "channels", "erase")
        },
    )
    return {
        "format_version": DELTAFY_FORMAT_VERSION,
        "base_model_type": config.model_type,
        "base_architecture": architecture or (config.architectures or [None])[0],
        "layout": layout.description,
        "parallel": layout.parallel,
        **spec.to_dict(),
        "recipe": recipe.model_dump(mode="json"),
    }


def delta_sites(model: nn.Module):
    """Yield (qualified name, DeltaSite) for every site of a converted model."""
    return ((name, module) for name, module in model.named_modules() if isinstance(module, DeltaSite))


def delta_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor deltafy added (the sites' heads, an expanded stream's final read) by its state-dict name."""
    return {
        f"{prefix}{'.' if prefix else ''}delta.{key}": tensor
        for prefix, module in model.named_modules()
        if isinstance(getattr(module, "delta", None), nn.ModuleDict)
        for key, tensor in module.delta.state_dict().items()
    }


def is_converted(model: nn.Module) -> bool:
    return any(True for _ in delta_sites(model))


def _require_converted(model: nn.Module) -> None:
    if not is_converted(model):
        raise DeltafyError("this model is not converted; call deltafy.convert(model) first")


def convert(model: nn.Module, recipe: Recipe | str | dict | None = None) -> nn.Module:
    """Turn every residual write of ``model`` (a loaded Hugging Face decoder) into a DDL write, in
    place, and return it.

    The model's outputs are unchanged: bitwise where the recipe's strength α starts at 0 (every
    bundled recipe but ddl-scalar-logit), up to the initial β (about 3e-8) with a logit gate; the new
    heads are the only new parameters. ``recipe`` is a :class:`Recipe`, a bundled recipe name, a
    YAML path or a dict of a recipe file's keys (default: the paper's scalar recipe). :func:`unconvert` undoes it.
    """
    if not (isinstance(model, nn.Module) and hasattr(model, "config")):
        got = f"the {type(model).__name__} {model!r}" if isinstance(model, (str, Path)) else f"a {type(model).__name__}"
        raise DeltafyError(
            f"deltafy.convert takes a loaded Hugging Face model, e.g. AutoModelForCausalLM.from_pretrained(...), "
            f"and got {got}"
        )
    if is_converted(model):
        raise DeltafyError("this model is already a deltafy model; convert the original instead")
    _refuse_wrapper(model, "convert")
    recipe = load_recipe(recipe)
    config = model.config
    spec = build_spec(config, recipe, architecture=type(model).__name__)
    apply_deltafy(model, spec)
    config.deltafy = spec
    enable_where_available(model)
    return model


def unconvert(model: nn.Module) -> nn.Module:
    """Remove the DDL heads and restore the original forwards, in place: the original model again,
    bitwise (whatever the heads learned is dropped). A wrapper installed on a site module after
    conversion (accelerate's hooks, say) stays in place and keeps working."""
    _refuse_wrapper(model, "unconvert")
    remove_deltafy(model)
    model.config.__dict__.pop("deltafy", None)
    return model


def _refuse_wrapper(model: nn.Module, verb: str) -> None:
    """A wrapper that hands attribute reads on to a model (torch.compile's, peft's) reaches the layers
    but holds none of the surgery's marks, and a compiled graph keeps the forwards it traced."""
    if hasattr(model, "_orig_mod"):
        raise DeltafyError(
            f"this is torch.compile's wrapper of a model: {verb} the model itself (model._orig_mod), then "
            f"compile the result"
        )
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        if verb == "unconvert":
            raise DeltafyError("this is a peft model: unconvert the model inside it, model.get_base_model()")
        raise DeltafyError(
            "this is a peft model: convert the model before adding adapters, or merge them first with "
            "model.merge_and_unload() (deltafy train --train heads+lora adds LoRA to a converted model)"
        )


@dataclass
class SiteSummary:
    layers: int
    sites_per_layer: int
    params_added: int
    params_base: int
    channels: int = 1
    hidden_size: int = 0

    @property
    def extra_stream_values(self) -> int:
        """Values per token the expanded stream holds beyond the original's one stream (activation
        memory, per layer boundary and per saved activation in training; the KV cache is unchanged)."""
        return (self.channels - 1) * self.hidden_size


def summarize(model: nn.Module) -> SiteSummary:
    _require_converted(model)
    sites = list(delta_sites(model))
    added = sum(t.numel() for t in delta_tensors(model).values())
    total = sum(p.numel() for p in model.parameters())
    spec = model.config.deltafy
    return SiteSummary(
        layers=len(sites) // max(len(spec["sites"]), 1),
        sites_per_layer=len(spec["sites"]),
        params_added=added,
        params_base=total - added,
        channels=int(spec.get("channels", 1)),
        hidden_size=int(spec["hidden_size"]),
    )


def delta_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter deltafy added, in the order of ``delta_tensors``."""
    named = dict(model.named_parameters(remove_duplicate=False))
    return [named[name] for name in delta_tensors(model) if name in named]


def mean_betas(model: nn.Module, run) -> dict[str, float]:
    """Mean beta per site (qualified name) over whatever forwards ``run()`` performs; for a site
    with a strength (gate: strength), alpha * beta, the factor its correction is applied with."""
    betas: dict[str, list[torch.Tensor]] = {}
    handles = []
    for name, site in delta_sites(model):
        betas[name] = []

        def record(site, args, log=betas[name]):
            c = args[1].to(torch.promote_types(args[1].dtype, torch.float32))
            beta = 2.0 * torch.sigmoid(site.heads(c)[0].detach()).float().mean()
            log.append(beta if site.strength is None else beta * site.strength.detach().float())

        handles.append(site.register_forward_pre_hook(record))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return {name: float(torch.stack(log).mean()) if log else float("nan") for name, log in betas.items()}


def head_parameter_groups(model: nn.Module, recipe: Recipe | None = None) -> list[dict]:
    """AdamW parameter groups for the DDL heads: gates at ``lr * gate_lr_scale``, the rest at ``lr``.

    Adam moves each parameter by about its learning rate per step whatever the gradient's size,
    so the gate logit (initialized at -18) needs a larger step to open in a few dozen steps.
    """
    _require_converted(model)
    if recipe is None:
        recipe = Recipe.model_validate(model.config.deltafy["recipe"])
    t = recipe.training
    gates = []
    for _, site in delta_sites(model):
        # alpha (gate: strength) moves with the gate: both set how strongly the correction acts
        gates += [*site.gate.parameters(), *([site.strength] if site.strength is not None else [])]
    gate_ids = {id(p) for p in gates}
    # every other head deltafy added, in the layers' order: targets, directions, an expanded stream's reads
    others = [p for p in delta_parameters(model) if id(p) not in gate_ids]
    return [
        {"params": others, "lr": t.lr, "weight_decay": t.weight_decay, "name": "heads"},
        # The gate's gradient is proportional to beta (~1e-8 at init), below AdamW's default eps of
        # 1e-8, which would silently shrink its steps a hundredfold; a tiny eps keeps them lr-sized.
        {"params": gates, "lr": t.lr * t.gate_lr_scale, "weight_decay": 0.0, "eps": 1e-20, "name": "gate"},
    ]


__all__ = [
    "convert",
    "unconvert",
    "build_spec",
    "summarize",
    "head_parameter_groups",
    "is_converted",
    "delta_parameters",
    "delta_sites",
    "delta_tensors",
    "mean_betas",
    "DeltaSite",
]
