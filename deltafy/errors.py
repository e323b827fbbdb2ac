"""The one exception type whose message is shown to users as-is, and the one way to quote another's.

Both live in the modeling file, which a checkpoint carries and runs where deltafy is not installed:
the errors it raises there are the ones deltafy raises, and its messages need no marking."""

from .modeling_deltafy import DeltafyError, first_line


class Interrupted(DeltafyError):
    """A command stopped by Ctrl-C or SIGTERM (``signum``) after keeping what it could (a training run's
    checkpoint, a bench's finished runs); the message says how to go on. The command line exits 130 or 143
    for it, as for any interrupt, so that a script or a scheduler sees an interrupt, not a failure."""

    def __init__(self, message: str, signum: int | None):
        super().__init__(message)
        self.signum = signum


__all__ = ["DeltafyError", "Interrupted", "first_line"]
