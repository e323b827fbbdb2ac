"""Ctrl-C and SIGTERM unwind the stack as KeyboardInterrupt, so every ``finally`` and every atomic
write on the way cleans up; the CLI then exits 130 or 143 with one line. Standard library only: the
CLI installs these before it imports torch, so an interrupt during start-up is handled too."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)
received: int | None = None  # the last signal that interrupted this process
REDELIVER_AFTER = 0.05  # seconds


def _interrupt(signum, frame):
    global received
    received = signum
    raise KeyboardInterrupt


def _swallowed(unraisable) -> None:
    """sys.unraisablehook: Python ignores an exception raised in a finalizer (a ``__del__``, a weakref
    callback), so an interrupt whose handler ran there would be lost and the command would go on to the
    end. The signal is sent again a moment later, when the finalizer has returned."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and received is not None:
        timer = threading.Timer(REDELIVER_AFTER, os.kill, (os.getpid(), received))
        timer.daemon = True
        timer.start()
    else:
        _previous_hook(unraisable)


_previous_hook = sys.unraisablehook


def _hook_finalizers() -> None:
    global _previous_hook
    if sys.unraisablehook is not _swallowed:
        _previous_hook, sys.unraisablehook = sys.unraisablehook, _swallowed


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
    _hook_finalizers()


@contextlib.contextmanager
def unwinding():
    """SIGINT and SIGTERM raise KeyboardInterrupt inside the block (a library call outside the CLI);
    the previous handlers are restored after it."""
    try:
        previous = {signum: signal.signal(signum, _interrupt) for signum in SIGNALS}
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    hook = sys.unraisablehook
    _hook_finalizers()
    try:
        yield
    finally:
        sys.unraisablehook = hook
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
