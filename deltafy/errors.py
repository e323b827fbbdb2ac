"""The one exception type whose message is shown to users as-is, and the one way to quote another's.

DeltafyError is the modeling file's own class: the file a checkpoint carries raises it where deltafy
is not installed, and the package raises the same class, so its messages need no marking."""

from .modeling_deltafy import DeltafyError

__all__ = ["DeltafyError", "first_line"]


def first_line(err: BaseException, with_type: bool = False) -> str:
    """The first non-empty line of ``err``'s message (its type's name when it has none), for a
    one-line report; ``with_type`` puts the type's name in front (``ValueError: ...``)."""
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    return f"{type(err).__name__}: {lines[0]}" if with_type else lines[0]
