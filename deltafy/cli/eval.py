from __future__ import annotations

from typing import Annotated

import typer

from ._console import console
from ._options import OFF, BaseOpt, DType, DTypeOpt


def eval_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="deltafy checkpoint, stock HF folder, .gguf file, alias or Hub id.")],
    data: Annotated[list[str], typer.Option("--data", "-d", help="Held-out text (files, folders, globs, datasets).")],
    seq_len: Annotated[
        int, typer.Option("--seq-len", help="Tokens per block, at least 2 and at most the model's positions.")
    ] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Blocks per forward, at least 1.")] = 8,
    max_blocks: Annotated[
        int | None, typer.Option("--max-blocks", help="Evaluate at most this many blocks.", show_default="all")
    ] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL/dataset text field.")] = "text",
    dtype: DTypeOpt = DType.auto,
    device: Annotated[str | None, typer.Option(help="e.g. cuda", show_default="cpu")] = None,
    base: BaseOpt = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print one JSON object and nothing else.", show_default=OFF)
    ] = False,
) -> None:
    """Held-out loss and perplexity of a model on some text.

    [bold]Examples[/]

      deltafy eval ./smol-trained --data heldout.txt
      deltafy eval smollm2-135m --data heldout.txt --json
    """
    from ..data import expand
    from ..errors import DeltafyError
    from ..evaluate import check_sizes, evaluate_text, load_any

    check_sizes(seq_len, batch_size, max_blocks)  # before the model loads: a typo costs nothing
    data = list(data) + list(ctx.args)  # `--data dir/*.txt` expands to many paths
    expand(data)  # the same: a missing file is reported before the model is read

    loaded, tokenizer = load_any(model, dtype.value, device, base=base)
    if tokenizer is None:
        raise DeltafyError(f"{model} has no tokenizer; evaluation needs one to read text")
    result = evaluate_text(loaded, tokenizer, data, seq_len, batch_size, max_blocks, text_field)
    if json_out:
        print(result.to_json())
        return
    console.print(
        f"loss {result.loss:.4f} · perplexity {result.perplexity:.2f} · {result.tokens:,} tokens · "
        f"{result.tokens_per_second:.0f} tok/s"
    )
