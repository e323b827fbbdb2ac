"""The one exception type whose message is shown to users as-is, the one way to quote another's, and how an
allocation the machine refused reads (the work's size: neither a bug nor a bad file).

The first two live in the modeling file, which a checkpoint carries and runs where deltafy is not installed:
the errors it raises there are the ones deltafy raises, and its messages need no marking."""

import re
import sys

from .modeling_deltafy import DeltafyError, first_line


class Interrupted(DeltafyError):
    """A command stopped by Ctrl-C or SIGTERM (``signum``) after keeping what it could (a training run's
    checkpoint, a bench's finished runs); the message says how to go on. The command line exits 130 or 143
    for it, as for any interrupt, so that a script or a scheduler sees an interrupt, not a failure."""

    def __init__(self, message: str, signum: int | None):
        super().__init__(message)
        self.signum = signum


_NO_MEMORY = re.compile(r"out of memory|can't allocate memory|not enough memory", re.IGNORECASE)


def out_of_memory(err: BaseException) -> str | None:
    """For an allocation the machine refused (torch's OutOfMemoryError on a GPU, the CPU allocator's
    RuntimeError, Python's MemoryError): "out of [GPU ]memory", with what was asked for where the message
    says; for anything else None. It is the work's size, not a bug or a bad file."""
    if not (isinstance(err, MemoryError) or isinstance(err, RuntimeError) and _NO_MEMORY.search(str(err))):
        return None
    torch = sys.modules.get("torch")  # (a torch error comes from a loaded torch)
    where = "GPU " if torch is not None and isinstance(err, torch.OutOfMemoryError) else ""
    asked = re.search(r"(?i)tried to allocate ([^.]+(?:\.\d+ \w+)?)", str(err))
    asked = asked and re.sub(r"^(\d+) bytes$", lambda m: f"{int(m[1]) / 2**30:,.1f} GiB", asked[1])
    return f"out of {where}memory{f' (it tried to allocate {asked})' if asked else ''}"


# What to do where no option of the command lowers the memory it needs
MORE_MEMORY = "free memory or use a machine with more"


def load_failure(message: str, err: BaseException) -> DeltafyError:
    """What a load that raised ``err`` reports: ``message`` with the error's first line, or with the memory
    that ran out (no flag lowers what holding the weights takes)."""
    if (memory := out_of_memory(err)) is not None:
        return DeltafyError(f"{message}: {memory}; {MORE_MEMORY}")
    return DeltafyError(f"{message}: {first_line(err)}")


__all__ = ["MORE_MEMORY", "DeltafyError", "Interrupted", "first_line", "load_failure", "out_of_memory"]
