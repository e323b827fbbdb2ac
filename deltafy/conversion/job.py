"""The whole conversion job behind ``deltafy convert``: load, convert, self-check, save."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint import save
from ..errors import DeltafyError
from ..options import convert_options
from ..recipe import Recipe, load_recipe
from ..sources.folders import check_output_dir, output_path, refuse_overlap
from ..sources.load import (
    ALIASES,
    Source,
    download_snapshot,
    gguf_folder,
    is_gguf_file,
    is_hub_id,
    load_config,
    load_source,
    refuse_deltafy_folder,
)
from ..surgery import convert, summarize
from .stream import StreamPlan, check_space, plan_stream, write_tensors
from .verify import CheckReport, make_inputs, record_reference, self_check

LAYERWISE_ABOVE = 2 << 30  # bytes of weights above which the self-check reads one decoder layer at a time

Progress = Callable[[str, int, int], None]  # (what, advance, total): bytes written, layers checked


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
    extra_stream_values: int = 0  # expanded state: values per token the stream holds beyond one stream
    element_size: int = 4  # bytes per value in the model's dtype


@dataclass
class ConversionResult:
    plan: Plan
    check: CheckReport | None
    out: Path | None
    provenance: dict = field(default_factory=dict)
    shards: dict[str, int] = field(default_factory=dict)  # streamed: how many shards were linked, copied, cast


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
        extra_stream_values=summary.extra_stream_values,
        element_size=next(model.parameters()).element_size(),
    )


def plan_source(source: str, recipe: Recipe | str | None = None) -> Plan:
    """The conversion plan from the model's config alone (built on the meta device: no weights read)."""
    from transformers import AutoModelForCausalLM

    recipe = load_recipe(recipe)
    path = Path(source).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        refuse_deltafy_folder(path, source)
        config = load_config(str(path), source, local_files_only=True)
        with torch.device("meta"):  # the heads too: a plan reads no weights and makes none
            return plan_for(convert(AutoModelForCausalLM.from_config(config), recipe))
    return plan_for(convert(load_source(source).model, recipe))


def convert_source(
    source: str,
    out: str | Path,
    recipe: Recipe | str | None = None,
    *,
    overwrite: bool = False,
    status: Callable[[str], None] = lambda message: None,
    progress: Progress | None = None,
    **settings,
) -> ConversionResult:
    """Convert ``source`` (Hub id, folder, .gguf or alias) and save it at ``out``; ``settings`` are
    ConvertOptions' (dtype, verify, tolerance, device, heads_only, streaming), checked before any work.

    With ``verify`` the converted model is compared with the original before anything is
    written, in the dtype it was loaded in; a failed check raises and leaves ``out`` untouched.
    ``tolerance`` bounds max |Δlogits| in fp32; in bf16/fp16 the bound is at least the logits' own
    rounding (verify.logit_tolerance). ``heads_only`` writes only the new heads, with ``source``
    pinned as the base they load onto.

    A folder of safetensors files is converted without loading the model (deltafy.conversion.stream), and so
    are a Hub model (fetched into the HF cache) and a .gguf file or alias (through deltafy's cached
    HF-format copy of it): the shards are linked or copied into ``out`` beside a shard of heads
    (families whose files transformers remaps on load are loaded whole). The self-check runs on
    the written files, a decoder layer at a time when the weights are larger than LAYERWISE_ABOVE
    or ``streaming`` is True. ``streaming`` False loads the whole model, as for other sources.
    ``progress(what, advance, total)`` reports bytes written and layers checked.
    """
    options = convert_options(**settings)
    dtype, verify, tolerance, device = options.dtype, options.verify, options.tolerance, options.device
    heads_only, streaming = options.heads_only, options.streaming
    guard_source(source, out, heads_only)  # (in the user's spelling of --out)
    out = output_path(out)
    check_output_dir(out, overwrite)
    recipe = load_recipe(recipe)
    folder, provenance = Path(source).expanduser(), None
    if streaming is not False and device is None and is_hub_id(source):
        status(f"fetching {source} from the Hugging Face Hub")
        folder, provenance = download_snapshot(source) or (folder, None)
        refuse_overlap(out, [("the downloaded model", folder)], [("the base model", folder)] if heads_only else [])
    elif streaming is not False and device is None and (source in ALIASES or is_gguf_file(folder)):
        status(f"reading {source} through deltafy's cache (dequantized on first use only)")
        cached, provenance = gguf_folder(source)
        folder = cached or folder
    if streaming is not False and folder.is_dir() and (folder / "config.json").is_file() and device is None:
        refuse_deltafy_folder(folder, source)
        status(f"reading the config and file headers of {source}")
        plan = plan_stream(folder, recipe, dtype)
        if not isinstance(plan, str):
            plan.provenance = provenance or plan.provenance
            return _convert_streaming(
                plan, source, out, verify, overwrite, tolerance, status, progress, heads_only, streaming
            )
        if streaming:
            raise DeltafyError(f"{source} cannot be converted by streaming: {plan}; convert it without --streaming")
        status(f"loading the whole model ({plan})")
    elif streaming:  # (with --device: refused by ConvertOptions)
        raise DeltafyError(f"{source} has no safetensors weights on this machine to stream; drop --streaming")
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
        check = _passed(self_check(model, reference, tolerance=tolerance))
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


