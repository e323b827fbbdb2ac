"""Running the deltafy command line in a child process, and what its errors must look like."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.training import run_cli, subprocess_env


def cli_env(extra: dict | None = None) -> dict:
    return subprocess_env({"COLUMNS": "80", **(extra or {})})  # narrow: wrapped errors would show


def cli(*args, cwd: Path, env: dict | None = None, preexec_fn=None, timeout: int = 600):
    return run_cli(*args, cwd=cwd, env={"COLUMNS": "80", **(env or {})}, timeout=timeout, preexec_fn=preexec_fn)


_PROGRESS_BAR = re.compile(r"\d+%\|.*\|")


def stderr_lines(proc) -> list[str]:
    """stderr's lines, less tqdm progress bars (test_no_progress_bars_on_stderr covers those)."""
    return [line for line in proc.stderr.strip().splitlines() if line.strip() and not _PROGRESS_BAR.search(line)]


def assert_one_line_error(proc, *needles: str) -> str:
    """Non-zero exit, no traceback, and exactly one line on stderr that explains the problem."""
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = stderr_lines(proc)
    assert len(lines) == 1, f"expected one line on stderr, got:\n{proc.stderr}"
    assert not proc.stderr.startswith("\n") and "\n\n" not in proc.stderr, f"an empty line on stderr:\n{proc.stderr!r}"
    line = lines[0]
    assert line.startswith("error: "), line
    # An explained error, not the catch-all that reports a bug in deltafy.
    assert "internal error" not in proc.stderr, line
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line
