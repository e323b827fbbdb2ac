"""``deltafy cache``: see and drop what deltafy keeps in its cache folder."""

from __future__ import annotations

import json
import os
import time
from typing import Annotated

import typer

from ._console import console
from ._options import OFF, described

cache_app = typer.Typer(
    help="See and drop deltafy's caches (token streams, dequantized GGUF weights).", no_args_is_help=True
)


def _say(line: str) -> None:
    # Paths and dataset ids are the user's text: never rich markup, never wrapped mid-path.
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def _where() -> str:
    from ..sources.load import cache_dir

    how = "set by DELTAFY_CACHE" if os.environ.get("DELTAFY_CACHE") else "set DELTAFY_CACHE to move it"
    missing = "" if cache_dir().exists() else "; it does not exist yet"
    return f"cache folder: {cache_dir()} ({how}{missing})"


@cache_app.command("info")
def info_command(
    json_out: Annotated[
        bool, typer.Option("--json", **described("Print one JSON object and nothing else.", OFF))
    ] = False,
) -> None:
    """Show the cache folder, its kinds of cache (entries, size) and what each token stream came from.

    Token streams are keyed by the bytes of their text and by the tokenizer:
    an edited file or a regenerated datasets folder gets a new entry, and the
    old one stays until `deltafy cache clear`.

    [bold]Examples[/]

      deltafy cache info
      DELTAFY_CACHE=/scratch/deltafy deltafy cache info --json
    """
    from ..sources.cache import cache_info, human_size, token_entries
    from ..sources.load import cache_dir

    kinds, entries = cache_info(), token_entries()
    if json_out:
        summary = {k.kind: {"folder": str(k.folder), "entries": k.entries, "bytes": k.bytes} for k in kinds}
        print(json.dumps({"folder": str(cache_dir()), "kinds": summary, "tokens": entries}))
        return
    _say(_where())
    for k in kinds:
        count = f"{k.entries} {'entry' if k.entries == 1 else 'entries'}"
        _say(f"  {k.what:<31} {count:>12} {human_size(k.bytes):>10}   {k.folder.name}/")
    if entries:
        _say("token streams, newest first:")
    for e in entries:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e["mtime"]))
        field = f" field {e['text_field']}" if "text_field" in e else ""
        if "source" not in e:  # written before entries had sidecars
            _say(f"  {e['key']} (made by an older deltafy; no record of its source) · {when}")
            continue
        text = f"{e['kind']}{field}, {human_size(e['bytes'])}"
        _say(f"  {e['source']} · {text} → {e['tokens']:,} tokens · {when} · tokenizer {e['tokenizer']}")
    if any(k.bytes for k in kinds):
        _say("`deltafy cache clear` drops the token streams; `deltafy cache clear --all` every kind")


@cache_app.command("clear")
def clear_command(
    everything: Annotated[
        bool,
        typer.Option("--all", **described("Also drop the dequantized GGUF weights and deltafy 0.1's kernels.", OFF)),
    ] = False,
) -> None:
    """Remove the cached token streams (with --all, every kind of cache) and say how much space came back.

    No confirmation is asked: a cache is rebuilt when next needed, at the cost
    of one tokenization (or GGUF dequantization). Only deltafy's subfolders
    go, never the cache folder itself or anything else in it.

    [bold]Examples[/]

      deltafy cache clear
      deltafy cache clear --all
    """
    from ..sources.cache import clear_cache, human_size
    from ..sources.load import cache_dir

    if not cache_dir().exists():
        _say(f"nothing to clear: {cache_dir()} does not exist")
        return
    removed = [k for k in clear_cache(everything) if k.bytes or k.entries]
    if not removed:
        _say(f"nothing to clear in {cache_dir()}" + ("" if everything else " (token streams; --all for every kind)"))
        return
    for k in removed:
        count = f"{k.entries} {'entry' if k.entries == 1 else 'entries'}"
        _say(f"removed {k.what}: {count}, {human_size(k.bytes)} ({k.folder})")
    freed, linked = sum(k.bytes - k.linked for k in removed), sum(k.linked for k in removed)
    kept = f" ({human_size(linked)} more stays on disk: hard-linked into checkpoints you converted)" if linked else ""
    _say(f"freed {human_size(freed)} in {cache_dir()}{kept}")
