"""Third-party output kept out of deltafy's: transformers' logs and progress bars around a library
call, and, for the command line, the start-up chatter of the libraries a run imports (DeepSpeed's
"Setting accelerator to CPU" on every ``deltafy train``, huggingface_hub's retries of an unreachable Hub,
transformers' warnings, torch.compile's notes).
``--debug`` shows all of it."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off for the block, then as they were (a bar the
    command line turned off stays off: the state is restored, not switched back on)."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


# Loggers that print to stdout or stderr on import, before a command says anything. A filter on the
# logger itself survives the library's own set-up (DeepSpeed resets the level and adds its handler).
_CHATTY = ("DeepSpeed",)


def quiet_third_parties() -> None:
    """For a command-line run (not a library call): no third-party progress bar (deltafy shows its
    own, and tqdm's, transformers' among them, would interleave with it), and the import-time
    warnings of ``_CHATTY`` loggers dropped. Standard library only: it runs before the commands'
    imports, as early in start-up as the interrupt handlers."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # read once, by tqdm's import: call this before it
    # huggingface_hub's warnings, e.g. a line for each retry of an unreachable Hub before deltafy's own
    # one-line error; read once, by its import (a user's own setting stays)
    os.environ.setdefault("HF_HUB_VERBOSITY", "error")
    # transformers' warnings, e.g. that a GGUF base loaded in bf16 casts its matmuls' inputs (a heads-only
    # folder's base, loaded by the checkpoint's own code): advice for code calling transformers, not for
    # someone running a command; read by its logging set-up on import (a user's own setting stays)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # torch.compile's notes on what it traces around (e.g. DDP's profiler ranges, on every rank) and on
    # recompiling: for someone tuning a model, not someone running a command; read by torch's import
    os.environ.setdefault("TORCH_LOGS", "-dynamo,-inductor")
    # a library's deprecation notice is for the code that calls it, not for someone running a command
    warnings.filterwarnings("ignore", category=FutureWarning)
    for name in _CHATTY:
        logger = logging.getLogger(name)
        if _below_error not in logger.filters:
            logger.addFilter(_below_error)
