"""`deltafy eval` and deltafy.evaluate: held-out loss of stock and converted models."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from helpers.training import run_cli

from deltafy.cli import main
from deltafy.errors import DeltafyError
from deltafy.evaluate import check_sizes, evaluate, evaluate_text, load_any, model_positions

SEQ = 32


pytestmark = pytest.mark.usefixtures("token_cache")


def json_result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"expected one line on stdout, got:\n{proc.stdout}"
    result = json.loads(lines[0])
    assert isinstance(result, dict)
    return result


def hand_blocks(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    """The text's tokens and a closing EOS, cut into whole blocks: written here, not taken from deltafy."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def hand_loss(model_dir, text: str, seq_len: int, max_blocks: int | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy of the stock model over the text's blocks, and the token count."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    blocks = hand_blocks(tokenizer, text, seq_len)[:max_blocks]
    with torch.no_grad():
        logits = model(input_ids=blocks).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    return loss.item(), blocks[:, 1:].numel()


@pytest.fixture(scope="module")
def cli_results(tiny, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("eval-cli")
    return {
        name: json_result(run_cli("eval", folder, "--data", tiny.held_txt, "--seq-len", SEQ, "--json", cwd=cwd))
        for name, folder in (("stock", tiny.stock), ("delta", tiny.delta))
    }


@pytest.mark.parametrize("name", ["stock", "delta"])
def test_eval_json_is_one_object(cli_results, tiny, name):
    result = cli_results[name]
    assert {"loss", "perplexity", "tokens"} <= result.keys()
    assert math.isfinite(result["loss"]) and 0 < result["loss"] < 20
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]), rel=1e-12)
    blocks = hand_blocks(tiny.tokenizer, tiny.held_txt.read_text(), SEQ)
    assert result["tokens"] == blocks.shape[0] * (SEQ - 1)
    assert (result["blocks"], result["seq_len"]) == (blocks.shape[0], SEQ)


def test_fresh_conversion_has_the_stock_loss(cli_results):
    assert cli_results["delta"]["loss"] == pytest.approx(cli_results["stock"]["loss"], abs=1e-4)


def test_eval_loss_equals_a_hand_computed_cross_entropy(cli_results, tiny):
    loss, tokens = hand_loss(tiny.stock, tiny.held_txt.read_text(), SEQ)
    assert cli_results["stock"]["tokens"] == tokens
    assert cli_results["stock"]["loss"] == pytest.approx(loss, abs=1e-5)
    assert cli_results["delta"]["loss"] == pytest.approx(loss, abs=1e-4)


