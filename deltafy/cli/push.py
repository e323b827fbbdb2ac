"""``deltafy push``: upload a deltafy checkpoint to the Hugging Face Hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.markup import escape
from rich.table import Table

from ..hub.push import PushResult, push
from ..options import PushOptions, push_options
from ._console import console, state
from ._options import OFF, described, with_model_options


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError


def _left_out(paths: list[str]) -> str:
    """``training/ (41 files), .deltafy-lock``: a run's checkpoints are many files, one folder."""
    groups: dict[str, int] = {}
    for path in paths:
        top, sep, _ = path.partition("/")
        groups[top + sep] = groups.get(top + sep, 0) + 1
    return ", ".join(name if not name.endswith("/") else f"{name} ({n} files)" for name, n in groups.items())


def _on(revision: str | None) -> str:
    """`` (branch ddl-heads)``, `` (pull request refs/pr/3)``, or nothing for main."""
    if not revision:
        return ""
    kind = "pull request" if revision.startswith("refs/pr/") else "branch"  # push() let only refs/pr/<N> through
    return f" ({kind} {escape(revision)})"


def _print_plan(result: PushResult) -> None:
    where = escape(result.repo) + _on(result.revision)
    kind = "heads-only delta" if result.heads_only else "full checkpoint"
    console.print(f"[bold]{where}[/] · {'private' if result.private else 'public'} · {kind}")
    table = Table("file", "size", box=None)
    for path, size in result.files:
        table.add_row(escape(path), _size(size))
    console.print(table)
    console.print(f"{len(result.files)} files, {_size(result.total_bytes)}")
    if result.ignored:
        console.print(f"[dim]left out: {escape(_left_out(result.ignored))}[/]")
    console.print(f"commit message: {escape(result.commit_message)}")
    console.print("card front matter:")
    console.print(escape(yaml.safe_dump(result.front_matter, sort_keys=False, allow_unicode=True).rstrip()))


@with_model_options(
    PushOptions,
    panel="Push options",
    spellings={"private": "--private", "message": ("--message", "-m"), "include_training": "--include-training"},
    source=None,
)
def push_command(
    folder: Annotated[Path, typer.Argument(help="A deltafy checkpoint folder (from convert or train).")],
    repo: Annotated[str, typer.Option("--repo", help="Hub model repository, OWNER/NAME; created if missing.")],
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            **described("Run every check of a push, show the files and the card front matter; contact nothing.", OFF),
        ),
    ] = False,
    **settings,
) -> None:
    """Upload a deltafy checkpoint to the Hugging Face Hub, card and code included.

    Training state (training/, optimizer files) stays behind unless --include-training. The token is never shown.

    [bold]Examples[/]

      deltafy push ./smol-trained --repo me/smol-ddl --private --dry-run
      deltafy push ./smol-trained --repo me/smol-ddl --private
      deltafy push ./smol-delta --repo me/smol-ddl --revision heads-only --message "heads only"
    """
    options = push_options(**settings).model_dump()  # every bad value named before anything is read
    state.kept = (
        "nothing was uploaded"
        if dry_run
        else f"the push may not have finished: a commit to {repo} is all or nothing, so run the same command again"
    )
    if dry_run:
        _print_plan(push(folder, repo, dry_run=True, **options))
        console.print("[dim]dry run: nothing was uploaded[/]")
        return

    # No spinner: on a terminal huggingface_hub draws its own upload progress on stderr, which stays
    # for that and for the one line of an error.
    def starting(plan: PushResult) -> None:
        console.print(f"uploading {len(plan.files)} files ({_size(plan.total_bytes)}) to {escape(repo)} …")

    result = push(folder, repo, before_upload=starting, **options)
    console.print(
        f"pushed {len(result.files)} files ({_size(result.total_bytes)}) to [bold]{escape(result.repo_url or repo)}[/]"
        + _on(result.revision)
        + (" · private" if result.private else "")
    )
    if result.commit_url:
        console.print(f"commit: {escape(result.commit_url)}")
