"""``deltafy inspect``: the β table, ``--json`` with the same numbers, ``--plot`` and ``--data``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.cli import assert_one_line_error, cli
from helpers.models import open_gates
from helpers.training import tiny_setup

import deltafy
from deltafy.data import pack, token_stream
from deltafy.surgery import mean_betas


@pytest.fixture(scope="module")
def opened(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The tiny setup's converted llama with open, random gates (β differs per layer and site), its
    held-out text, and a token cache of its own."""
    setup = tiny_setup(tmp_path_factory)
    model = deltafy.load(setup.delta, dtype=torch.float32)
    open_gates(model, seed=1)
    out = deltafy.save(model, tmp_path_factory.mktemp("inspect") / "opened [v1]", tokenizer=setup.tokenizer)
    return out, setup.held_txt, setup.root / "inspect-cache"


def table_rows(stdout: str) -> dict[int, list[str]]:
    rows = [line.split() for line in stdout.splitlines() if line.strip()[:1].isdigit()]
    return {int(row[0]): row[1:] for row in rows}


def test_json_holds_the_tables_numbers_and_plot_draws_them(opened, tmp_path):
    from matplotlib.image import imread

    model, _, cache = opened
    env = {"DELTAFY_CACHE": str(cache)}
    table = cli("inspect", model, cwd=tmp_path, env=env)
    assert table.returncode == 0, table.stderr
    assert "mean α·β on the 4 built-in prompts\n" in table.stdout  # what the means are over
    shown = cli("inspect", model, "--json", "--plot", "figures/beta.png", cwd=tmp_path, env=env)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)  # the whole of stdout is one JSON object
    assert record["sites"] == ["attn", "mlp"] and record["recipe"] == "ddl-scalar"
    assert record["base_model_type"] == "llama" and record["measured_on"] == "built-in prompts"
    rows = table_rows(table.stdout)
    assert sorted(rows) == [layer["layer"] for layer in record["layers"]] == [0, 1]
    for layer in record["layers"]:
        assert rows[layer["layer"]] == [f"{layer['beta'][site]:.3g}" for site in record["sites"]]
    values = [v for layer in record["layers"] for v in layer["beta"].values()]
    assert len(set(values)) == 4 and all(0 < v < 2 for v in values)  # open gates: four different means

    pixels = imread(tmp_path / "figures" / "beta.png")
    assert pixels.shape[:2] == (540, 960) and pixels.std() > 0.05
    again = cli("inspect", model, "--plot", "figures/beta.png", cwd=tmp_path, env=env)
    assert_one_line_error(again, "figures/beta.png already exists", "--overwrite")


def test_data_measures_beta_on_that_text(opened, tmp_path):
    model_dir, held, cache = opened
    shown = cli("inspect", model_dir, "--data", held, "--json", cwd=tmp_path, env={"DELTAFY_CACHE": str(cache)})
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)

    model = deltafy.load(model_dir, dtype=torch.float32)
    blocks = pack(token_stream([str(held)], deltafy.load_tokenizer(model_dir), use_cache=False), 256)[:8]
    with torch.no_grad():
        expected = mean_betas(model, lambda: model(input_ids=blocks))
    assert record["measured_on"] == {"data": [str(held)], "tokens": blocks.numel()}
    for layer in record["layers"]:
        for site, value in layer["beta"].items():
            assert value == pytest.approx(expected[f"model.layers.{layer['layer']}.delta.{site}"], rel=1e-5)

    missing = cli("inspect", model_dir, "--data", tmp_path / "nope.txt", cwd=tmp_path)
    assert_one_line_error(missing, "nope.txt")


def test_a_bf16_checkpoint_is_inspected_in_bf16(opened, tmp_path):
    """inspect reads a model in the dtype eval does: a bf16 checkpoint as bf16 (as it is served), not float32
    (twice its memory)."""
    model_dir, held, cache = opened
    model = deltafy.load(model_dir, dtype=torch.bfloat16)
    bf16_dir = deltafy.save(model, tmp_path / "bf16", tokenizer=deltafy.load_tokenizer(model_dir))
    shown = cli("inspect", bf16_dir, "--data", held, "--json", cwd=tmp_path, env={"DELTAFY_CACHE": str(cache)})
    assert shown.returncode == 0, shown.stderr
    measured = {
        f"model.layers.{layer['layer']}.delta.{site}": value
        for layer in json.loads(shown.stdout)["layers"]
        for site, value in layer["beta"].items()
    }
    blocks = pack(token_stream([str(held)], deltafy.load_tokenizer(bf16_dir), use_cache=False), 256)[:8]
    expected = {}
    for dtype in (torch.bfloat16, torch.float32):
        loaded = deltafy.load(bf16_dir, dtype=dtype)
        with torch.no_grad():
            expected[dtype] = mean_betas(loaded, lambda model=loaded: model(input_ids=blocks))
    assert measured == pytest.approx(expected[torch.bfloat16], rel=1e-5)
    assert measured != pytest.approx(expected[torch.float32], rel=1e-5)  # (the dtype shows in the means)
