"""Heads-only checkpoints on the command line, as a table: each row a real `deltafy eval` (or `train`,
`inspect`) subprocess on a copy of a tiny llama's heads-only folder (or full checkpoint) edited by hand,
its exit code, its first line, and the folders it must leave as they were.

Heads load exactly or not at all (name, shape and dtype of every tensor, checked before any is
copied); the spec in config.json is checked as when it was written; a base is verified or refused,
and one that moved is found with --base. Every row failed before those checks and that flag existed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cases import Case, assert_case, run_table
from helpers.training import build_stock_model
from safetensors.torch import load_file, save_file

from deltafy.modeling_deltafy import HEADS_FILE

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

HEAD = "model.layers.0.delta.attn."
COMMIT = "0123456789abcdef0123456789abcdef01234567"
HUB_BASE = {"id": "someone/tiny-llama", "revision": COMMIT}
PASS_BASE = "--base PATH (deltafy_base=PATH in Python)"
# (braces doubled: a row's expected line is formatted with the table's paths)
FORMS = 'deltafy.base must be {{"id", "revision"}} (a Hub model) or {{"path", "sha256"}} (a local one)'
EVAL = ["eval", "{here}/hd", "--data", "{held}", "--seq-len", "32", "--max-blocks", "2"]
KEPT = ("{here}/hd", "{here}/stock")


def _edit_tensors(file: Path, edit) -> None:
    stored = load_file(str(file))
    edit(stored)
    save_file(stored, str(file), metadata={"format": "pt"})


def _edit_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["deltafy"])
    (folder / "config.json").write_text(json.dumps(config))


def heads_only(tensors=None, spec=None, base_at: str = "stock"):
    """prepare: the table's heads-only folder at {here}/hd over a copy of its base at {here}/<base_at>
    (recorded as ../stock, with its hashes), its heads file and config's deltafy section then edited."""

    def prepare(here: Path, paths: dict) -> None:
        shutil.copytree(paths["stock"], here / base_at)
        shutil.copytree(paths["heads_only"], here / "hd")
        _edit_config(here / "hd", lambda section: section["base"].update(path="../stock"))
        if tensors is not None:
            _edit_tensors(here / "hd" / HEADS_FILE, tensors)
        if spec is not None:
            _edit_config(here / "hd", spec)

    return prepare


def with_other_model(prepare_heads):
    """prepare: as ``prepare_heads``, plus another model of the same shape at {here}/other."""

    def prepare(here: Path, paths: dict) -> None:
        prepare_heads(here, paths)
        shutil.copytree(paths["other"], here / "other")

    return prepare


def full(tensors):
    """prepare: the table's full checkpoint at {here}/full, the shard holding its heads edited (and
    its index naming what the shard holds now)."""

    def prepare(here: Path, paths: dict) -> dict:
        folder = here / "full"
        shutil.copytree(paths["full"], folder)
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = index["weight_map"][HEAD + "strength"]
        _edit_tensors(folder / shard, tensors)
        index["weight_map"] |= dict.fromkeys(load_file(str(folder / shard)), shard)
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        return {"shard": shard}

    return prepare


def _set(key: str, value):
    return lambda section: section.__setitem__(key, value)


def _set_site(key: str, value):
    return lambda section: section["sites"][0].__setitem__(key, value)


def _trained_over_moved(paths: dict) -> None:
    base = json.loads((Path(paths["here"]) / "run" / "config.json").read_text())["deltafy"]["base"]
    assert base["path"] == "../moved" and base["sha256"], base


# deepspeed, imported by the Trainer, prints which accelerator it picked to stdout unless told
QUIET_DEEPSPEED = {"DS_ACCELERATOR": "cpu"}
TRAIN = ["train", "{here}/hd", "--data", "{held}", "--out", "{here}/run", "--steps", "1", "--seq-len", "32"]
TRAIN += ["--batch-size", "2", "--eval-every", "1", "--max-eval-blocks", "1", "--heads-only"]

