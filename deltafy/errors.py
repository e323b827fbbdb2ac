"""The one exception type whose message is shown to users as-is, and the one way to quote another's.

Both live in the modeling file, which a checkpoint carries and runs where deltafy is not installed:
the errors it raises there are the ones deltafy raises, and its messages need no marking."""

from .modeling_deltafy import DeltafyError, first_line

__all__ = ["DeltafyError", "first_line"]
