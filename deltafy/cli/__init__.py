"""The ``deltafy`` command. This module stays light: ``main`` takes over Ctrl-C and SIGTERM before
torch and transformers are imported (seconds), so an interrupt at any point ends the same way."""

from __future__ import annotations

import os
import sys

from .. import interrupts


def main(argv: list[str] | None = None) -> None:
    """Console entry point: errors become one line on stderr and a non-zero exit code; an interrupt
    (Ctrl-C, SIGTERM) unwinds what was being written and exits 130 / 143 with a line saying so."""
    interrupts.install()
    if argv is None:
        _replace_unencodable()
    args = sys.argv[1:] if argv is None else argv
    try:
        from ._console import state

        state.debug = "--debug" in args
        state.argv = list(args)
        if not state.debug:  # before the commands' imports: tqdm reads TQDM_DISABLE when first imported
            from ..quiet import quiet_third_parties

            quiet_third_parties()
        # torch's C++ start-up calls back into Python (pybind11): an interrupt raised there aborts the process
        # (SIGABRT) or is lost (the command runs to its end). The signal waits for the imports instead.
        with interrupts.deferred():
            from ._app import run
        run(args)
    except KeyboardInterrupt:
        _interrupted(argv)
    except Exception:
        # A signal during start-up can surface as another error: numpy's C import turns it into an
        # ImportError. (run() makes the same call for what a command raises.)
        if interrupts.received is None:
            raise
        _interrupted(argv)


def _replace_unencodable() -> None:
    """Where stdout or stderr cannot encode every character (a latin-1 or ASCII locale,
    PYTHONIOENCODING=ascii), write "?" for what it cannot: the output says "α·β" and "Δlogits", and a
    strict stream would end the command with an encoding error at the first of them."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="replace")


def _interrupted(argv: list[str] | None) -> None:
    from rich.markup import escape

    from ._console import err_console, state

    if state.debug:
        raise
    kept = state.kept or "nothing was written"  # what the command said it leaves as it was
    line = f"interrupted by {interrupts.name()}; {kept}"
    err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
    if argv is not None:  # called from Python: leave the process to its caller
        sys.exit(interrupts.exit_code())
    # The process's own entry point: everything was unwound and cleaned up on the way here. Exit
    # now, with the code: CPython kills itself with SIGINT at exit (-2, whatever the signal) once a
    # KeyboardInterrupt went through code it ran with PyRun_* (torch's import does), caught or not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(interrupts.exit_code())


def __getattr__(name: str):
    if name == "app":  # the typer app, for tests and embedding (imports every command)
        from ._app import app

        return app
    raise AttributeError(name)


__all__ = ["main"]