CASES = [
    # -- the heads file: every tensor's name, shape and dtype, before anything is copied
    Case(
        "target-of-one",  # once broadcast over the row of 64: exit 0
        EVAL,
        1,
        f"{HEAD}target.weight in {HEADS_FILE} has shape (1,), the model's is (1, 64)",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.update({HEAD + "target.weight": torch.zeros(1)})),
    ),
    Case(
        "strength-0d",  # once broadcast into the site's strength
        EVAL,
        1,
        f"{HEAD}strength in {HEADS_FILE} has shape (), the model's is (1,)",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.update({HEAD + "strength": torch.tensor(0.5)})),
    ),
    Case(
        "missing-tensor",
        EVAL,
        1,
        f"{HEADS_FILE} lacks the head {HEAD}strength of this model (1 missing, 0 unexpected)",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.pop(HEAD + "strength")),
    ),
    Case(
        "unexpected-tensor",
        EVAL,
        1,
        f"{HEADS_FILE} holds {HEAD}extra, which is not a head of this model (0 missing, 1 unexpected)",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.update({HEAD + "extra": torch.ones(1)})),
    ),
    Case(
        "int-tensor",  # once made a float silently
        EVAL,
        1,
        f"{HEAD}strength in {HEADS_FILE} holds torch.int64, not floats",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.update({HEAD + "strength": torch.ones(1, dtype=torch.int64)})),
    ),
    Case(
        "inspect-target-of-one",
        ["inspect", "{here}/hd"],
        1,
        f"{HEAD}target.weight in {HEADS_FILE} has shape (1,), the model's is (1, 64)",
        untouched=KEPT,
        prepare=heads_only(tensors=lambda t: t.update({HEAD + "target.weight": torch.zeros(1)})),
    ),
    # -- the spec in config.json, checked as when it was written; the field and its value named
    Case(
        "eps-nan",  # once loaded, and evaluated to `loss nan`
        EVAL,
        1,
        "invalid {here}/hd/config.json: eps must be a finite number > 0, got nan",
        untouched=KEPT,
        prepare=heads_only(spec=_set("eps", float("nan"))),
    ),
    Case(
        "eps-inf",
        EVAL,
        1,
        "invalid {here}/hd/config.json: eps must be a finite number > 0, got inf",
        untouched=KEPT,
        prepare=heads_only(spec=_set("eps", float("inf"))),
    ),
    Case(
        "channels-0",
        EVAL,
        1,
        "invalid {here}/hd/config.json: channels must be a positive integer, got 0",
        untouched=KEPT,
        prepare=heads_only(spec=_set("channels", 0)),
    ),
    Case(
        "channels-1.5",
        EVAL,
        1,
        "invalid {here}/hd/config.json: channels must be a positive integer, got 1.5",
        untouched=KEPT,
        prepare=heads_only(spec=_set("channels", 1.5)),
    ),
    Case(
        "rank-negative",
        EVAL,
        1,
        "invalid {here}/hd/config.json: rank must be a positive integer or null, got -1",
        untouched=KEPT,
        prepare=heads_only(spec=_set("rank", -1)),
    ),
    Case(
        "gate-bias-nan",
        EVAL,
        1,
        "invalid {here}/hd/config.json: gate_bias must be a finite number, got nan",
        untouched=KEPT,
        prepare=heads_only(spec=_set("gate_bias", float("nan"))),
    ),
    Case(
        "scale-nan",
        EVAL,
        1,
        "invalid {here}/hd/config.json: site 'attn': scale must be a finite number > 0, got nan",
        untouched=KEPT,
        prepare=heads_only(spec=_set_site("scale", float("nan"))),
    ),
    Case(
        "scale-inf",
        EVAL,
        1,
        "invalid {here}/hd/config.json: site 'attn': scale must be a finite number > 0, got inf",
        untouched=KEPT,
        prepare=heads_only(spec=_set_site("scale", float("inf"))),
    ),
    # -- the base record: one of its two forms, or one line naming the field
    Case(
        "base-a-string",
        EVAL,
        1,
        f"invalid {{here}}/hd/config.json: {FORMS}, got '../stock'",
        untouched=KEPT,
        prepare=heads_only(spec=_set("base", "../stock")),
    ),
    Case(
        "base-empty",
        EVAL,
        1,
        f"invalid {{here}}/hd/config.json: {FORMS}, got {{{{}}}}",
        untouched=KEPT,
        prepare=heads_only(spec=_set("base", {})),
    ),
    Case(
        "base-id-without-revision",
        EVAL,
        1,
        "invalid {here}/hd/config.json: deltafy.base names the Hub model someone/tiny-llama but no revision",
        untouched=KEPT,
        prepare=heads_only(spec=_set("base", {"id": "someone/tiny-llama"})),
    ),
    Case(
        "base-sha256-a-list",
        EVAL,
        1,
        "deltafy.base.sha256 must map each weight file's name to its SHA-256 (64 hex digits), got "
        "['model.safetensors']",
        untouched=KEPT,
        prepare=heads_only(spec=lambda s: s["base"].update(sha256=["model.safetensors"])),
    ),
    Case(
        "local-base-without-sha256",  # once loaded whatever the path held
        EVAL,
        1,
        "invalid {here}/hd/config.json: deltafy.base names the local model ../stock but no sha256 of its weight files",
        untouched=KEPT,
        prepare=heads_only(spec=lambda s: s["base"].pop("sha256")),
    ),
    Case(
        "unhashed-path-to-another-model",  # once evaluated another model's weights under these heads
        EVAL,
        1,
        "deltafy.base names the local model ../other but no sha256",
        untouched=KEPT,
        prepare=with_other_model(heads_only(spec=lambda s: s.update(base={"path": "../other"}))),
    ),
    Case(
        "path-to-another-model",
        EVAL,
        1,
        "{here}/hd/../other is not the base model this checkpoint was made from: model.safetensors is sha256",
        untouched=KEPT,
        prepare=with_other_model(heads_only(spec=lambda s: s["base"].update(path="../other"))),
    ),
    # -- a Hub base offline, and a base that moved
    Case(
        "hub-base-offline-uncached",  # once "does not appear to have a file named pytorch_model.bin"
        EVAL,
        1,
        f"the base model someone/tiny-llama at revision {COMMIT} is not in the local Hugging Face cache and the "
        f"Hub is offline (HF_HUB_OFFLINE is set)",
        needles=(PASS_BASE,),
        untouched=KEPT,
        prepare=heads_only(spec=_set("base", HUB_BASE)),
        env={"HF_HUB_CACHE": "{here}/hf-cache"},
    ),
    Case(
        "hub-base-offline-with-base",  # its local copy: no hashes, so it must fill the model exactly
        [*EVAL, "--base", "{here}/stock"],
        0,
        "loss ",
        untouched=KEPT,
        prepare=heads_only(spec=_set("base", HUB_BASE)),
        env={"HF_HUB_CACHE": "{here}/hf-cache"},
    ),
    Case(
        "moved-base",  # the message once named only deltafy_base=PATH, which the command line cannot pass
        EVAL,
        1,
        "the base model of this heads-only checkpoint was not found at {here}/hd/../stock",
        needles=(PASS_BASE,),
        untouched=("{here}/hd", "{here}/moved"),
        prepare=heads_only(base_at="moved"),
    ),
    Case(
        "moved-base-with-base",
        [*EVAL, "--base", "{here}/moved"],
        0,
        "loss ",
        untouched=("{here}/hd", "{here}/moved"),
        prepare=heads_only(base_at="moved"),
    ),
    Case(
        "base-flag-to-another-model",  # still checked against the recorded hashes
        [*EVAL, "--base", "{here}/other"],
        1,
        "{here}/other is not the base model this checkpoint was made from: model.safetensors is sha256",
        untouched=("{here}/hd", "{here}/other"),
        prepare=with_other_model(heads_only(base_at="moved")),
    ),
    Case(
        "base-flag-to-nothing",
        [*EVAL, "--base", "{here}/nowhere"],
        1,
        "the base model given for this heads-only checkpoint is not there: {here}/nowhere",
        untouched=("{here}/hd",),
        prepare=heads_only(base_at="moved"),
    ),
    Case(
        "base-flag-on-a-stock-model",
        ["eval", "{here}/stock", "--data", "{held}", "--seq-len", "32", "--base", "{here}/stock"],
        1,
        "--base applies to a heads-only deltafy checkpoint, and {here}/stock is not a deltafy one",
        untouched=("{here}/stock",),
        prepare=heads_only(),
    ),
    Case(
        "train-moved-base",
        TRAIN,
        1,
        "the base model of this heads-only checkpoint was not found at {here}/hd/../stock",
        needles=(PASS_BASE,),
        untouched=("{here}/hd", "{here}/moved"),
        absent=("{here}/run/config.json",),
        prepare=heads_only(base_at="moved"),
    ),
    Case(
        "train-moved-base-with-base",  # the heads-only output records where the base is now
        [*TRAIN, "--base", "{here}/moved"],
        0,
        "held-out loss ",
        untouched=("{here}/hd", "{here}/moved"),
        prepare=heads_only(base_at="moved"),
        check=_trained_over_moved,
        env=QUIET_DEEPSPEED,
    ),
    # -- a full checkpoint holding the heads: refused in one line too (transformers printed a table first)
    Case(
        "full-target-of-one",
        ["eval", "{here}/full", "--data", "{held}", "--seq-len", "32", "--max-blocks", "2"],
        1,
        f"{HEAD}target.weight in {{shard}} has shape (1,), the model's is (1, 64)",
        untouched=("{here}/full",),
        prepare=full(lambda t: t.update({HEAD + "target.weight": torch.zeros(1)})),
    ),
    Case(
        "full-int-tensor",
        ["eval", "{here}/full", "--data", "{held}", "--seq-len", "32", "--max-blocks", "2"],
        1,
        f"{HEAD}strength in {{shard}} holds torch.int64, not floats",
        untouched=("{here}/full",),
        prepare=full(lambda t: t.update({HEAD + "strength": torch.ones(1, dtype=torch.int64)})),
    ),
    Case(
        "full-unexpected-tensor",  # once dropped: the spec does not make it
        ["eval", "{here}/full", "--data", "{held}", "--seq-len", "32", "--max-blocks", "2"],
        1,
        f"{{shard}} holds {HEAD}extra, which is not a head of this model",
        untouched=("{here}/full",),
        prepare=full(lambda t: t.update({HEAD + "extra": torch.ones(1)})),
    ),
]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    from deltafy.conversion.job import convert_source

    root = tmp_path_factory.mktemp("heads-only-cases")
    convert_source(str(tiny.stock), root / "heads-only", heads_only=True)
    build_stock_model(tiny.tokenizer, seed=1).save_pretrained(root / "other")  # the same shapes, other weights
    paths = {"stock": str(tiny.stock), "heads_only": str(root / "heads-only"), "full": str(tiny.delta)}
    paths |= {"other": str(root / "other"), "held": str(tiny.held_txt)}
    return run_table(CASES, paths, root, env={"DELTAFY_CACHE": str(root / "cache")})


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_heads_only_case(runs, case):
    assert_case(case, runs[case.name])


def test_every_row_guards_something():
    """A row that checks neither files nor a refusal could pass on any code."""
    for case in CASES:
        assert case.untouched or case.absent or case.check or case.code != 0, case.name
