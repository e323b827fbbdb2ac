from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.markup import escape
from rich.table import Table

from ..checkpoint import load, load_tokenizer
from ..modeling_deltafy import mean_betas
from ..verify import make_inputs
from ._console import console


@torch.no_grad()
def _mean_betas(model, tokenizer) -> dict[str, float]:
    ids, mask = make_inputs(model, tokenizer)
    return mean_betas(model, lambda: model(input_ids=ids, attention_mask=mask))


def inspect_command(
    model_dir: Annotated[Path, typer.Argument(help="A deltafy checkpoint folder.")],
) -> None:
    """Show a deltafy checkpoint: recipe, sites, and the mean gate β per layer on a few prompts.

    [bold]Example[/]

      deltafy inspect ./smol-delta
    """
    model = load(model_dir, dtype=torch.float32)
    tokenizer = load_tokenizer(model_dir)
    spec = model.config.deltafy
    # The path is the user's and the recipe name a YAML file's: text, not markup.
    console.print(
        f"[bold]{escape(str(model_dir))}[/]: "
        + escape(
            f"{spec['base_model_type']} ({spec['base_architecture']}), {spec['layout']}, "
            f"recipe {spec['recipe']['name']}, direction {spec['direction']}"
        )
    )
    betas = _mean_betas(model, tokenizer)
    table = Table("layer", *[escape(f"β {s['name']}") for s in spec["sites"]], box=None)
    layers = model.get_submodule(spec["layers"])
    for i in range(len(layers)):
        prefix = f"{spec['layers']}.{i}.delta."
        table.add_row(str(i), *[f"{betas.get(prefix + s['name'], float('nan')):.3g}" for s in spec["sites"]])
    console.print(table)
