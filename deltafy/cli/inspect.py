from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint import load, load_tokenizer
from ..conversion.verify import PROMPTS, make_inputs
from ..files import ADAPTER_DIR
from ..options import EvalOptions
from ..placement import input_device
from ..surgery import mean_betas
from ._console import console
from ._options import OFF, BaseOpt, described, sentence

# Enough text for a stable mean without a long wait on CPU: at most 8 blocks (of the run's length).
MAX_BLOCKS, BATCH = 8, 4


@torch.no_grad()
def _mean_betas(model, tokenizer) -> dict[str, float]:
    ids, mask = make_inputs(model, tokenizer)
    return mean_betas(model, lambda: model(input_ids=ids, attention_mask=mask))


@torch.no_grad()
def _mean_betas_on_text(model, tokenizer, data: list[str], options) -> tuple[dict[str, float], int]:
    from ..data import pack, token_stream
    from ..errors import DeltafyError
    from ..evaluate import model_positions

    if tokenizer is None:
        raise DeltafyError(
            "the checkpoint has no tokenizer to read --data with; leave --data out to measure on random token ids"
        )
    stream = token_stream(data, tokenizer, options.text_field)
    seq_len = min(options.seq_len, model_positions(model.config) or options.seq_len, stream.numel())
    blocks = pack(stream, seq_len)[:MAX_BLOCKS].to(input_device(model))

    def run():
        for start in range(0, len(blocks), BATCH):
            model(input_ids=blocks[start : start + BATCH])

    return mean_betas(model, run), blocks.numel()


def _number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN


def inspect_command(
    model_dir: Annotated[Path, typer.Argument(help="A deltafy checkpoint folder.")],
    data: Annotated[
        list[str] | None,
        typer.Option(
            "--data",
            "-d",
            **described("Text to measure the gates on (files, folders, globs, datasets).", "built-in prompts"),
        ),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            **described(
                "Draw the mean gate factor (α·β with a strength gate, else β) per layer and site into this "
                ".png (or .svg, .pdf).",
                "no picture",
            ),
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", **described("Replace the --plot file if it exists.", OFF))
    ] = False,
    text_field: Annotated[
        str | None,
        typer.Option(  # read as eval reads it: EvalOptions' field, the run's value where the folder has one
            "--text-field",
            **described(sentence(EvalOptions.model_fields["text_field"].description), "the run's, else text"),
        ),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", **described("Print one JSON object and nothing else.", OFF))
    ] = False,
    base: BaseOpt = None,
) -> None:
    """Show a deltafy checkpoint: recipe, sites, and the mean gate factor per layer on a few prompts or on --data.

    With --data, text is read in blocks of the checkpoint's run (its recipe's seq_len), 8 blocks at most. The
    model runs in the dtype eval reads it in (as stored; a trained folder: as its run held it), on the GPUs
    where there are any (spread over them where one cannot hold it).

    [bold]Examples[/]

      deltafy inspect ./smol-delta
      deltafy inspect ./smol-trained --data heldout.txt --plot beta.png
      deltafy inspect ./smol-trained --json
    """
    from ..data import expand
    from ..errors import DeltafyError
    from ..evaluate import run_settings
    from ..placement import default_device
    from ..training.plots import check_format, factor_label, plot_betas

    # Everything the user can get wrong is refused before the model loads.
    if plot is not None:
        check_format(plot)
        if plot.exists() and not overwrite:
            raise DeltafyError(f"{plot} already exists; choose another --plot file, or pass --overwrite")
        if plot.is_dir():
            raise DeltafyError(f"{plot} is a folder; --plot takes a file name such as beta.png")
    if data:
        expand(data)
    # in the dtype eval reads it in: as stored (a trained folder: as its run held it), not float32, which
    # doubles a bf16 model's memory
    options = run_settings(str(model_dir), {"text_field": text_field})
    model = load(model_dir, dtype=options.dtype, base=base, device=default_device())
    tokenizer = load_tokenizer(model_dir)
    spec = model.config.deltafy
    if data:
        betas, tokens = _mean_betas_on_text(model, tokenizer, list(data), options)
    else:
        betas, tokens = _mean_betas(model, tokenizer), None
    # without a tokenizer the prompts cannot be read: make_inputs draws random token ids instead
    measured_on = "built-in prompts" if tokenizer is not None else "random token ids"
    text = f"the {len(PROMPTS)} built-in prompts" if tokenizer is not None else measured_on  # (said, and drawn)
    if data:
        text = f"{tokens:,} tokens of {', '.join(data)}"
    sites = [s["name"] for s in spec["sites"]]
    label = factor_label(spec)  # α·β with a strength gate
    layers = len(model.get_submodule(spec["layers"]))
    per_layer = [
        {site: betas.get(f"{spec['layers']}.{i}.delta.{site}", float("nan")) for site in sites} for i in range(layers)
    ]
    name = model_dir.expanduser().resolve().name
    adapter = ADAPTER_DIR if getattr(model, "_hf_peft_config_loaded", False) else None  # (load loaded it)
    if plot is not None:
        plot_betas({site: [row[site] for row in per_layer] for site in sites}, plot, name, label, text)
    if json_out:
        record = {
            "model": str(model_dir),
            "base_model_type": spec["base_model_type"],
            "base_architecture": spec["base_architecture"],
            "layout": spec["layout"],
            "recipe": spec["recipe"]["name"],
            "direction": spec["direction"],
            "channels": spec.get("channels", 1),
            "adapter": adapter,
            "sites": sites,
            "measured_on": {"data": list(data), "tokens": tokens} if data else measured_on,
            "layers": [
                {"layer": i, "beta": {site: _number(v) for site, v in row.items()}} for i, row in enumerate(per_layer)
            ],
        }
        print(json.dumps(record))
        return
    # The path is the user's and the recipe name a YAML file's: text, not markup.
    console.print(
        f"[bold]{escape(str(model_dir))}[/]: "
        + escape(
            f"{spec['base_model_type']} ({spec['base_architecture']}), {spec['layout']}, "
            f"recipe {spec['recipe']['name']}, direction {spec['direction']}"
            + (f", expanded state of {spec['channels']} channels" if spec.get("channels", 1) > 1 else "")
            + (f", with the LoRA adapter it kept in {adapter}/" if adapter else "")
        )
    )
    why = ": the checkpoint has no tokenizer to read the built-in prompts with" if tokenizer is None else ""
    console.print(escape(f"mean {label} on {text}{why}"))
    table = Table("layer", *[escape(f"{label} {s}") for s in sites], box=None)
    for i, row in enumerate(per_layer):
        table.add_row(str(i), *[f"{row[s]:.3g}" for s in sites])
    console.print(table)
    if plot is not None:
        console.print(f"wrote {escape(str(plot))}")
