"""The README's five-minute path, run as written: its commands and its Python, taken from the README itself,
in a fresh folder, and what each prints against what the README shows beneath it. Numbers that measure this
machine (tokens/s, seconds, file sizes) are not compared; every other number is, to the digits shown."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.docs import code_blocks, join_continued
from helpers.training import subprocess_env

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_NUMBER = re.compile(r"([-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]\d+)?)")
_MEASURE = re.compile(r"\s?(tok/s|s/step|s\b|KB|MB|B\b)")  # what follows a number that says how fast or how big


def five_minute_path() -> list[tuple[str, str, str | None]]:
    """(kind, code, the output shown under it) for each command block of the README's five-minute section:
    kind "deltafy" (a command line, continued lines joined) or "python"; the install block is the set-up."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Five minutes on a CPU") :]
    section = section[: section.index("\n## ", 1)]
    blocks = code_blocks(section)
    steps = []
    for (lang, code), (next_lang, next_code) in zip(blocks, [*blocks[1:], ("-", "")], strict=True):
        shown = next_code if next_lang == "" else None
        if lang == "bash" and code.lstrip().startswith("deltafy "):
            steps.append(("deltafy", join_continued(code).strip(), shown))
        elif lang == "python":
            steps.append(("python", code, shown))
    return steps


def _close(shown: str, got: str) -> bool:
    """``got`` is ``shown`` to the digits ``shown`` has (two units of its last digit: another CPU's rounding)."""
    a, b = float(shown.replace(",", "")), float(got.replace(",", ""))
    mantissa, _, exponent = shown.lower().partition("e")
    digits = len(mantissa.partition(".")[2])
    return abs(a - b) <= 2 * 10.0 ** (int(exponent or 0) - digits) if digits else a == b


def line_differs(shown: str, got: str) -> str | None:
    """Why the printed line ``got`` is not the README's ``shown`` (spacing aside), or None."""
    shown_parts, got_parts = _NUMBER.split(" ".join(shown.split())), _NUMBER.split(" ".join(got.split()))
    if len(shown_parts) != len(got_parts):
        return "a different line"
    for i, (want, have) in enumerate(zip(shown_parts, got_parts, strict=True)):
        if i % 2 == 0 and want != have:
            return f"{want!r} where it prints {have!r}"
        if i % 2 == 1 and not _MEASURE.match(shown_parts[i + 1]) and not _close(want, have):
            return f"{want} where it prints {have}"
    return None


def _skeleton(line: str) -> str:
    return _NUMBER.sub("0", " ".join(line.split()))


def output_differs(shown: str, printed: str) -> str | None:
    """Why ``printed`` is not the README's ``shown`` output, whose "…" lines stand for any lines, or None."""
    want = [line for line in shown.splitlines() if line.strip()]
    got = [line for line in printed.splitlines() if line.strip()]
    j = 0
    for i, line in enumerate(want):
        if line.strip() == "…":  # more lines like the one before, up to the next line shown (or the end)
            while j < len(got) and (i + 1 == len(want) or line_differs(want[i + 1], got[j])):
                if _skeleton(got[j]) != _skeleton(want[i - 1]):
                    return f"it prints {got[j].strip()!r} where the README shows … (more of {want[i - 1].strip()!r})"
                j += 1
            continue
        if j >= len(got):
            return f"the README shows {line.strip()!r}, which it does not print"
        if why := line_differs(line, got[j]):
            return f"the README shows {line.strip()!r}, it prints {got[j].strip()!r}: {why}"
        j += 1
    if j < len(got):
        return f"it prints {got[j].strip()!r}, which the README does not show"
    return None


def test_the_matcher_compares_every_number_but_speeds_and_sizes():
    assert line_differs("loss 3.9588 · 255 tok/s · 2.5 KB", "loss  3.9589 · 640 tok/s · 2.6 KB") is None
    assert line_differs("loss 3.9588", "loss 3.9591") == "3.9588 where it prints 3.9591"
    assert line_differs("6,223 tokens", "6,224 tokens") is not None
    assert line_differs("max 0.00e+00", "max 1.00e-07") is None
    assert line_differs("wrote smol-delta", "wrote smol-trained") is not None
    assert output_differs("step 1\n…\nstep 16\ndone", "step 1\nstep 2\nstep 16\ndone") is None
    assert output_differs("step 1\n…\nstep 16\ndone", "step 1\nstep 16") is not None
    assert output_differs("step 1\n…\nstep 16 3.64", "step 1\nstep 16 3.71") is not None
    assert output_differs("a", "a\nb") is not None
    assert output_differs("step 1\n…\nstep 16\ndone", "step 1\nwarning: x\nstep 16\ndone") is not None


def test_the_readme_five_minute_path_runs_as_written(tmp_path):
    steps = five_minute_path()
    assert [code.split()[1] for kind, code, _ in steps if kind == "deltafy"] == [
        "convert", "train", "eval", "inspect", "push"
    ]  # fmt: skip
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # the repository's examples/, as from a clone
    # the GGUF file is dequantized into a cache of the test's own (one filesystem with the output: hard links)
    env = {"DELTAFY_CACHE": str(tmp_path / "cache"), "COLUMNS": "200"}
    for kind, code, shown in steps:
        # what a terminal shows: stdout and stderr (the step lines, a warning that leaked) as they came
        if kind == "python":  # (transformers' own loading bar is its business: the code must run, and load ours)
            code += '\nassert type(model).__name__ == "DeltafyForCausalLM", type(model)\n'
        command = [sys.executable, "-m", *shlex.split(code)] if kind == "deltafy" else [sys.executable, "-c", code]
        proc = subprocess.run(
            command, cwd=tmp_path, env=subprocess_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, f"{code}\n{proc.stdout}"
        if shown is not None:
            assert (why := output_differs(shown, proc.stdout)) is None, f"{code}: {why}\n{proc.stdout}"
    assert (tmp_path / "beta.png").is_file()
