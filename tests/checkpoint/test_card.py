"""The model card (front matter read back by huggingface_hub), what provenance records, and the figures."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers.models import tiny_model
from huggingface_hub import ModelCard, metadata_load

import deltafy
from deltafy.card import model_card
from deltafy.sources.load import ALIAS_BASE_MODELS, ALIASES, load_source
from deltafy.sources.provenance import sha256_file
from deltafy.training.plots import beta_figure, plot_betas, plot_training, write_training_figures

CHECK = {
    "max_abs_dlogits": 1.5e-7,
    "beta_zero_bitwise": True,
    "greedy_tokens": 32,
    "greedy_identical": True,
    "tolerance": 1e-3,
    "dtype": "float32",
}
TOKEN = "hf_" + "Ab3" * 12
LOCAL_ROOTS = ("/home", "/tmp", "/Users", "/private", "C:\\")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict]:
    """A real converted tiny llama saved by deltafy, and its config.json."""
    out = deltafy.save(deltafy.convert(tiny_model("llama-tied")), tmp_path_factory.mktemp("card") / "tiny-delta")
    return out, json.loads((out / "config.json").read_text())


def front_matter(card: str, tmp_path: Path) -> dict:
    # Both of huggingface_hub's readers: the card object and the README.md file as the Hub reads it.
    (tmp_path / "README.md").write_text(card)
    data = ModelCard(card).data.to_dict()
    assert metadata_load(tmp_path / "README.md") == data
    return data


def assert_public(text: str, *local: Path) -> None:
    for path in local:
        assert str(path) not in text
    for root in LOCAL_ROOTS:
        assert root not in text, root
    assert not re.search(r"hf_[A-Za-z0-9]{16,}", text)


def test_full_copy_card_names_its_hub_base_and_license(saved, tmp_path):
    _, config = saved
    spec = config["deltafy"]
    provenance = {"kind": "hub", "source": "HuggingFaceTB/SmolLM2-135M", "revision": "a" * 40, "license": "apache-2.0"}
    card = model_card(config, spec, provenance, CHECK)
    front = front_matter(card, tmp_path)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert front["base_model_relation"] == "finetune"
    assert front["library_name"] == "transformers"
    assert front["pipeline_tag"] == "text-generation"
    assert front["tags"] == ["deltafy", "deep-delta-learning", "llama"]
    assert front["license"] == "apache-2.0"
    assert "model-index" not in front  # nothing was trained: no results to report
    assert "| logits with β = 0 bitwise identical | yes |" in card
    assert "| greedy generation, 32 tokens with KV cache | identical |" in card
    assert "from_pretrained(repo, trust_remote_code=True)" in card
    assert "recipe: `ddl-scalar`" in card
    # what a reader needs to load it, and nothing they could not get: no index serves deltafy
    assert "only `torch` and `transformers`" in card
    assert "pip install" not in card and "pypi.org" not in card


def test_heads_only_card_is_an_adapter_of_its_pinned_base(saved, tmp_path):
    _, config = saved
    spec = {**config["deltafy"], "base": {"id": "HuggingFaceTB/SmolLM2-135M", "revision": "b" * 40}}
    card = model_card(config, spec, {"kind": "hub", "source": "HuggingFaceTB/SmolLM2-135M"}, CHECK, repo_id="me/smol")
    front = front_matter(card, tmp_path)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert front["base_model_relation"] == "adapter"
    assert "license" not in front  # unknown stays unknown, never guessed
    assert f"`HuggingFaceTB/SmolLM2-135M` at revision `{'b' * 40}`" in card
    assert 'repo = "me/smol"' in card


def test_alias_card_names_the_model_its_file_was_made_from(saved, tmp_path):
    _, config = saved
    assert ALIAS_BASE_MODELS.keys() == ALIASES.keys()
    provenance = {
        "kind": "alias",
        "alias": "smollm2-135m",
        "source": ALIASES["smollm2-135m"][1],
        "base_model": ALIAS_BASE_MODELS["smollm2-135m"],
        "license": "apache-2.0",
    }
    front = front_matter(model_card(config, config["deltafy"], provenance, CHECK), tmp_path)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert front["license"] == "apache-2.0"
    # A heads-only folder on the alias: its base entry names the alias and a relative path.
    spec = {**config["deltafy"], "base": {"alias": "smollm2-135m", "path": "../x/model.gguf", "sha256": "e" * 64}}
    front = front_matter(model_card(config, spec, {"kind": "gguf", "source": "model.gguf"}, CHECK), tmp_path)
    assert front["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert front["base_model_relation"] == "adapter"


def test_card_of_a_local_source_after_training_shows_results_and_no_local_paths(saved, tmp_path):
    _, config = saved
    home = Path("/home/someone/models/tiny-llama")
    spec = {**config["deltafy"], "base": {"path": str(tmp_path / "tiny-llama"), "sha256": "c" * 64}}
    provenance = {"kind": "local", "source": str(home), "config_sha256": "d" * 64, "note": TOKEN}
    training = {
        "mode": "heads+lora",
        "steps": 30,
        "tokens": 30720,
        "trainable_params": 69240,
        "data": [str(tmp_path / "corpus" / "shakespeare.txt"), "/Users/me/more.jsonl"],
        "loss_before": 5.4321,
        "loss_after": 5.0123,
    }
    card = model_card(config, spec, provenance, CHECK, training, figures=["loss.png", "beta.png"])
    front = front_matter(card, tmp_path)
    assert "base_model" not in front  # a local folder is no Hub model to link to
    assert front["base_model_relation"] == "adapter"
    (result,) = front["model-index"][0]["results"]
    assert result["task"]["type"] == "text-generation"
    assert result["dataset"]["name"] == "shakespeare.txt, more.jsonl"
    assert {m["name"]: m["value"] for m in result["metrics"]} == {
        "held-out loss before training": 5.4321,
        "held-out loss after training": 5.0123,
    }
    assert {m["type"] for m in result["metrics"]} == {"loss"}
    assert "| held-out loss | 5.4321 → 5.0123 (-0.4198) |" in card
    assert "| what trained | `heads+lora` |" in card and "| tokens | 30,720 |" in card
    assert "](loss.png)" in card and "](beta.png)" in card
    assert '"source": "tiny-llama"' in card  # provenance keeps the folder's name
    assert_public(card, tmp_path, home)


def test_local_folder_provenance_keeps_a_name_a_hash_and_the_license(tmp_path):
    folder = tmp_path / "tiny-llama"
    tiny_model("llama-tied").save_pretrained(folder)
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# tiny\n")
    provenance = load_source(str(folder)).provenance
    assert provenance == {
        "kind": "local",
        "source": "tiny-llama",
        "config_sha256": sha256_file(folder / "config.json"),
        "license": "mit",
    }


def test_gguf_provenance_keeps_the_file_name_its_hash_and_license(tmp_path, monkeypatch):
    import gguf

    file = tmp_path / "models" / "tiny.Q4_1.gguf"
    file.parent.mkdir()
    writer = gguf.GGUFWriter(str(file), "llama")
    writer.add_string("general.license", "apache-2.0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    digest = sha256_file(file)
    # The dequantized copy deltafy keeps of a .gguf, made beforehand: the load below is the real one.
    monkeypatch.setenv("DELTAFY_CACHE", str(tmp_path / "cache"))
    tiny_model("llama-tied").save_pretrained(tmp_path / "cache" / "gguf" / digest[:16])
    provenance = load_source(str(file)).provenance
    assert provenance == {"kind": "gguf", "source": "tiny.Q4_1.gguf", "sha256": digest, "license": "apache-2.0"}
    assert str(tmp_path) not in json.dumps(provenance)


def assert_image(path: Path) -> None:
    from matplotlib.image import imread

    pixels = imread(path)
    height, width = pixels.shape[:2]
    assert (width, height) == (960, 540)
    assert pixels.std() > 0.05  # something is drawn on it, not a blank canvas


def test_beta_figure_per_layer_and_site(tmp_path):
    scale = {"attn": 1.0, "mlp": 2.0}
    betas = {f"model.layers.{i}.delta.{site}": 3e-8 * 10**i * scale[site] for i in range(6) for site in scale}
    path = plot_betas(betas, tmp_path / "figures" / "beta.png", title="tiny-delta")
    assert_image(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["beta.png"]  # no temporary file left beside it


def test_a_signed_alpha_beta_is_drawn_whole_with_its_sign():
    """After a short run with a strength gate, about half the sites carry a negative α·β: each is
    drawn below the zero line on a symmetric-log axis (a log axis dropped them), and the axis says
    what it shows."""
    values = {"attn": [2e-3, -5e-4, 3e-2, -1e-3], "mlp": [-2e-4, 4e-3, 0.0, 1e-1]}
    betas = {f"model.layers.{i}.delta.{site}": v for site, row in values.items() for i, v in enumerate(row)}
    ax = beta_figure(betas, "tiny", label="α·β").axes[0]
    assert ax.get_yscale() == "symlog"
    drawn = {
        line.get_label(): list(line.get_ydata()) for line in ax.get_lines() if not line.get_label().startswith("_")
    }
    assert drawn == values  # every site, every layer, negative ones included
    assert ax.get_ylabel().startswith("mean α·β") and "α·β" in ax.get_title()
    # values of one magnitude: a plain linear axis
    assert beta_figure({"s": [0.1, -0.2, 0.3]}).axes[0].get_yscale() == "linear"


def test_a_short_runs_alpha_beta_is_drawn_on_a_linear_axis():
    """The README's 16 steps: factors of either sign up to 0.08, most of them hundredths and one 6e-4.
    One small value does not turn the axis logarithmic (that drew a sign flip of 0.05 as a jump across
    four decades, and crowded the labels around 0); on a linear axis every marker lies inside the frame."""
    attn = [0.047, -0.081, -0.077, -0.028, -0.073, 0.0092, 0.021, -0.07, -0.03, 0.03, -0.012, -0.015, 0.066]
    mlp = [0.077, -0.031, -0.082, 0.039, -0.031, 0.013, 0.01, 0.011, 0.0066, -0.032, 0.029, -0.033, -0.00059]
    on = "the first 4 held-out blocks of 128 tokens"
    ax = beta_figure({"attn": attn, "mlp": mlp}, "smol-trained", label="α·β", measured_on=on).axes[0]
    assert ax.get_yscale() == "linear" and "log" not in ax.get_ylabel()
    # the text the means are over, under the title: a β is per token, its mean depends on the text
    assert ax.get_title() == f"Mean α·β per layer and site · smol-trained\non {on}"
    low, high = ax.get_ylim()
    assert low < min(attn + mlp) and high > max(attn + mlp)
    # a logit gate's 3e-8 beside opened sites: logarithmic, linear within a power of ten
    opened = beta_figure({"attn": [3e-8, 3e-8, 0.4, 3e-8], "mlp": [3e-8, 0.2, 3e-8, 3e-8]}).axes[0]
    assert opened.get_yscale() == "symlog" and "linear within ±1e-08" in opened.get_ylabel()


def test_training_figures_from_a_runs_metrics(tmp_path):
    records = [{"loss": 5 - math.log(step), "step": step, "learning_rate": 1e-3} for step in range(1, 31)]
    records += [{"eval_loss": 5.1 - math.log(step) / 2, "step": step} for step in (10, 20, 30)]
    records.append(
        {
            "event": "summary",
            "loss_before": 5.2,
            "loss_after": 3.6,
            "mean_beta_per_layer": [1e-4, 3e-3],
            "mean_beta_on": "the first 4 held-out blocks of 64 tokens",
        }
    )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert write_training_figures(tmp_path) == ["loss.png", "beta.png"]
    assert_image(tmp_path / "loss.png")
    assert_image(tmp_path / "beta.png")
    with pytest.raises(deltafy.DeltafyError, match="holds no losses"):
        (tmp_path / "empty.jsonl").write_text(json.dumps({"event": "start"}) + "\n")
        plot_training(tmp_path / "empty.jsonl", tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_saving_an_older_checkpoint_again_drops_the_local_path_of_its_source(tmp_path):
    """A checkpoint written before provenance kept names only (or by hand) carries a local path:
    the next save, e.g. at the end of training, must not copy it into config.json or the card."""
    from helpers.models import tiny_model

    import deltafy

    model = deltafy.convert(tiny_model("llama-tied"))
    old = {"kind": "local", "source": str(tmp_path / "home" / "me" / "stock")}
    deltafy.save(model, tmp_path / "out", provenance=old)
    config = (tmp_path / "out" / "config.json").read_text()
    card = (tmp_path / "out" / "README.md").read_text()
    assert str(tmp_path) not in config and str(tmp_path) not in card
    assert json.loads(config)["deltafy"]["provenance"]["source"] == "stock"