def test_max_blocks_batch_size_and_text_field(tiny, tmp_path, capsys):
    jsonl = tmp_path / "held.jsonl"
    jsonl.write_text(json.dumps({"body": tiny.held_txt.read_text()}) + "\n")
    main(["eval", str(tiny.delta), "--data", str(jsonl), "--text-field", "body", "--seq-len", str(SEQ),
          "--max-blocks", "3", "--batch-size", "2", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    result = json.loads(out)
    assert out.count("\n") == 1
    assert (result["blocks"], result["tokens"]) == (3, 3 * (SEQ - 1))
    loss, tokens = hand_loss(tiny.stock, tiny.held_txt.read_text(), SEQ, max_blocks=3)
    assert result["loss"] == pytest.approx(loss, abs=1e-4)


def test_device_auto_evaluates_where_the_model_fits(tiny, capsys):
    """--device auto (the default where there is a GPU) maps the model over the devices it fits on with
    accelerate: with no GPU here, all of it on the CPU, measuring what the CPU measures."""
    main(["eval", str(tiny.delta), "--data", str(tiny.held_txt), "--seq-len", str(SEQ), "--device", "auto", "--json"])
    loss, _ = hand_loss(tiny.stock, tiny.held_txt.read_text(), SEQ)
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(loss, abs=1e-4)
    for folder in (tiny.stock, tiny.delta):
        model, _ = load_any(str(folder), device="auto")
        assert model.hf_device_map == {"": "cpu"}


def test_evaluate_text_on_both_kinds_of_folder(tiny):
    results = []
    for folder in (tiny.stock, tiny.delta):
        model, tokenizer = load_any(str(folder))
        assert not model.training
        results.append(evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=SEQ, batch_size=3))
    stock, delta = results
    assert delta.loss == pytest.approx(stock.loss, abs=1e-4)
    assert delta.tokens == stock.tokens
    assert json.loads(stock.to_json())["loss"] == stock.loss


def test_eval_of_a_folder_without_tokenizer_fails(tiny, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        if (tiny.stock / name).exists():
            shutil.copy(tiny.stock / name, bare / name)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(bare), "--data", str(tiny.held_txt), "--json"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "has no tokenizer" in captured.err and "Traceback" not in captured.err


def test_positions_are_read_from_every_family_s_key():
    from types import SimpleNamespace

    from helpers.models import tiny_config

    assert model_positions(tiny_config("gpt2")) == tiny_config("gpt2").n_positions == 1024
    assert model_positions(tiny_config("llama-tied")) == tiny_config("llama-tied").max_position_embeddings
    assert model_positions(SimpleNamespace(n_ctx=512)) == 512
    assert model_positions(SimpleNamespace(hidden_size=64)) is None  # unknown: nothing to check against


def test_sizes_are_checked_together_and_before_the_text_is_read(tiny):
    with pytest.raises(DeltafyError) as err:
        check_sizes(1, 0, 0)
    message = str(err.value)
    assert "\n" not in message
    for fragment in ("--seq-len takes an integer ≥ 2", "--batch-size takes an integer ≥ 1", "--max-blocks takes"):
        assert fragment in message, message
    check_sizes(2, 1, 1)
    model, tokenizer = load_any(str(tiny.delta))
    positions = model_positions(model.config)
    # A missing file would be its own error: the sizes are refused first.
    with pytest.raises(DeltafyError, match=f"--seq-len {positions + 1} is longer than the model's {positions} "):
        evaluate_text(model, tokenizer, ["no-such-file.txt"], seq_len=positions + 1)
    with pytest.raises(DeltafyError, match="--batch-size takes an integer ≥ 1; got 0"):
        evaluate_text(model, tokenizer, ["no-such-file.txt"], seq_len=SEQ, batch_size=0)


def test_a_trained_folder_is_read_as_its_run_read_text(tiny, tmp_path):
    """The run trained on blocks of 24 tokens, and its held-out file is too short for the default
    256: eval and inspect of the output default to the run's own settings, which its saved recipe
    records (config.json and recipe.yaml), and a flag still wins. The run measured its held-out loss
    on the first 3 blocks, so eval of its folder does too, and gives the run's "after" again (as a
    bench record's saved model does), saying that the text holds more."""
    import yaml

    from deltafy.checkpoint import read_config
    from deltafy.files import METRICS_FILE, read_metrics, run_summary

    short = tmp_path / "short.txt"
    short.write_text(tiny.held_txt.read_text()[:300])  # about 130 tokens: not one block of 256
    train = ["train", tiny.delta, "--data", tiny.train_txt, "--eval-data", short, "--out", tmp_path / "run"]
    train += ["--steps", "2", "--seq-len", "24", "--batch-size", "2", "--save-every", "50", "--max-eval-blocks", "3"]
    proc = run_cli(*train, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    saved = read_config(tmp_path / "run")["deltafy"]["recipe"]["training"]
    assert (saved["seq_len"], saved["batch_size"], saved["steps"], saved["max_eval_blocks"]) == (24, 2, 2, 3)
    assert "fsdp" not in saved  # how a run was launched is no recipe's business
    assert yaml.safe_load((tmp_path / "run" / "recipe.yaml").read_text())["training"] == saved

    result = json_result(run_cli("eval", tmp_path / "run", "--data", short, "--json", cwd=tmp_path))
    assert result["seq_len"] == 24
    assert result["blocks"] == result["tokens"] // 23 == 3 < result["available_blocks"]
    after = run_summary(read_metrics(tmp_path / "run" / METRICS_FILE))["loss_after"]
    assert result["loss"] == pytest.approx(after, abs=1e-5)
    every = result["available_blocks"]
    proc = run_cli("eval", tmp_path / "run", "--data", short, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"the first 3 of {every} blocks of 24 (--max-blocks {every} reads all)" in proc.stdout
    whole = run_cli("eval", tmp_path / "run", "--data", short, "--max-blocks", every, "--json", cwd=tmp_path)
    assert json_result(whole)["blocks"] == every
    # a conversion records no run: it reads every block, as the stock model does
    fresh = json_result(run_cli("eval", tiny.delta, "--data", short, "--seq-len", "24", "--json", cwd=tmp_path))
    assert fresh["blocks"] == fresh["available_blocks"] == every
    assert (
        json_result(run_cli("eval", tmp_path / "run", "--data", short, "--seq-len", "12", "--json", cwd=tmp_path))[
            "seq_len"
        ]
        == 12
    )
    # the converted model it came from was never trained: a run's default of 256 applies, and says so
    proc = run_cli("eval", tiny.delta, "--data", short, cwd=tmp_path)
    assert proc.returncode != 0 and "256" in proc.stderr


def test_a_trained_folder_is_evaluated_in_the_dtype_its_run_held_it_in(tiny, tmp_path, capsys):
    """A bf16 model trained on a CPU is held (and its held-out loss measured) in float32: eval of the folder
    loads it so and gives the run's "after" again, where the checkpoint's bf16 gives another loss."""
    from deltafy.conversion.job import convert_source
    from deltafy.options import options_from
    from deltafy.recipe import load_recipe
    from deltafy.training.job import run_training

    delta = tmp_path / "delta-bf16"
    convert_source(str(tiny.stock), delta, dtype="bfloat16")
    options = options_from(load_recipe().training.model_dump(), steps=2, seq_len=SEQ, batch_size=2, lr=0.05)
    run = run_training(str(delta), [str(tiny.train_txt)], tmp_path / "run", options, [str(tiny.held_txt)], False)
    capsys.readouterr()

    def evaluated(*flags: str) -> float:
        main(["eval", str(tmp_path / "run"), "--data", str(tiny.held_txt), "--json", *flags])
        return json.loads(capsys.readouterr().out)["loss"]

    assert evaluated() == pytest.approx(run.loss_after, abs=1e-6)
    assert abs(evaluated("--dtype", "bfloat16") - run.loss_after) > 1e-5  # (bf16 arithmetic: another loss)


def test_a_model_whose_embedding_is_offloaded_is_evaluated_where_it_computes(tiny, tmp_path):
    """accelerate holds an offloaded module's weights on the meta device and brings them in for each forward:
    evaluation and the β means send their ids where the embedding computes, not to its weights' meta device."""
    import deltafy
    from deltafy.training.trainable import site_betas

    blocks = torch.randint(0, 400, (3, SEQ), generator=torch.Generator().manual_seed(0))
    resident = deltafy.load(tiny.delta, dtype=torch.float32)
    device_map = {"model.embed_tokens": "disk", "model.layers": "cpu", "model.norm": "cpu"}
    device_map |= {"model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = deltafy.load(tiny.delta, dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path))
    assert offloaded.get_input_embeddings().weight.device.type == "meta"  # really offloaded
    assert evaluate(offloaded, blocks, 2).loss == pytest.approx(evaluate(resident, blocks, 2).loss, abs=1e-6)
    assert site_betas(offloaded, blocks)[0] == pytest.approx(site_betas(resident, blocks)[0], abs=1e-6)
