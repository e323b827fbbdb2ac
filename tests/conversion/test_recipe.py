"""Recipes: bundled names, YAML paths, and one-line DeltafyErrors for every kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from deltafy.errors import DeltafyError
from deltafy.recipe import DEFAULT_RECIPE, Recipe, bundled_recipes, load_recipe, recipe_from_dict


def _write(tmp_path: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert message, "a DeltafyError must say what is wrong"
    assert "\n" not in message, f"error message is not one line: {message!r}"
    assert "Traceback" not in message and "pydantic" not in message.lower()
    return message


# -- bundled recipes -------------------------------------------------------------------------


def test_default_recipe_is_the_scalar_paper_recipe():
    recipe = load_recipe()
    assert DEFAULT_RECIPE == "ddl-scalar"
    assert recipe.name == "ddl-scalar"
    assert recipe.direction == "sublayer"
    assert recipe.rank is None
    assert recipe.sites == ["attn", "mlp"]
    assert recipe.gate == "strength" and recipe.gate_bias == 0.0  # alpha = 0 keeps it off, beta starts at 1
    assert recipe.training.gate_lr_scale == 10.0
    assert recipe.eps == 1e-6
    assert load_recipe(None) == recipe == load_recipe("ddl-scalar")
    logit = load_recipe("ddl-scalar-logit")  # deltafy 0.1's default, kept to compare against
    assert logit.gate == "logit" and logit.gate_bias == -18.0 and logit.training.gate_lr_scale == 100.0


def test_learned_recipe_loads_by_name():
    recipe = load_recipe("ddl-learned")
    assert recipe.name == "ddl-learned"
    assert recipe.direction == "learned"
    assert recipe.rank == 16
    assert recipe.sites == ["attn", "mlp"]
    assert recipe.training.lr == 1e-3
    assert recipe.gate == "strength" and recipe.gate_bias == 0.0 and recipe.training.gate_lr_scale == 10.0


def test_every_bundled_recipe_is_valid_and_named_after_its_file():
    bundled = bundled_recipes()
    assert {"ddl-scalar", "ddl-learned"} <= set(bundled)
    for stem, path in bundled.items():
        recipe = load_recipe(stem)
        assert recipe.name == stem, f"{path} declares name {recipe.name!r}"
        assert load_recipe(path) == recipe  # the same file by path


def test_recipe_instance_passes_through_unchanged():
    recipe = Recipe(name="mine", direction="learned", rank=4)
    assert load_recipe(recipe) is recipe


def test_a_dict_of_recipe_keys_is_a_recipe_and_anything_else_is_named():
    # a dict was read as a recipe's name ("no recipe named \"{'direction': 'learned'}\"")
    assert load_recipe({"name": "mine", "direction": "learned", "rank": 4}) == Recipe(
        name="mine", direction="learned", rank=4
    )
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe({"name": "mine", "direction": "sideways"})
    assert _one_line_error(excinfo).startswith("invalid recipe: direction:")
    for wrong in (5, ["attn"], b"ddl-scalar"):
        with pytest.raises(DeltafyError) as excinfo:
            load_recipe(wrong)
        assert _one_line_error(excinfo) == (
            f"a recipe is a deltafy.Recipe, a bundled recipe's name, a YAML file's path or a dict of its keys, "
            f"not {wrong!r}"
        )


# -- YAML paths ------------------------------------------------------------------------------


def test_yaml_path_loads(tmp_path):
    path = _write(
        tmp_path,
        "name: custom\n"
        "direction: learned\n"
        "rank: 8\n"
        "sites: [mlp]\n"
        "gate_bias: -12\n"
        "training:\n"
        "  lr: 5.0e-4\n"
        "  gate_lr_scale: 10\n",
    )
    for key in (path, str(path)):
        recipe = load_recipe(key)
        assert recipe.name == "custom"
        assert recipe.direction == "learned"
        assert recipe.rank == 8
        assert recipe.sites == ["mlp"]
        assert recipe.gate_bias == -12.0
        assert recipe.training.lr == 5e-4
        assert recipe.training.gate_lr_scale == 10.0
        assert recipe.training.weight_decay == 0.0  # defaults fill what the file leaves out


def test_minimal_yaml_gets_defaults(tmp_path):
    recipe = load_recipe(_write(tmp_path, "name: tiny\n"))
    assert recipe == Recipe(name="tiny")
    assert recipe.direction == "sublayer" and recipe.sites == ["attn", "mlp"]


def test_to_yaml_round_trips(tmp_path):
    original = load_recipe("ddl-learned").model_copy(update={"name": "copy", "gate_bias": -20.0})
    path = _write(tmp_path, original.to_yaml())
    assert load_recipe(path) == original
    assert yaml.safe_load(path.read_text())["gate_bias"] == -20.0


# -- bad input: one-line DeltafyErrors -------------------------------------------------------


def test_unknown_key_is_named(tmp_path):
    path = _write(tmp_path, "name: x\nlearning_rate: 0.1\n")
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    message = _one_line_error(excinfo)
    assert "learning_rate" in message
    assert "unknown key" in message
    assert str(path) in message


def test_unknown_nested_key_is_named_with_its_path(tmp_path):
    path = _write(tmp_path, "name: x\ntraining:\n  momentum: 0.9\n")
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    message = _one_line_error(excinfo)
    assert "training.momentum" in message and "unknown key" in message


@pytest.mark.parametrize(
    "body, fragments",
    [
        ("name: x\ndirection: foo\n", ["direction"]),
        ("name: x\nrank: 4\n", ["rank applies only to direction: learned"]),
        ("name: x\ndirection: sublayer\nrank: 4\n", ["rank"]),
        ("name: x\ndirection: learned\nrank: 0\n", ["rank"]),
        ("name: x\ngate_bias: 5\n", ["gate_bias"]),
        ("name: x\ngate_bias: -100\n", ["gate_bias"]),
        ("name: x\nsites: [attn, attn]\n", ["sites", "repeat"]),
        ("name: x\nsites: []\n", ["sites"]),
        ("name: x\nsites: [attn, ffn]\n", ["sites"]),
        ("name: x\neps: -1\n", ["eps"]),
        ("name: x\ntraining:\n  lr: 0\n", ["training.lr"]),
        ("name: x\ntraining:\n  weight_decay: -0.1\n", ["training.weight_decay"]),
        ("direction: learned\n", ["name"]),
        ("name: x\ndirection: foo\ngate_bias: 5\nbogus: 1\n", ["direction", "gate_bias", "bogus"]),
        ("name: x\ndirection: learned\nrank: 1.0e+20\n", ["rank:"]),
        ("name: x\ndirection: learned\nrank: 100000000\n", ["rank: Input should be less than or equal to 16384"]),
        ("name: x\ntraining:\n  lr: 1e400\n", ["training.lr: Input should be a finite number"]),
        ("name: x\ntraining:\n  lr: .inf\n", ["training.lr: Input should be a finite number"]),
        ("name: x\neps: .nan\n", ["eps: Input should be a finite number"]),
        ("name: x\ntraining:\n  weight_decay: .inf\n", ["training.weight_decay"]),
        ("name: x\ntraining:\n  seed: -1\n", ["training.seed: Input should be greater than or equal to 0"]),
        ("name: x\ntraining:\n  seed: 4294967296\n", ["training.seed: Input should be less than or equal to"]),
        ("name: x\ntraining:\n  seq_len: 1\n", ["training.seq_len: Input should be greater than or equal to 2"]),
        ("name: x\ntraining:\n  lora_r: 100000000\n", ["training.lora_r"]),
        ("name: x\nchannels: 0\n", ["channels: Input should be greater than 0"]),
        ("name: x\nchannels: 17\n", ["channels: Input should be less than or equal to 16"]),
    ],
    ids=[
        "direction-foo",
        "rank-default-direction",
        "rank-with-sublayer",
        "rank-zero",
        "gate-bias-5",
        "gate-bias-too-low",
        "sites-repeat",
        "sites-empty",
        "sites-unknown",
        "eps-negative",
        "lr-zero",
        "weight-decay-negative",
        "name-missing",
        "several-errors",
        "rank-1e20",
        "rank-above-the-largest-hidden-size",
        "lr-1e400-read-as-inf",
        "lr-inf",
        "eps-nan",
        "weight-decay-inf",
        "seed-negative",
        "seed-above-32-bits",
        "seq-len-1",
        "lora-r-huge",
        "channels-zero",
        "channels-above-16",
    ],
)
def test_bad_values_raise_one_line_error(tmp_path, body, fragments):
    path = _write(tmp_path, body)
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    message = _one_line_error(excinfo)
    assert message.startswith(f"invalid recipe {path}")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


@pytest.mark.parametrize(
    "body",
    ["- attn\n- mlp\n", "just a string\n", "42\n", ""],
    ids=["list", "string", "number", "empty-file"],
)
def test_non_mapping_yaml_raises(tmp_path, body):
    path = _write(tmp_path, body)
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    message = _one_line_error(excinfo)
    assert "mapping" in message and str(path) in message


def test_non_mapping_dict_input_raises():
    with pytest.raises(DeltafyError) as excinfo:
        recipe_from_dict(["attn"])  # type: ignore[arg-type]
    assert "mapping" in _one_line_error(excinfo)


def test_missing_file_raises_and_lists_bundled(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(missing)
    message = _one_line_error(excinfo)
    assert str(missing) in message
    assert "ddl-scalar" in message and "ddl-learned" in message


def test_unknown_bundled_name_raises():
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe("ddl-nonexistent")
    message = _one_line_error(excinfo)
    assert "ddl-nonexistent" in message and "ddl-scalar" in message


def test_directory_is_not_a_recipe(tmp_path):
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(tmp_path)
    assert _one_line_error(excinfo).startswith(f"the recipe {tmp_path} is a folder; use one of ddl-")


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ("name: [unclosed\n", "line 2, column 1"),
        ("name: x\n  direction: : learned\n\t- bad\n", "line 2, column 12"),
        ("a: b: c\n", "line 1, column 5"),
        ("name: x\ntraining:\n\tlr: 1\n", "line 3, column 1"),
    ],
    ids=["unclosed-list", "bad-indent", "nested-colon", "tab-indent"],
)
def test_invalid_yaml_raises_one_line_error_that_says_where(tmp_path, body, where):
    path = _write(tmp_path, body)
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    message = _one_line_error(excinfo)
    assert message.startswith(f"could not read recipe {path}: ") and message.endswith(f" at {where}"), message


@pytest.mark.parametrize("given", ["missing.yaml", "./missing", "sub/missing.yml"])
def test_a_recipe_file_that_is_not_there_is_named_as_a_file(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(given)
    assert _one_line_error(excinfo).startswith(f"the recipe file {given} does not exist; use one of ddl-")


def test_undecodable_file_raises(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"name: \xff\xfe\xfa\n")
    with pytest.raises(DeltafyError) as excinfo:
        load_recipe(path)
    assert str(path) in _one_line_error(excinfo)


def test_numbers_at_their_bounds_are_accepted():
    from deltafy.recipe import RANK_MAX, SEED_MAX, TrainingDefaults

    training = TrainingDefaults(seed=SEED_MAX, seq_len=2, lora_r=RANK_MAX)
    assert (training.seed, training.seq_len, training.lora_r) == (2**32 - 1, 2, RANK_MAX)
    assert TrainingDefaults(seed=0).seed == 0
    assert recipe_from_dict({"name": "x", "direction": "learned", "rank": RANK_MAX}).rank == RANK_MAX
