"""The code the project's Markdown pages show: their fenced blocks, and shell lines continued with a backslash."""

from __future__ import annotations

import re

_FENCE = re.compile(r"```([\w-]*)\n(.*?)```", re.S)


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of ``markdown`` in order; the language is "" for a block of output."""
    return _FENCE.findall(markdown)


def join_continued(code: str) -> str:
    """``code`` with each line that ends in a backslash joined to the next, as the shell reads it."""
    return re.sub(r"\s*\\\n\s*", " ", code)
