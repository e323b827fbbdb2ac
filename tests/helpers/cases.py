"""Tables of command lines, one row each: a real ``python -m deltafy`` subprocess, its exit code, the
first line it prints, and the files it must leave exactly as they were (hashed before and after).

A surface's test file lists its rows as :class:`Case` and runs them with :func:`run_table` in a module
fixture (a few subprocesses at a time); each parametrized test then checks one row with
:func:`assert_case`. A row that needs files of its own builds them in ``prepare`` inside its own
folder (``{here}``), so that no row can spoil another's inputs.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from helpers.cli import stderr_lines
from helpers.training import subprocess_env


@dataclass
class Case:
    """One command line. ``argv``, ``untouched`` and ``absent`` are formatted with the table's paths
    plus ``{here}``, the row's own folder, and whatever ``prepare(here, paths)`` returns.

    ``first`` must appear in the first line of output: stderr's one ``error: …`` line when ``code``
    is not 0, stdout's first line when it is. ``untouched`` paths (files or folders) hash the same
    before and after the command; ``absent`` paths do not exist afterwards. ``interrupt`` sends a
    signal once the command has run ``after`` seconds or once a path matching the glob ``after``
    exists (relative to ``{here}``). ``notices`` are stderr lines allowed before an error. ``cwd``: the
    folder the command runs in (the table's root by default)."""

    name: str
    argv: list[str]
    code: int
    first: str
    needles: tuple[str, ...] = ()
    untouched: tuple[str, ...] = ()
    absent: tuple[str, ...] = ()
    prepare: Callable[[Path, dict], dict | None] | None = None
    env: dict = field(default_factory=dict)
    interrupt: tuple[int, float | str] | None = None
    notices: tuple[str, ...] = ()
    check: Callable[[dict], None] | None = None
    cwd: str | None = None


def digest(path: Path) -> str:
    """A hash of everything at ``path``: every file's name, kind, mode and bytes, links as links."""
    h = hashlib.sha256()
    path = Path(path)
    if not os.path.lexists(path):
        return "missing"
    entries = [path] if not path.is_dir() or path.is_symlink() else [path, *sorted(path.rglob("*"))]
    for entry in entries:
        info = entry.lstat()
        h.update(f"{entry.relative_to(path) if entry != path else '.'}\0{info.st_mode:o}\0".encode())
        if entry.is_symlink():
            h.update(os.readlink(entry).encode())
        elif entry.is_file():
            with entry.open("rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
    return h.hexdigest()


@dataclass
class Result:
    proc: subprocess.CompletedProcess
    paths: dict
    before: dict[str, str]
    after: dict[str, str]
    running_at_signal: bool | None = None


def _fill(text: str, paths: dict) -> str:
    return text.format(**paths)


def _run(
    case: Case, paths: dict, cwd: Path, env: dict, timeout: int
) -> tuple[subprocess.CompletedProcess, bool | None]:
    argv = [sys.executable, "-m", "deltafy", *[_fill(a, paths) for a in case.argv]]
    cwd = Path(_fill(case.cwd, paths)) if case.cwd else cwd
    environment = subprocess_env({**env, **{k: _fill(v, paths) for k, v in case.env.items()}})
    if os.environ.get("DELTAFY_CASES_PYTHONPATH"):  # run a table against another copy of deltafy (an older one)
        environment["PYTHONPATH"] = os.environ["DELTAFY_CASES_PYTHONPATH"]
    if case.interrupt is None:
        proc = subprocess.run(
            argv, cwd=cwd, env=environment, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout
        )
        return proc, None
    signum, after = case.interrupt
    child = subprocess.Popen(
        argv,
        cwd=cwd,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    here, started = Path(paths["here"]), time.monotonic()
    while child.poll() is None and time.monotonic() - started < timeout:
        if isinstance(after, str) and list(here.glob(_fill(after, paths))):
            break
        if not isinstance(after, str) and time.monotonic() - started >= after:
            break
        time.sleep(0.01)
    running = child.poll() is None
    if running:
        child.send_signal(signum)
    stdout, stderr = child.communicate(timeout=timeout)
    return subprocess.CompletedProcess(argv, child.returncode, stdout, stderr), running


def run_table(
    cases: list[Case], paths: dict, root: Path, env: dict | None = None, workers: int = 3, timeout: int = 300
) -> dict[str, Result]:
    """Run every row (``prepare`` first, one row at a time; then the commands, ``workers`` at once)."""
    rows = {}
    for case in cases:
        here = root / case.name
        here.mkdir(parents=True, exist_ok=True)
        own = {**paths, "here": str(here)}
        own |= (case.prepare(here, own) if case.prepare else None) or {}
        rows[case.name] = own
    before = {c.name: {p: digest(Path(_fill(p, rows[c.name]))) for p in c.untouched} for c in cases}

    def one(case: Case) -> Result:
        proc, running = _run(case, rows[case.name], root, env or {}, timeout)
        after = {p: digest(Path(_fill(p, rows[case.name]))) for p in case.untouched}
        return Result(proc, rows[case.name], before[case.name], after, running)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {case.name: pool.submit(one, case) for case in cases}
        return {name: future.result() for name, future in futures.items()}


def assert_case(case: Case, result: Result) -> None:
    proc, paths = result.proc, result.paths
    shown = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for output in (proc.stdout, proc.stderr):
        assert "Traceback" not in output, shown
        assert "internal error" not in output, shown
    if case.interrupt is not None:
        assert result.running_at_signal, f"the command ended before the signal was sent\n{shown}"
    assert proc.returncode == case.code, shown
    lines = stderr_lines(proc)
    notices = [_fill(n, paths) for n in case.notices]
    lines = [line for line in lines if not any(n in line for n in notices)]
    needles = [_fill(n, paths) for n in (case.first, *case.needles)]
    if case.code == 0:
        first = (proc.stdout.strip().splitlines() or [""])[0]
    else:
        assert len(lines) == 1, f"expected one line on stderr\n{shown}"
        first = lines[0]
        assert first.startswith("error: "), shown
        assert not proc.stderr.startswith("\n") and "\n\n" not in proc.stderr, f"an empty line on stderr\n{shown}"
    for needle in needles:
        assert needle in first, f"{needle!r} not in the first line {first!r}\n{shown}"
    for path in case.untouched:
        assert result.after[path] == result.before[path], f"{_fill(path, paths)} changed\n{shown}"
    for path in case.absent:
        assert not os.path.lexists(_fill(path, paths)), f"{_fill(path, paths)} exists\n{shown}"
    here = Path(paths["here"])
    leftovers = [p for p in here.rglob(".*") if ".deltafy-" in p.name and "-lock" not in p.name]
    assert not leftovers, f"left behind: {leftovers}\n{shown}"
    if case.check is not None:
        case.check(paths)


__all__ = ["Case", "Result", "assert_case", "digest", "run_table", "signal"]


MOUNTS: list[Path] = []  # what rows' prepare mounted (the test machines run as root): unmount_all() undoes them


def mount_tmpfs(where: Path, options: str) -> None:
    """A small or read-only filesystem of its own at ``where`` (tmpfs)."""
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    assert proc.returncode == 0, f"could not mount a tmpfs at {where}: {proc.stderr}"
    MOUNTS.append(where)


def unmount_all() -> None:
    for where in reversed(MOUNTS):
        subprocess.run(["umount", "-l", str(where)], check=False)
    MOUNTS.clear()
