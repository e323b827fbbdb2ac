from __future__ import annotations

from typing import Annotated

import typer

from ._console import console
from ._options import DType, DTypeOpt


def eval_command(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(help="deltafy checkpoint, stock HF folder, .gguf file, alias or Hub id.")],
    data: Annotated[list[str], typer.Option("--data", "-d", help="Held-out text (files, folders, globs, datasets).")],
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per block.")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Blocks per forward.")] = 8,
    max_blocks: Annotated[int | None, typer.Option("--max-blocks", help="Evaluate at most this many blocks.")] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL/dataset text field.")] = "text",
    dtype: DTypeOpt = DType.auto,
    device: Annotated[str | None, typer.Option(help="e.g. cuda")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object and nothing else.")] = False,
) -> None:
    """Held-out loss and perplexity of a model on some text.

    [bold]Examples[/]

      deltafy eval ./smol-trained --data heldout.txt
      deltafy eval smollm2-135m --data heldout.txt --json
    """
    from ..evaluate import evaluate_text, load_any

    data = list(data) + list(ctx.args)  # `--data dir/*.txt` expands to many paths

    loaded, tokenizer = load_any(model, dtype.value, device)
    if tokenizer is None:
        from ..errors import DeltafyError

        raise DeltafyError(f"{model} has no tokenizer; evaluation needs one to read text")
    result = evaluate_text(loaded, tokenizer, data, seq_len, batch_size, max_blocks, text_field)
    if json_out:
        print(result.to_json())
        return
    console.print(
        f"loss {result.loss:.4f} · perplexity {result.perplexity:.2f} · {result.tokens:,} tokens · "
        f"{result.tokens_per_second:.0f} tok/s"
    )
