"""``deltafy push``: upload a deltafy checkpoint to the Hugging Face Hub."""

from __future__ import annotations

from typing import Annotated

import typer


def push_command(
    folder: Annotated[str, typer.Argument(help="A deltafy checkpoint folder.")],
    repo: Annotated[str, typer.Option("--repo", help="Hub repository, OWNER/NAME.")],
) -> None:
    """Upload a deltafy checkpoint to the Hugging Face Hub (not implemented yet)."""
    from ..errors import DeltafyError

    raise DeltafyError("deltafy push is not implemented yet")