def guard_source(source: str, out: Path, heads_only: bool) -> None:
    """Refuse an ``out`` that is, or holds, what converting ``source`` reads: the source itself (a
    folder, a .gguf file, an alias's file) and deltafy's dequantized copies of GGUF files (nor may it
    lie inside those); with ``heads_only``, nor inside the source, which the output loads as its base."""
    from ..sources.load import cache_dir, resolve_alias

    path = resolve_alias(source) if source in ALIASES else Path(source).expanduser()
    source_read = [("the source", path)] if path.exists() else []
    cache = [("deltafy's cache of dequantized GGUF models", cache_dir() / "gguf")]
    gguf = source in ALIASES or is_gguf_file(path)
    base = [("the base model", path)] if heads_only and path.exists() else []
    refuse_overlap(out, [] if heads_only else source_read, base + (cache if gguf else []))


def _passed(check: CheckReport) -> CheckReport:
    if not check.passed:
        raise DeltafyError(
            f"self-check failed: max |Δlogits| {check.max_abs_dlogits:.3g} "
            f"(tolerance {check.tolerance:.3g} in {check.dtype}), "
            f"β=0 bitwise {check.beta_zero_bitwise}, greedy identical "
            f"{'not checked' if check.greedy_identical is None else check.greedy_identical}; "
            f"nothing was written (try a more negative gate_bias in the recipe)"
        )
    return check


def _convert_streaming(
    plan: StreamPlan, source, out, verify, overwrite, tolerance, status, progress, heads_only, layerwise
) -> ConversionResult:
    from ..sources.shards import INDEX_FILE

    layerwise = bool(layerwise) or plan.nbytes > LAYERWISE_ABOVE
    report = progress or (lambda what, advance, total: None)
    if not heads_only:
        check_space(plan, out)
    checked: list[CheckReport] = []
    shards: dict[str, int] = {}

    def write(folder: Path) -> None:
        status(f"writing {out}")
        total = plan.write_bytes
        shards.update(write_tensors(plan, folder, lambda nbytes: report("writing weights", nbytes, total)))

    def check(folder: Path) -> dict:
        if layerwise:
            from .verify import layerwise_self_check

            status("self-check, a decoder layer at a time")
            weights = plan.weights(folder if (folder / INDEX_FILE).is_file() else None)
            result = layerwise_self_check(
                load_config(str(plan.folder), source, local_files_only=True),
                plan.model.config.deltafy,
                {name: t for name, t in plan.model.state_dict().items() if ".delta." in name},
                weights,
                tokenizer=plan.tokenizer,
                tolerance=tolerance,
                progress=lambda done, total: report("self-check (layers)", 1, total),
            )
        else:
            status("self-check: the written model vs the original")
            result = _check_written(plan, folder, tolerance)
        checked.append(_passed(result))
        return result.to_dict()

    save(
        plan.model,
        out,
        tokenizer=plan.tokenizer,
        provenance=plan.provenance,
        check=check if verify else None,
        overwrite=overwrite,
        heads_only=heads_only,
        base=source if heads_only else None,
        tensors=None if heads_only else write,
    )
    check = checked[0] if checked else None
    return ConversionResult(plan_for(plan.model), check, out, provenance=plan.provenance, shards=shards)


def _check_written(plan: StreamPlan, folder: Path, tolerance: float) -> CheckReport:
    """Today's whole-model self-check, on the files as written: the original loaded from the source,
    its outputs recorded and dropped, then the written folder loaded the way its users will load it."""
    from transformers import AutoModelForCausalLM

    from ..checkpoint import load
    from ..quiet import quiet_transformers
    from ..sources.load import NO_REMOTE_CODE

    dtype = plan.model.dtype
    with quiet_transformers():
        stock = AutoModelForCausalLM.from_pretrained(plan.folder, dtype=dtype, **NO_REMOTE_CODE).eval()
        reference = record_reference(stock, *make_inputs(stock, plan.tokenizer))
        del stock
        converted = load(folder, dtype=dtype)
    return self_check(converted, reference, tolerance=tolerance)
