from __future__ import annotations

from typing import Annotated

import typer

from ..options import EvalOptions
from ._console import console
from ._options import OFF, BaseOpt, described, with_model_options


@with_model_options(
    EvalOptions, source="the run's for a trained folder", sourced={"seq_len", "batch_size", "max_blocks", "text_field"}
)
def eval_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="deltafy checkpoint, stock HF folder, .gguf file, alias or Hub id.")],
    data: Annotated[list[str], typer.Option("--data", "-d", help="Held-out text (files, folders, globs, datasets).")],
    base: BaseOpt = None,
    json_out: Annotated[
        bool, typer.Option("--json", **described("Print one JSON object and nothing else.", OFF))
    ] = False,
    **flags,
) -> None:
    """Held-out loss and perplexity of a model on some text.

    A trained deltafy folder is read as its run read held-out text (block length, batch, text field,
    the first --max-eval-blocks blocks), so it measures the run's "after" again, unless a flag says
    otherwise.

    [bold]Examples[/]

      deltafy eval ./smol-trained --data heldout.txt
      deltafy eval smollm2-135m --data heldout.txt --seq-len 512 --json
    """
    from ..data import expand
    from ..errors import DeltafyError
    from ..evaluate import check_sizes, evaluate_text, load_any, run_settings
    from ..placement import default_device

    options = run_settings(model, flags)
    check_sizes(options.seq_len, options.batch_size, options.max_blocks)  # before the model loads
    data = list(data) + list(ctx.args)  # `--data dir/*.txt` expands to many paths
    expand(data)  # the same: a missing file is reported before the model is read

    loaded, tokenizer = load_any(model, options.dtype, options.device or default_device(), base=base)
    if tokenizer is None:
        raise DeltafyError(f"{model} has no tokenizer; evaluation needs one to read text")
    result = evaluate_text(
        loaded, tokenizer, data, options.seq_len, options.batch_size, options.max_blocks, options.text_field
    )
    if json_out:
        print(result.to_json())
        return
    read, every = f"blocks of {result.seq_len}", result.available_blocks
    if result.blocks < every:  # say so: the text holds more than was read
        read = f"the first {result.blocks} of {every} {read} (--max-blocks {every} reads all)"
    console.print(
        f"loss {result.loss:.4f} · perplexity {result.perplexity:.2f} · {result.tokens:,} tokens · "
        f"{result.tokens_per_second:.0f} tok/s · {read}"
    )
