"""Every ``deltafy ...`` command the README, docs/ and examples/ show names a command that exists and only
flags that command takes: the flags come from options models now, and a renamed field must not leave a page
telling users to type what the command refuses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from helpers.docs import code_blocks, join_continued

from deltafy.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMMAND = typer.main.get_command(app)  # the click command deltafy's parser is
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]
_INLINE = re.compile(r"`(deltafy [^`\n]+)`")


def shown_commands(text: str) -> list[str]:
    """The ``deltafy`` command lines of a Markdown text: in code blocks (continued lines joined, a shell
    prompt, settings of the environment and a trailing comment dropped, each command of a ``&&``/``;``/``|``
    chain) and inline code."""
    lines = []
    for _, block in code_blocks(text):
        lines += join_continued(block).splitlines()
    lines += _INLINE.findall(text)
    commands = []
    for line in lines:
        for part in re.split(r"&&|;|\|", line.strip().removeprefix("$ ")):
            part = re.sub(r"^(\w+=\S*\s+)+", "", part.split(" #")[0].strip())  # (VAR=value deltafy ...)
            if part.startswith("deltafy "):
                commands.append(part)
    return commands


def _flags(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}


def problems(line: str) -> list[str]:
    """What ``deltafy``'s own parser would refuse in ``line``: an unknown command, or a flag it does not take."""
    try:
        words = shlex.split(line)[1:]
    except ValueError:  # an unclosed quote in prose
        words = line.split()[1:]
    command, flags = COMMAND, _flags(COMMAND) | {"--help"}
    while words and hasattr(command, "commands") and not words[0].startswith("-"):
        if words[0] in ("…", "...", "COMMAND"):  # a placeholder for any command
            return []
        if words[0] not in command.commands:
            return [f"no command {words[0]!r}"]
        command = command.commands[words.pop(0)]
        flags |= _flags(command)
    return [f"no flag {w.split('=')[0]}" for w in words if w.startswith("--") and w.split("=")[0] not in flags]


def test_the_checker_finds_what_it_must():
    text = "```bash\n$ deltafy train ./m \\\n    --data a.txt --lr-typo 3  # note\n```\nthen `deltafy frobnicate x`.\n"
    text += "```\nHF_HUB_OFFLINE=1 X= deltafy cache info --json && deltafy eval ./m --data b.txt\n```\n"
    assert shown_commands(text) == [
        "deltafy train ./m --data a.txt --lr-typo 3",
        "deltafy cache info --json",
        "deltafy eval ./m --data b.txt",
        "deltafy frobnicate x",
    ]
    assert problems("deltafy train ./m --data a.txt --lr-typo 3") == ["no flag --lr-typo"]
    assert problems("deltafy frobnicate x") == ["no command 'frobnicate'"]
    assert problems("deltafy cache info --json") == []
    assert problems("deltafy cache info --all") == ["no flag --all"]  # (clear's, not info's)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shown_commands_are_accepted(page: Path):
    wrong = {line: found for line in shown_commands(page.read_text()) if (found := problems(line))}
    assert not wrong, wrong


def test_the_pages_show_the_commands():
    # the README's five-minute path alone shows convert, train, eval, inspect and push
    shown = [line for page in PAGES for line in shown_commands(page.read_text())]
    assert {line.split()[1] for line in shown} >= {"convert", "train", "eval", "inspect", "push", "bench"}
    assert len(shown) > 50
