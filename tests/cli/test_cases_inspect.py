"""`deltafy inspect` as a table of command lines: each row a real subprocess on a copy of a tiny llama's
checkpoint, its exit code, its first line (and, for some, a line further down), and the folders it must
leave as they were. Every row failed before inspect said what it measured on and took --base.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.cases import Case, assert_case, run_table
from safetensors.torch import load_file, save_file

from deltafy.modeling_deltafy import HEADS_FILE

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

PASS_BASE = "--base PATH (deltafy_base=PATH in Python)"
RANDOM_IDS = "mean α·β on random token ids: the checkpoint has no tokenizer to read the built-in prompts with"


@dataclass
class InspectCase(Case):
    """A row whose stdout must also hold each of ``lines`` as a whole line (formatted like ``first``)."""

    lines: tuple[str, ...] = ()


def _without_tokenizer(here: Path, paths: dict) -> None:
    shutil.copytree(paths["delta"], here / "nt", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))


def _heads_only(base_at: str = "stock", edit=None):
    """prepare: the table's heads-only folder at {here}/hd over a copy of its base at {here}/<base_at>
    (recorded as ../stock), its heads then edited by ``edit``."""

    def prepare(here: Path, paths: dict) -> None:
        shutil.copytree(paths["stock"], here / base_at)
        shutil.copytree(paths["heads_only"], here / "hd")
        config = json.loads((here / "hd" / "config.json").read_text())
        config["deltafy"]["base"]["path"] = "../stock"
        (here / "hd" / "config.json").write_text(json.dumps(config))
        if edit is not None:
            stored = load_file(str(here / "hd" / HEADS_FILE))
            edit(stored)
            save_file(stored, str(here / "hd" / HEADS_FILE), metadata={"format": "pt"})

    return prepare


def _full(here: Path, paths: dict) -> None:
    shutil.copytree(paths["delta"], here / "full")
    shutil.copytree(paths["stock"], here / "stock")


CASES = [
    InspectCase(
        "no-tokenizer",  # once measured on random ids and showed the numbers as if on the prompts
        ["inspect", "{here}/nt"],
        0,
        "{here}/nt: llama (LlamaForCausalLM)",
        untouched=("{here}/nt",),
        prepare=_without_tokenizer,
        lines=(RANDOM_IDS,),
    ),
    InspectCase(
        "no-tokenizer-json",  # once "measured_on": "built-in prompts"
        ["inspect", "{here}/nt", "--json"],
        0,
        '"measured_on": "random token ids"',
        untouched=("{here}/nt",),
        prepare=_without_tokenizer,
    ),
    InspectCase(
        "moved-base",
        ["inspect", "{here}/hd"],
        1,
        "the base model of this heads-only checkpoint was not found at {here}/hd/../stock",
        needles=(PASS_BASE,),
        untouched=("{here}/hd", "{here}/moved"),
        prepare=_heads_only(base_at="moved"),
    ),
    InspectCase(
        "moved-base-with-base",
        ["inspect", "{here}/hd", "--base", "{here}/moved"],
        0,
        "{here}/hd: llama (LlamaForCausalLM)",
        untouched=("{here}/hd", "{here}/moved"),
        prepare=_heads_only(base_at="moved"),
    ),
    InspectCase(
        "moved-base-with-base-json",
        ["inspect", "{here}/hd", "--base", "{here}/moved", "--json"],
        0,
        '"measured_on": "built-in prompts"',
        untouched=("{here}/hd", "{here}/moved"),
        prepare=_heads_only(base_at="moved"),
    ),
    InspectCase(
        "base-flag-on-a-full-checkpoint",
        ["inspect", "{here}/full", "--base", "{here}/stock"],
        1,
        "--base (base=) applies to a heads-only checkpoint, and {here}/full is a full one",
        untouched=("{here}/full", "{here}/stock"),
        prepare=_full,
    ),
    InspectCase(
        "heads-of-another-shape",  # once broadcast, and inspected as if it fit
        ["inspect", "{here}/hd", "--json"],
        1,
        f"model.layers.1.delta.mlp.gate.weight in {HEADS_FILE} has shape (64,), the model's is (1, 64)",
        untouched=("{here}/hd", "{here}/stock"),
        prepare=_heads_only(edit=lambda t: t.update({"model.layers.1.delta.mlp.gate.weight": torch.zeros(64)})),
    ),
]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    from deltafy.conversion.job import convert_source

    root = tmp_path_factory.mktemp("inspect-cases")
    convert_source(str(tiny.stock), root / "heads-only", heads_only=True)
    paths = {"stock": str(tiny.stock), "delta": str(tiny.delta), "heads_only": str(root / "heads-only")}
    return run_table(CASES, paths, root, env={"DELTAFY_CACHE": str(root / "cache")})


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_inspect_case(runs, case):
    result = runs[case.name]
    assert_case(case, result)
    shown = result.proc.stdout.splitlines()
    for line in case.lines:
        assert line.format(**result.paths) in shown, f"{line!r} not a line of stdout:\n{result.proc.stdout}"


def test_every_row_guards_something():
    """A row that checks neither files nor a refusal could pass on any code."""
    for case in CASES:
        assert case.untouched or case.absent or case.check or case.code != 0, case.name
