from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..conversion.job import Plan, convert_source, plan_source
from ..errors import DeltafyError
from ..options import ConvertOptions, convert_options
from ..recipe import DEFAULT_RECIPE
from ._console import activity, console, err_console, state
from ._options import OFF, OverwriteOpt, RecipeOpt, described, with_model_options


def _print_plan(plan: Plan) -> None:
    table = Table("site", "writes (module)", "reads stream at", "context", "scale", box=None)
    for site in plan.sites:
        cells = (site["name"], site["write"], site.get("stream") or "(layer input)", site["context"])
        table.add_row(*map(escape, cells), f"{site['scale']:g}")  # a Table reads its cells as markup
    console.print(
        f"[bold]{escape(plan.model_type)}[/] · {escape(plan.layout)} · {plan.layers} layers · "
        f"recipe [bold]{escape(plan.recipe.name)}[/] (direction {plan.recipe.direction})"
    )
    console.print(table)
    share = 100 * plan.params_added / max(plan.params_base, 1)
    console.print(f"parameters: {plan.params_base:,} base + {plan.params_added:,} DDL heads ({share:.3f}%)")
    if plan.extra_stream_values:
        d_v = plan.recipe.channels
        extra = plan.extra_stream_values * plan.element_size
        console.print(
            f"expanded state: the stream carries {d_v} channels, {plan.extra_stream_values:,} more values "
            f"({extra / 1024:.1f} KiB) per token than the original's, between sublayers and in each copy of it "
            f"that training keeps for the backward pass; attention and the KV cache read one view, unchanged"
        )


@with_model_options(
    ConvertOptions,
    panel="Conversion options",
    spellings={"verify": "--verify/--no-verify", "heads_only": "--heads-only", "streaming": "--streaming/--in-memory"},
    source=None,
)
def convert_command(
    source: Annotated[str, typer.Argument(help="Hub id (gpt2), local HF folder, .gguf file, or smollm2-135m.")],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            **described("Folder to write the converted checkpoint to.", "none; required unless --dry-run"),
        ),
    ] = None,
    recipe: RecipeOpt = DEFAULT_RECIPE,
    overwrite: OverwriteOpt = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", **described("Show the sites and parameters added; write nothing.", OFF))
    ] = False,
    **settings,
) -> None:
    """Convert a pretrained decoder into a Deep Delta Learning model that behaves like the original.

    [bold]Examples[/]

      deltafy convert smollm2-135m --out ./smol-delta
      deltafy convert ./my-local-llama --out ./llama-delta --recipe ddl-learned
      deltafy convert gpt2 --out ./gpt2-delta --dtype float32
      deltafy convert ./model.gguf --dry-run
      deltafy convert HuggingFaceTB/SmolLM2-135M --out ./smol-delta --heads-only
      deltafy convert ./Llama-3.1-70B --out ./llama70b-delta --streaming
    """
    options = convert_options(**settings)  # every bad value named, before the dry run too
    if dry_run:
        _print_plan(plan_source(source, recipe))
        console.print("[dim]dry run: nothing was written[/]")
        return
    if out is None:
        raise DeltafyError("missing --out DIR (or pass --dry-run to only show the plan)")
    # (an interrupt unwinds the save: the folder is renamed into place whole, or not at all)
    state.kept = f"nothing was written to {out}" + (", which is as it was" if out.exists() else "")
    with activity(err_console) as (status, progress):
        result = convert_source(
            source, out, recipe, overwrite=overwrite, status=status, progress=progress, **options.model_dump()
        )
    _print_plan(result.plan)
    if result.check is not None:
        c = result.check
        greedy = (
            f"{c.greedy_tokens}-token greedy generation identical"
            if c.greedy_identical is not None
            else "greedy generation not run (layer by layer it would read the whole model once per token)"
        )
        console.print(
            f"[green]self-check passed[/]: max |Δlogits| {c.max_abs_dlogits:.2e} (≤ {c.tolerance:.3g}, {c.dtype}), "
            f"β=0 bitwise identical, {greedy}"
        )
    else:
        console.print("[yellow]self-check skipped (--no-verify)[/]")
    if result.shards:
        how = ", ".join(f"{n} {what}" for what, n in result.shards.items() if n)
        linked = " (hard links share the source's files: no bytes copied)" if result.shards["hard-linked"] else ""
        console.print(f"pretrained shards: {how}{linked}; the heads are a shard of their own")
    out = str(result.out)
    console.print(
        f"wrote [bold]{escape(out)}[/]  load it with "
        f"AutoModelForCausalLM.from_pretrained({escape(repr(out))}, trust_remote_code=True)"
    )
