"""Ctrl-C and SIGTERM unwind the stack as KeyboardInterrupt, so every ``finally`` and every atomic
write on the way cleans up; the CLI then exits 130 or 143 with one line. Standard library only: the
CLI installs these before it imports torch, so an interrupt during start-up is handled too."""

from __future__ import annotations

import contextlib
import signal

SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: int | None = None  # the last signal that interrupted this process


def _interrupt(signum, frame):
    global received
    received = signum
    raise KeyboardInterrupt


def note(signum: int) -> None:
    """Record ``signum`` as the interrupt (for handlers of their own, such as training's)."""
    global received
    received = signum


def install() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt from now on (the CLI's whole run)."""
    global received
    received = None  # (main() may run more than once in a process: tests, embedding)
    for signum in SIGNALS:
        signal.signal(signum, _interrupt)


@contextlib.contextmanager
def unwinding():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (a library call outside the CLI);
    the previous handlers are restored after it."""
    try:
        previous = {signum: signal.signal(signum, _interrupt) for signum in SIGNALS}
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


@contextlib.contextmanager
def deferred():
    """Hold SIGINT and SIGTERM back during steps that must happen together (the renames that swap a
    folder into place): a signal that arrives meanwhile is delivered when the block ends."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (AttributeError, ValueError):  # Windows, or not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def exit_code(signum: int | None = None) -> int:
    """The shell's code for death by ``signum`` (else the signal received): 130 for SIGINT, 143 for SIGTERM."""
    return 128 + (signum or received or signal.SIGINT)


def name() -> str:
    signum = received or signal.SIGINT
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
