"""The whole conversion job behind ``deltafy convert``: load, convert, self-check, save."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import save
from .convert import convert, summarize
from .errors import DeltafyError
from .folders import check_output_dir
from .recipe import Recipe, load_recipe
from .sources import Source, load_source
from .verify import CheckReport, make_inputs, record_reference, self_check


@dataclass
class Plan:
    """What a conversion does to a model (also the whole output of ``--dry-run``)."""

    model_type: str
    layout: str
    layers: int
    sites: list[dict]
    params_base: int
    params_added: int
    recipe: Recipe


@dataclass
class ConversionResult:
    plan: Plan
    check: CheckReport | None
    out: Path | None
    provenance: dict = field(default_factory=dict)


def plan_for(model: torch.nn.Module) -> Plan:
    spec = model.config.deltafy
    summary = summarize(model)
    return Plan(
        model_type=spec["base_model_type"],
        layout=spec["layout"],
        layers=summary.layers,
        sites=spec["sites"],
        params_base=summary.params_base,
        params_added=summary.params_added,
        recipe=Recipe.model_validate(spec["recipe"]),
    )


def plan_source(source: str, recipe: Recipe | str | None = None) -> Plan:
    """The conversion plan from the model's config alone (built on the meta device: no weights read)."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(recipe)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        from .sources import load_config, refuse_deltafy_folder

        refuse_deltafy_folder(path, source)
        config = load_config(str(path), source, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = load_source(source).model
    return plan_for(convert(model, recipe))


def convert_source(
    source: str,
    out: str | Path,
    recipe: Recipe | str | None = None,
    dtype: str = "auto",
    verify: bool = True,
    overwrite: bool = False,
    tolerance: float = 1e-3,
    device: str | None = None,
    status: Callable[[str], None] = lambda message: None,
    heads_only: bool = False,
) -> ConversionResult:
    """Convert ``source`` (Hub id, folder, .gguf or alias) and save it at ``out``.

    With ``verify`` the converted model is compared with the original before anything is
    written, in the dtype it was loaded in; a failed check raises and leaves ``out`` untouched.
    ``tolerance`` bounds max |Δlogits| in fp32; in bf16/fp16 the bound is at least the logits' own
    rounding (verify.logit_tolerance). ``heads_only`` writes only the new heads, with ``source``
    pinned as the base they load onto.
    """
    out = Path(out).expanduser()
    check_output_dir(out, overwrite)
    recipe = load_recipe(recipe)
    status(f"loading {source}")
    loaded: Source = load_source(source, dtype)
    model = loaded.model
    if device:
        model.to(device)
    reference = None
    if verify:
        status("recording the original model's outputs")
        inputs = make_inputs(model, loaded.tokenizer)
        reference = record_reference(model, *inputs)
    status(f"converting with recipe {recipe.name}")
    convert(model, recipe)
    check = None
    if verify:
        status("self-check: converted vs original")
        check = self_check(model, reference, tolerance=tolerance)
        if not check.passed:
            raise DeltafyError(
                f"self-check failed: max |Δlogits| {check.max_abs_dlogits:.3g} "
                f"(tolerance {check.tolerance:.3g} in {check.dtype}), "
                f"β=0 bitwise {check.beta_zero_bitwise}, greedy identical {check.greedy_identical}; "
                f"nothing was written (try a more negative gate_bias in the recipe)"
            )
    status(f"writing {out}")
    save(
        model,
        out,
        tokenizer=loaded.tokenizer,
        provenance=loaded.provenance,
        check=check.to_dict() if check else None,
        overwrite=overwrite,
        heads_only=heads_only,
        base=source if heads_only else None,
    )
    return ConversionResult(plan=plan_for(model), check=check, out=out, provenance=loaded.provenance)
