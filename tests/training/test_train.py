"""`deltafy train` and deltafy.training.job.run_training on a tiny llama with a real BPE tokenizer.

Everything runs for real (transformers Trainer, peft, torch.distributed with gloo); runs are a few
steps of a 2-layer width-64 model, so each takes about a second on one CPU thread.
"""

from __future__ import annotations

import ast
import gc
import json
import math
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from helpers.training import (
    REPO,
    deep_delta,
    interrupted_at,
    read_metrics,
    read_tensors,
    run_cli,
    step_records,
    subprocess_env,
)
from pydantic import ValidationError

import deltafy
from deltafy.data import pack, token_stream
from deltafy.errors import DeltafyError
from deltafy.evaluate import evaluate_text
from deltafy.options import TrainOptions, options_from
from deltafy.recipe import load_recipe
from deltafy.sources.folders import file_mode
from deltafy.surgery import mean_betas
from deltafy.training.job import run_training
from deltafy.training.launch import planned_steps
from deltafy.training.trainable import per_layer

HEAD_LR = 0.05  # large enough that the heads move the loss within a few steps (gate and strength lr = 0.5)


# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("token_cache")]


def opts(**overrides) -> TrainOptions:
    values = dict(steps=3, seq_len=64, batch_size=4, lr=HEAD_LR, save_every=100)
    values.update(overrides)
    # the training section of the recipe tiny.delta was converted with, as `deltafy train` reads it
    return options_from(load_recipe().training.model_dump(), **values)


def train(tiny, out: Path, resume: bool = False, **overrides):
    return run_training(
        str(tiny.delta),
        [str(tiny.train_txt)],
        out,
        opts(**overrides),
        eval_data=[str(tiny.held_txt)],
        resume=resume,
        show_progress=False,
    )


def is_head(key: str) -> bool:
    return ".delta." in key


def changed_keys(before: dict, after: dict) -> set[str]:
    assert before.keys() == after.keys()
    return {k for k in before if not torch.equal(before[k], after[k])}


class LayerCalls:
    """Counts forward calls of the layers' MLPs in every model of the process (a global hook).

    transformers checkpoints a decoder layer's ``forward`` (its own hooks stay outside), so a
    recomputation shows up as a second call of the modules inside the layer. Calls are counted as
    they start: non-reentrant checkpointing stops a recomputation, mid-forward, as soon as the
    tensors backward needs are back.
    """

    def __enter__(self):
        self.count = 0

        def hook(module, args):
            if type(module).__name__ == "LlamaMLP":
                self.count += 1

        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.fixture(scope="module")
def heads_run(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "run"
    with LayerCalls() as calls:
        result = train(tiny, out)
    return out, result, calls.count


# -- heads-only training -----------------------------------------------------------------------


def test_heads_only_training_changes_only_the_heads(tiny, heads_run):
    out, result, _ = heads_run
    before, after = read_tensors(tiny.delta), read_tensors(out)
    heads = {k for k in before if is_head(k)}
    assert len(heads) == 2 * 2 * 5  # 2 layers x 2 sites x (gate, target) x (weight, bias), and a strength
    changed = changed_keys(before, after)
    assert changed <= heads, f"pretrained tensors changed: {sorted(changed - heads)}"
    assert {k for k in heads if k.endswith("gate.bias")} <= changed
    assert {k for k in heads if k.endswith("target.weight")} <= changed
    assert all(before[k].dtype == after[k].dtype for k in before)
    assert result.steps == 3
    assert result.trainable_params == sum(before[k].numel() for k in heads)


def test_trained_folder_loads_with_deltafy_and_with_transformers(tiny, heads_run, tmp_path):
    out, result, _ = heads_run
    model = deltafy.load(out)
    tokenizer = deltafy.load_tokenizer(out)
    assert tokenizer is not None and len(tokenizer) == len(tiny.tokenizer)
    # The saved folder is the trained model: its held-out loss is the one the run reported.
    loss = evaluate_text(model, tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert loss == pytest.approx(result.loss_after, abs=1e-5)
    assert result.loss_after != pytest.approx(result.loss_before, abs=1e-4)  # the heads did something

    ids = torch.randint(0, len(tiny.tokenizer), (2, 24), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    script = textwrap.dedent(
        """
        import sys
        sys.modules["deltafy"] = None  # stock transformers and the folder's own modeling file only
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        with torch.no_grad():
            torch.save(model(input_ids=torch.load(sys.argv[2])).logits, sys.argv[3])
        print(type(model).__name__)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", script, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
        env=subprocess_env({"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "DeltafyForCausalLM"
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=0)


def test_metrics_jsonl_has_every_step_and_a_summary(tiny, heads_run):
    out, result, _ = heads_run
    records = read_metrics(out)
    steps = step_records(records)
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["loss"] > 0
        assert r["learning_rate"] > 0
        assert r["tokens_per_second"] > 0
    summary = records[-1]
    assert summary["event"] == "summary"
    assert [r for r in records if r.get("event") == "summary"] == [summary]
    assert summary["steps"] == 3
    assert summary["loss_before"] == pytest.approx(result.loss_before)
    assert summary["loss_after"] == pytest.approx(result.loss_after)
    betas = summary["mean_beta_per_layer"]
    # alpha * beta per layer (gate: strength): zero at init, moved by training, unbounded in sign
    assert len(betas) == 2 and all(math.isfinite(b) and abs(b) > 1e-4 for b in betas)
    # measured on the text it names (beta.png's subtitle, the printed line): the saved model gives them there again
    assert summary["mean_beta_on"] == result.mean_beta_on == "the first 4 held-out blocks of 64 tokens"
    model = deltafy.load(out, dtype=torch.float32)
    blocks = pack(token_stream([str(tiny.held_txt)], deltafy.load_tokenizer(out), use_cache=False), 64)[:4]
    with torch.no_grad():
        again = mean_betas(model, lambda: model(input_ids=blocks))
    assert per_layer(again) == pytest.approx(betas, rel=1e-5)
    # Apart from the per-step records and the summary, only the Trainer's end-of-run record and
    # the periodic held-out evaluations (--eval-every).
    others = [r for r in records if r not in steps and r is not summary]
    assert all("train_runtime" in r or "eval_loss" in r for r in others), others


def test_gradient_checkpointing_gives_the_same_run(tiny, heads_run, tmp_path):
    out, _, plain_calls = heads_run
    with LayerCalls() as calls:
        train(tiny, tmp_path / "gc", gradient_checkpointing=True)
    # Checkpointing really happened: each layer ran once more per step, in the backward pass.
    assert calls.count == plain_calls + 3 * 2
    plain = [r["loss"] for r in step_records(read_metrics(out))]
    checkpointed = [r["loss"] for r in step_records(read_metrics(tmp_path / "gc"))]
    assert checkpointed == pytest.approx(plain, abs=1e-5)
    a, b = read_tensors(out), read_tensors(tmp_path / "gc")
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)


def compiled(model: Path, out: Path, tiny, **overrides) -> dict:
    """torch.compile's counters of a --compile run of ``model`` (from an empty cache: graphs another test compiled
    in this process would serve it, nothing captured)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    options = opts(compile=True, **overrides)
    run_training(str(model), [str(tiny.train_txt)], out, options, eval_data=[str(tiny.held_txt)], show_progress=False)
    return {kind: dict(counts) for kind, counts in counters.items()}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_compiled_run_is_the_eager_run(tiny, heads_run, tmp_path, checkpointing):
    out, _, _ = heads_run
    counts = compiled(tiny.delta, tmp_path / "compiled", tiny, gradient_checkpointing=checkpointing)
    # The layers ran as compiled graphs, checkpointed ones too (their sites' stash traffic broke the graph at the
    # checkpoint, and the layers ran eagerly): the graphs call the layer's 7 projections' matmuls, forward and
    # backward, and nothing breaks a graph but transformers' hook that makes the embeddings' output need grad
    # (outside the layers, checkpointing only).
    assert counts["inductor"]["extern_calls"] >= 14
    assert [reason for reason in counts.get("graph_break", {}) if "requires_grad_()" not in reason] == []
    eager = [r["loss"] for r in step_records(read_metrics(out))]
    compiled_losses = [r["loss"] for r in step_records(read_metrics(tmp_path / "compiled"))]
    assert compiled_losses == pytest.approx(eager, abs=1e-5)
    a, b = read_tensors(out), read_tensors(tmp_path / "compiled")
    assert a.keys() == b.keys()  # under the model's own names, not the compiled wrapper's
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-5, rtol=0, msg=key)
    assert "compile" not in (tmp_path / "compiled" / "recipe.yaml").read_text()  # how it ran, not what it trained


def test_a_compiled_run_compiles_one_decoder_layer_for_all(tiny, tmp_path):
    """--compile compiles each decoder layer on its own (accelerate's regional compilation) and the first
    layer's graph serves the others, so a deep model's first step compiles as fast as a shallow one's: a
    12-layer run captures the ops of a 2-layer one. The whole model as one graph captured every layer's
    (6 times as many here), and so did a graph for each layer."""
    deep = deep_delta(tiny.tokenizer, tmp_path, 12)
    shallow = compiled(tiny.delta, tmp_path / "shallow", tiny)["stats"]["calls_captured"]
    assert compiled(deep, tmp_path / "deep", tiny)["stats"]["calls_captured"] == shallow > 100  # (forward, backward)


# -- resuming ----------------------------------------------------------------------------------


def test_resume_continues_exactly(tiny, tmp_path):
    n = 4  # 24 training blocks / batch 4 = 6 steps per epoch: the run crosses an epoch boundary
    straight = tmp_path / "straight"
    train(tiny, straight, steps=2 * n, save_every=n)
    saved = sorted(p.name for p in (straight / "training").glob("checkpoint-*"))
    assert saved == [f"checkpoint-{n}", f"checkpoint-{2 * n}"]

    resumed = interrupted_at(straight, n, tmp_path / "resumed")

    with pytest.raises(DeltafyError, match="already holds files"):
        train(tiny, resumed, steps=2 * n, save_every=n)
    result = train(tiny, resumed, resume=True, steps=2 * n, save_every=n)
    assert result.steps == 2 * n

    a, b = step_records(read_metrics(straight)), step_records(read_metrics(resumed))
    assert [r["step"] for r in b] == list(range(1, 2 * n + 1))  # appended, not truncated
    assert [r["loss"] for r in b[n:]] == pytest.approx([r["loss"] for r in a[n:]], abs=1e-5)
    assert [r["learning_rate"] for r in b[n:]] == pytest.approx([r["learning_rate"] for r in a[n:]])
    ta, tb = read_tensors(straight), read_tensors(resumed)
    assert ta.keys() == tb.keys()
    for key in ta:
        torch.testing.assert_close(tb[key], ta[key], atol=1e-5, rtol=0, msg=key)
    heads = [k for k in ta if is_head(k)]
    assert changed_keys({k: read_tensors(tiny.delta)[k] for k in heads}, {k: ta[k] for k in heads})


def test_a_finished_run_leaves_its_model_to_reference_counting(tiny, tmp_path):
    """A second run in one process (a bench's on a GPU, a sweep in a notebook) starts with the first one's
    model gone, without waiting for the garbage collector: the trainer's class held the run (model and
    optimizer) in its closure, and a class is always in a reference cycle."""

    def converted_models() -> set[int]:  # (other tests' fixtures may hold some)
        return {id(o) for o in gc.get_objects() if isinstance(o, torch.nn.Module) and hasattr(o, "_deltafy_calls")}

    train(tiny, tmp_path / "first", steps=1)  # (the first run in a process leaves accelerate's state behind)
    gc.collect()
    gc.disable()
    try:
        before = converted_models()
        train(tiny, tmp_path / "second", steps=1)
        left = converted_models() - before
    finally:
        gc.enable()
    assert left == set()


def test_a_run_that_reads_its_text_more_than_once_says_so(tiny, tmp_path):
    # steps x blocks past the text were read as passes over it, silently: a batch of 8000 blocks over 190 said nothing
    blocks = len(pack(token_stream([str(tiny.train_txt)], tiny.tokenizer, use_cache=False), 64))
    for steps, batch in ((3, 16), (1, 2)):
        notices = []
        run_training(
            str(tiny.delta), [str(tiny.train_txt)], tmp_path / f"run-{steps}", opts(steps=steps, batch_size=batch),
            eval_data=[str(tiny.held_txt)], show_progress=False, notice=notices.append,
        )  # fmt: skip
        passes = steps * batch / blocks
        assert notices == [
            f"{steps} steps of {batch} blocks read the {blocks} training blocks {passes:.1f} times over; pass more "
            f"text (or fewer --steps) if the held-out loss rises"
        ] * (passes > 1)
    assert passes < 1 < 3 * 16 / blocks  # (both arms ran)


def test_out_folder_guards(tiny, tmp_path):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(DeltafyError, match="already holds files") as err:
        train(tiny, busy)
    assert "--resume" in str(err.value) and "--overwrite" in str(err.value)
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    with pytest.raises(DeltafyError, match="nothing to resume"):
        train(tiny, tmp_path / "new", resume=True)
    for flag in ("resume", "overwrite"):  # a folder deltafy did not write is no run to continue or replace
        with pytest.raises(DeltafyError, match=f"deltafy did not write .* --{flag} applies only"):
            run_training(str(tiny.delta), [str(tiny.train_txt)], busy, opts(), show_progress=False, **{flag: True})
    assert sorted(p.name for p in busy.iterdir()) == ["notes.txt"]
    # a bench's folder is deltafy's, yet no run: once said "deltafy did not write" it
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text("{}")
    (bench / "runs").mkdir()
    for flag, verb in (("resume", "continue"), ("overwrite", "replace")):
        with pytest.raises(
            DeltafyError,
            match=f"holds a deltafy bench \\(bench.json\\), not a model or a training run for --{flag} to {verb}",
        ):
            run_training(str(tiny.delta), [str(tiny.train_txt)], bench, opts(), show_progress=False, **{flag: True})
    with pytest.raises(DeltafyError, match="holds a deltafy bench"):
        deltafy.save(deltafy.load(tiny.delta), bench, overwrite=True)
    assert sorted(p.name for p in bench.iterdir()) == ["bench.json", "runs"]


# -- LoRA and full training -------------------------------------------------------------------


def test_heads_and_lora_merged(tiny, tmp_path):
    out = tmp_path / "run"
    train(tiny, out, steps=2, train="heads+lora")
    before, after = read_tensors(tiny.delta), read_tensors(out)
    assert not [k for k in after if "lora_" in k or "base_layer" in k]
    assert not (out / "lora-adapter").exists()
    changed = changed_keys(before, after)
    lora_targets = {k for k in before if k.endswith(("q_proj.weight", "v_proj.weight"))}  # peft's llama defaults
    assert len(lora_targets) == 4
    assert changed - {k for k in before if is_head(k)} == lora_targets  # the LoRA update merged in
    model = deltafy.load(out)
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_a_bf16_model_is_written_in_bf16_unless_pretrained_weights_trained(tiny, tmp_path):
    # a bf16 input was written back in float32: twice its size on disk and when served, for heads of a few KB
    from deltafy.conversion.job import convert_source

    delta = tmp_path / "delta-bf16"
    convert_source(str(tiny.stock), delta, dtype="bfloat16")
    before = read_tensors(delta)
    heads_run = run_training(
        str(delta), [str(tiny.train_txt)], tmp_path / "heads", opts(steps=2), eval_data=[str(tiny.held_txt)],
        show_progress=False,
    )  # fmt: skip
    after = read_tensors(tmp_path / "heads")
    assert json.loads((tmp_path / "heads" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    changed = changed_keys(before, after)
    assert changed and all(is_head(k) for k in changed)  # the frozen weights exactly as they were
    # the loss reported is the written model's (its heads rounded to bf16), computed in fp32 as training does
    model = deltafy.load(tmp_path / "heads", dtype=torch.float32)
    loss = evaluate_text(model, tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert loss == pytest.approx(heads_run.loss_after, abs=1e-6)
    # a merged LoRA changed pretrained weights by steps bf16 would round away: float32
    run_training(
        str(delta), [str(tiny.train_txt)], tmp_path / "lora", opts(steps=2, train="heads+lora"),
        eval_data=[str(tiny.held_txt)], show_progress=False,
    )  # fmt: skip
    assert json.loads((tmp_path / "lora" / "config.json").read_text())["dtype"] == "float32"
    assert {t.dtype for t in read_tensors(tmp_path / "lora").values()} == {torch.float32}


def test_a_bf16_run_holds_the_frozen_base_in_bf16_and_trains_float32_heads(tiny, tmp_path):
    # a run under bf16 autocast (a GPU's default) held a bf16 base in float32: twice the memory of what does not
    # train (a 7B: 28 GB, not 14), to run matmuls that autocast casts back to bf16
    from deltafy.conversion.job import convert_source

    delta = tmp_path / "delta-bf16"
    convert_source(str(tiny.stock), delta, dtype="bfloat16")
    before = read_tensors(delta)
    options = opts(steps=2, save_every=1, precision="bf16")
    run = run_training(str(delta), [str(tiny.train_txt)], tmp_path / "heads", options, [str(tiny.held_txt)], False)

    def held_out(model) -> float:  # measured as the run measures: its blocks, in its batches
        return evaluate_text(model, tiny.tokenizer, [str(tiny.held_txt)], seq_len=64, batch_size=4).loss

    # the loss before training is the bf16 model's (what `deltafy eval` measures), not a float32 copy's
    assert run.loss_before == pytest.approx(held_out(deltafy.load(delta)), abs=1e-6)
    assert abs(run.loss_before - held_out(deltafy.load(delta, dtype=torch.float32))) > 1e-5  # (they differ)
    # the heads trained in float32 (the run's checkpoints hold them so), and were written in bf16
    checkpoint = read_tensors(tmp_path / "heads" / "training" / "checkpoint-2")
    assert {t.dtype for t in checkpoint.values()} == {torch.float32}
    after = read_tensors(tmp_path / "heads")
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    changed = changed_keys(before, after)
    assert changed and all(is_head(k) for k in changed)
    assert run.loss_after == pytest.approx(held_out(deltafy.load(tmp_path / "heads")), abs=1e-6)
    # a run that trains pretrained weights in place holds them in float32 (bf16 would round its steps away)
    norms = run_training(
        str(delta), [str(tiny.train_txt)], tmp_path / "norms", opts(steps=1, precision="bf16", train="ln-tuning"),
        [str(tiny.held_txt)], False,
    )  # fmt: skip
    assert norms.loss_before == pytest.approx(held_out(deltafy.load(delta, dtype=torch.float32)), abs=1e-6)


def test_heads_and_lora_with_the_adapter_kept(tiny, tmp_path):
    from peft import PeftModel

    out = tmp_path / "run"
    result = train(tiny, out, steps=2, train="heads+lora", merge_lora=False)
    before, after = read_tensors(tiny.delta), read_tensors(out)
    assert before.keys() == after.keys()  # the base checkpoint holds no LoRA tensors
    changed = changed_keys(before, after)
    assert changed and all(is_head(k) for k in changed)  # heads trained, base weights untouched
    adapter = out / "lora-adapter"
    assert (adapter / "adapter_config.json").is_file()
    lora = read_tensors(adapter)
    assert lora and all("lora_" in k for k in lora)
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in lora.items())  # it trained
    heads = sum(v.numel() for k, v in before.items() if is_head(k))
    assert result.trainable_params == heads + sum(v.numel() for v in lora.values())
    # Every weights file has the mode of the run's other new files (safetensors alone writes 0600).
    weights = sorted(out.rglob("*.safetensors"))
    assert {p.relative_to(out).parts[0] for p in weights} == {"model.safetensors", "lora-adapter", "training"}
    config = (out / "config.json").stat().st_mode & 0o777
    assert {p.stat().st_mode & 0o777 for p in weights} == {file_mode()} == {config}

    # base + adapter is the trained model: its held-out loss is the one the run reported, loaded by deltafy
    # (as eval and inspect load it; they once left the adapter out) or with peft
    for model in (deltafy.load(out), PeftModel.from_pretrained(deltafy.load(out, adapter=False), str(adapter))):
        loss = evaluate_text(model.eval(), tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
        assert loss == pytest.approx(result.loss_after, abs=1e-5)
    without = evaluate_text(deltafy.load(out, adapter=False), tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert abs(without - result.loss_after) > 1e-4  # (the adapter is part of what was measured)
    # the card loads it; no file of the adapter names this machine's paths (peft wrote the model's path twice)
    card = (out / "README.md").read_text()
    assert 'model.load_adapter(repo, adapter_kwargs={"subfolder": "lora-adapter"})' in card
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    shown = run_cli("inspect", out, cwd=tmp_path)
    assert shown.returncode == 0 and "with the LoRA adapter it kept in lora-adapter/" in shown.stdout, shown.stderr
    # a model carrying it is not saved again as if it were whole (save_pretrained would write the adapter alone)
    with pytest.raises(DeltafyError, match="carries a LoRA adapter beside its weights.*adapter=False"):
        deltafy.save(deltafy.load(out), tmp_path / "again")
    assert not (tmp_path / "again").exists()
    # training on from the folder leaves the adapter out, and says so
    notices = []
    run_training(
        str(out), [str(tiny.train_txt)], tmp_path / "next", opts(steps=1), eval_data=[str(tiny.held_txt)],
        show_progress=False, notice=notices.append,
    )  # fmt: skip
    assert notices == [
        f"{out} keeps a LoRA adapter apart (lora-adapter/), which this run leaves out: it trains the model without "
        f"it; to train that run further, rerun it with --resume and a larger --steps"
    ]


@pytest.mark.parametrize("mode", ["lora", "base", "all"])
def test_lora_only_and_all_parameters(tiny, tmp_path, mode):
    out = tmp_path / "run"
    result = train(tiny, out, steps=2, train=mode)
    assert result.steps == 2 and math.isfinite(result.loss_after)
    before, after = read_tensors(tiny.delta), read_tensors(out)
    changed = changed_keys(before, after)
    if mode == "lora":
        assert changed == {k for k in before if k.endswith(("q_proj.weight", "v_proj.weight"))}
    elif mode == "base":  # the original trained in full: every pretrained tensor, no head
        assert changed == {k for k in before if not is_head(k)}
        assert result.trainable_params == sum(v.numel() for k, v in before.items() if not is_head(k))
    else:
        base = {k for k in before if not is_head(k)}
        assert base <= changed  # every pretrained tensor trained
        assert result.trainable_params == sum(v.numel() for v in before.values())
    deltafy.load(out)


def test_train_all_leaves_nothing_frozen_and_gives_the_heads_their_own_rates(tiny):
    from deltafy.options import options_from
    from deltafy.training.trainable import select_trainable

    model = deltafy.load(tiny.delta)
    options = options_from(None, train="all", lr=1e-3, lora_lr=2e-5)
    model, groups = select_trainable(model, "all", options)
    assert all(p.requires_grad for p in model.parameters())
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"gate", "heads", "base"} and by_name["base"]["lr"] == 2e-5
    assert by_name["heads"]["lr"] == 1e-3 and by_name["gate"]["lr"] > 1e-3
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # each parameter in one group


def test_ia3_trains_peft_s_scales_and_merges_them(tiny, tmp_path):
    """(IA)^3 at its natural count: one scale per output of k_proj and v_proj, per input of down_proj
    (peft's llama defaults), merged into those weights on save."""
    out = tmp_path / "run"
    result = train(tiny, out, steps=2, train="ia3", lora_lr=1e-2)
    before, after = read_tensors(tiny.delta), read_tensors(out)
    assert before.keys() == after.keys() and not (out / "lora-adapter").exists()
    targets = {k for k in before if k.endswith(("k_proj.weight", "v_proj.weight", "down_proj.weight"))}
    assert changed_keys(before, after) == targets  # nothing else moved, the heads neither
    natural = sum(before[k].shape[0] for k in targets if "down_proj" not in k)
    natural += sum(before[k].shape[1] for k in targets if "down_proj" in k)
    assert result.trainable_params == natural
    loss = evaluate_text(deltafy.load(out), tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert loss == pytest.approx(result.loss_after, abs=1e-5)


def test_ln_tuning_trains_the_norms_in_place(tiny, tmp_path):
    out = tmp_path / "run"
    result = train(tiny, out, steps=2, train="ln-tuning", lora_lr=1e-2)
    before, after = read_tensors(tiny.delta), read_tensors(out)
    norms = {k for k in before if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))}
    norms.add("model.norm.weight")  # peft's llama targets, the final norm included
    assert changed_keys(before, after) == norms
    assert result.trainable_params == sum(before[k].numel() for k in norms)
    loss = evaluate_text(deltafy.load(out), tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert loss == pytest.approx(result.loss_after, abs=1e-5)


def test_dora_adds_a_magnitude_per_output_and_merges(tiny, tmp_path):
    plain, dora = tmp_path / "lora", tmp_path / "dora"
    lora = train(tiny, plain, steps=2, train="lora", lora_r=2)
    result = train(tiny, dora, steps=2, train="lora", lora_r=2, lora_dora=True)
    before = read_tensors(tiny.delta)
    targets = [k for k in before if k.endswith(("q_proj.weight", "v_proj.weight"))]
    assert result.trainable_params == lora.trainable_params + sum(before[k].shape[0] for k in targets)
    after = read_tensors(dora)
    assert not [k for k in after if "lora_" in k] and changed_keys(before, after) == set(targets)
    assert any(not torch.equal(read_tensors(plain)[k], after[k]) for k in targets)  # DoRA is not LoRA
    loss = evaluate_text(deltafy.load(dora), tiny.tokenizer, [str(tiny.held_txt)], seq_len=64).loss
    assert loss == pytest.approx(result.loss_after, abs=1e-5)


@pytest.mark.parametrize("case", ["opt-pre-ln", "opt-post-ln"])
def test_lora_on_a_module_a_site_wraps_is_refused(case):
    """OPT's fc2 is a residual write: peft would add LoRA's update after the correction saw h."""
    from helpers.models import tiny_model

    from deltafy.training.trainable import select_trainable

    model = deltafy.convert(tiny_model(case))
    with pytest.raises(DeltafyError, match="'fc2' would bypass the DDL correction of the 'mlp' site") as err:
        select_trainable(model, "heads+lora", opts(lora_targets=["q_proj", "fc2"]))
    assert "q_proj,v_proj" in str(err.value)  # points at peft's defaults for the family
    assert not any("lora_" in name for name, _ in model.named_parameters())  # refused before wrapping
    # fc1 reads the stream in post-LN OPT, but as its input: LoRA there changes nothing deltafy reads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped, _ = select_trainable(model, "heads+lora", opts(lora_targets=["q_proj", "fc1"]))
    assert any("fc1.lora_A" in name for name, _ in wrapped.named_parameters())
    # peft reading transformers' deprecated is_gradient_checkpointing is nothing a user can act on
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


# -- failures ----------------------------------------------------------------------------------


def test_nan_loss_stops_with_an_error_and_keeps_the_earlier_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    # Adam moves each head weight by about lr per step: a target weight of 1e30 overflows the
    # residual stream at step 2, so the loss of step 2 is NaN.
    with pytest.raises(DeltafyError, match="NaN") as err:
        train(tiny, out, steps=4, save_every=1, lr=1e30)
    message = str(err.value)
    assert "\n" not in message and "step 2" in message and str(out / "training" / "checkpoint-1") in message
    assert sorted(p.name for p in (out / "training").glob("checkpoint-*")) == ["checkpoint-1"]
    assert (out / "training" / "checkpoint-1" / "deltafy_heads.safetensors").is_file()
    assert not (out / "config.json").exists()  # no final model was written
    assert [r["step"] for r in step_records(read_metrics(out))] == [1]
    # Without a checkpoint from before, the message points to none.
    with pytest.raises(DeltafyError, match="no checkpoint was saved before it"):
        train(tiny, tmp_path / "unsaved", steps=4, save_every=100, lr=1e30)


# -- options -------------------------------------------------------------------------------------


def test_options_merge_recipe_and_flags():
    options = options_from({"steps": 5}, lr=None, seq_len=32)
    assert (options.steps, options.seq_len, options.lr) == (5, 32, TrainOptions().lr)
    options = options_from({"steps": 5, "lr": 0.01, "train": "all"}, steps=7, train=None)
    assert (options.steps, options.lr, options.train) == (7, 0.01, "all")
    assert options_from(None).steps is None
    # Booleans are three-way too: False from a flag (--keep-adapter) beats the recipe, None keeps it.
    recipe = {"merge_lora": True, "gradient_checkpointing": True}
    options = options_from(recipe, merge_lora=False, gradient_checkpointing=None)
    assert (options.merge_lora, options.gradient_checkpointing) == (False, True)
    # Every field can come from flags, as the CLI passes them (one keyword per TrainingDefaults field).
    every = {name: None for name in TrainOptions.model_fields}
    assert options_from({"seq_len": 32}, **every) == TrainOptions(seq_len=32)


@pytest.mark.parametrize(
    "recipe, flags, name",
    [
        ({"steps": 0}, {}, "training.steps"),
        (None, {"lr": -1.0}, "--lr"),
        (None, {"train": "everything"}, "--train"),
        ({"stepz": 3}, {}, "training.stepz"),
        (None, {"held_out": 1.0}, "--held-out"),
        (None, {"warmup": 0.9}, "--warmup"),
        (None, {"schedule": "exponential"}, "--schedule"),
        ({"seq_len": "long"}, {}, "training.seq_len"),
        ({"seq_len": 0}, {"seq_len": 16, "lora_targets": [1]}, "--lora-targets"),  # the flag's value counts
    ],
)
def test_bad_options_are_one_line_errors(recipe, flags, name):
    # Named where the user can fix it: the flag they passed, or the key in the recipe's section.
    with pytest.raises(DeltafyError) as err:
        options_from(recipe, **flags)
    message = str(err.value)
    assert message.startswith(f"invalid training options: {name}")
    assert message.count(": ") == 2 and "\n" not in message, message  # that one problem, on one line
    assert isinstance(err.value.__cause__, ValidationError)  # --debug shows pydantic's full report


def test_every_bad_option_is_reported_at_once():
    with pytest.raises(DeltafyError) as err:
        options_from({"stepz": 3, "batch_size": 0}, lr=-1.0, warmup=2.0, train="everything", steps=None)
    message = str(err.value)
    assert "\n" not in message
    for where in ("--lr:", "--warmup:", "--train:", "training.stepz: unknown key", "training.batch_size:"):
        assert where in message, f"{where!r} not in {message!r}"
    assert "steps" not in message.replace("stepz", "")  # an unset flag is no error


def test_planned_steps():
    assert planned_steps(options_from(None, steps=9, tokens=10**6), 1) == 9
    assert planned_steps(options_from(None, tokens=1000, seq_len=10, batch_size=3, grad_accum=2), 2) == 9  # 1000/120
    assert planned_steps(options_from({"tokens": 1000, "seq_len": 10}, batch_size=3, grad_accum=2), 2) == 9
    assert planned_steps(options_from({"steps": 4}, steps=None), 1) == 4  # an unset flag keeps the recipe's
    # a budget in tokens given as a flag replaces a recipe's (or a trained folder's) steps, and is what is recorded
    given = options_from({"steps": 3, "seq_len": 32}, tokens=640, batch_size=2)
    assert planned_steps(given, 1) == 10 and given.steps is None and given.tokens == 640
    assert planned_steps(options_from(None), 1) == 200


def test_cli_honors_the_training_section_of_a_recipe(tiny, tmp_path):
    recipe = tmp_path / "short.yaml"
    recipe.write_text(
        "name: short\nsites: [attn, mlp]\n"
        "training:\n  steps: 2\n  seq_len: 32\n  batch_size: 2\n  save_every: 1\n  lr: 0.05\n"
    )
    # Held-out text of one 32-token block: too short for the default --seq-len 256, so the run
    # only gets through evaluation if the recipe's seq_len is used.
    held = tmp_path / "held.txt"
    held.write_text(tiny.held_txt.read_text()[:110])
    assert 32 <= len(token_stream([str(held)], tiny.tokenizer, use_cache=False)) < 64
    out = tmp_path / "run"
    held_too = tmp_path / "held-too.txt"  # a second path after --eval-data, as a shell glob gives it
    held_too.write_text(held.read_text())
    proc = run_cli(
        "train", tiny.delta, "--data", tiny.train_txt, "--eval-data", held, held_too, "--out", out,
        "--recipe", recipe, "--save-every", "2",  # a flag beats the recipe
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "after 2 steps" in proc.stdout
    # deltafy's lines only: no library's start-up warning (DeepSpeed's "Setting accelerator to CPU",
    # imported by the Trainer) and no third-party progress bar
    assert [line.split(" ", 1)[0] for line in proc.stdout.splitlines()] == ["held-out", "mean", "wrote"], proc.stdout
    # the line says what the betas were measured on: the held-out blocks, at the recipe's length
    held_blocks = len(pack(token_stream([str(held), str(held_too)], tiny.tokenizer, use_cache=False), 32))
    on = f"on the first {min(held_blocks, 4)} held-out blocks of 32 tokens"
    assert f"mean α·β per layer (its sites averaged) {on}: " in proc.stdout
    assert all(line.startswith("train: ") for line in proc.stderr.splitlines()), proc.stderr
    record = json.loads((out / "training" / "run.json").read_text())
    assert record["eval_sources"] == [str(held), str(held_too)] and record["data_sources"] == [str(tiny.train_txt)]
    steps = step_records(read_metrics(out))
    assert [r["step"] for r in steps] == [1, 2]
    # One step is batch_size blocks of seq_len tokens: an epoch is ceil(32-token blocks / 2) steps.
    blocks = len(token_stream([str(tiny.train_txt)], tiny.tokenizer, use_cache=False)) // 32
    assert steps[0]["epoch"] == pytest.approx(1 / math.ceil(blocks / 2))
    assert sorted(p.name for p in (out / "training").glob("checkpoint-*")) == ["checkpoint-2"]
    deltafy.load(out)


# -- distributed -------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_torchrun_two_processes(tiny, tmp_path, compiled):
    out = tmp_path / "ddp"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "deltafy", "train", str(tiny.delta), "--data", str(tiny.train_txt),
        "--eval-data", str(tiny.held_txt), "--out", str(out),
        "--steps", "4", "--seq-len", "64", "--batch-size", "2", "--save-every", "2", "--lr", str(HEAD_LR),
        *["--compile"] * compiled,
    ]  # fmt: skip
    proc = subprocess.run(
        command,
        cwd=tmp_path,
        env=subprocess_env({"CUDA_VISIBLE_DEVICES": ""}),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("wrote ") == 1  # only rank 0 evaluates, saves and reports
    assert "will be ignored" not in proc.stderr  # torch.compile's note on DDP's profiler ranges, from every rank
    # a compiled run says what its (long) first step does, once: rank 0 reports
    assert proc.stderr.count("compiling the first step (torch.compile)") == compiled
    # and leaves that step out of its s/step, giving it apart (a mean over minutes of compiling says nothing)
    first = r" \(the first, compiling: \d+\.\d s\)" if compiled else ""
    assert re.search(rf"after 4 steps, \d+\.\d\d s/step{first}, [\d,]+ trained", proc.stdout), proc.stdout
    assert len(list(out.glob("*.safetensors"))) == 1
    assert sorted(p.name for p in (out / "training").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert {p.name for p in (out / "training" / "checkpoint-4").glob("rng_state_*")} == {
        "rng_state_0.pth",
        "rng_state_1.pth",
    }  # both ranks trained
    records = read_metrics(out)
    steps = step_records(records)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]  # written once, not once per rank
    assert [r.get("event") for r in records].count("summary") == 1

    # Two ranks x 2 blocks with averaged gradients is one process with batches of 4 blocks.
    single = tmp_path / "single"
    train(tiny, single, steps=4, batch_size=4, save_every=2)
    expected = [r["loss"] for r in step_records(read_metrics(single))]
    assert [r["loss"] for r in steps] == pytest.approx(expected, abs=1e-5)
    ddp, one, start = read_tensors(out), read_tensors(single), read_tensors(tiny.delta)
    heads = [k for k in ddp if is_head(k)]
    assert changed_keys({k: start[k] for k in heads}, {k: ddp[k] for k in heads})
    assert not changed_keys({k: start[k] for k in ddp if not is_head(k)}, {k: ddp[k] for k in ddp if not is_head(k)})
    # Summation order differs (all-reduce), and the gates move by up to lr * gate_lr_scale = 0.5 a
    # step with Adam's tiny eps, which magnifies rounding: agreement to 1e-3 is 1/500 of a step.
    for key in heads:
        torch.testing.assert_close(ddp[key], one[key], atol=1e-3, rtol=0, msg=key)


# -- the plain-transformers example ------------------------------------------------------------


def run_example(example: Path, args: list, cwd: Path, without_deltafy: bool = False) -> str:
    """What ``python EXAMPLE ARGS`` prints, run as its docstring says (``without_deltafy``: where deltafy
    cannot be imported, as for someone with only torch and transformers)."""
    block = "sys.modules['deltafy'] = None; " * without_deltafy
    runner = (
        f"import sys; {block}import runpy; sys.argv = {[str(example), *map(str, args)]!r}; "
        f"runpy.run_path({str(example)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, *["-I"] * without_deltafy, "-c", runner],
        cwd=cwd,
        env=subprocess_env({"HF_MODULES_CACHE": str(cwd / "hf-modules")}),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_continue_pretraining_example_runs_without_deltafy(tiny, tmp_path):
    out = tmp_path / "continued"
    example = REPO / "examples" / "continue_pretraining.py"
    args = [tiny.delta, tiny.train_txt, out, "--steps", "3", "--seq-len", "64"]
    printed = run_example(example, args, tmp_path, without_deltafy=True)
    assert "To be, or not to be" in printed  # the prompt, continued by the reloaded model
    imported = {
        alias.name if isinstance(node, ast.Import) else node.module
        for node in ast.walk(ast.parse(example.read_text()))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert not any(name.split(".")[0] == "deltafy" for name in imported), imported
    before, after = read_tensors(tiny.delta), read_tensors(out)
    assert before.keys() == after.keys()
    base = {k for k in before if not is_head(k)}
    assert base <= changed_keys(before, after)  # every pretrained tensor trained
    reloaded = deltafy.load(out)  # still a deltafy checkpoint
    assert sum(1 for _ in deltafy.surgery.delta_sites(reloaded)) == 4


def test_the_convert_and_load_examples_run_as_their_docstrings_say(tiny, tmp_path):
    # examples/convert_in_python.py converts, checks and saves with deltafy; load_with_transformers.py
    # then generates from the folder where deltafy cannot be imported
    out = tmp_path / "converted"
    printed = run_example(REPO / "examples" / "convert_in_python.py", [tiny.stock, out], tmp_path)
    assert "max |Δlogits| 0.00e+00, greedy identical: True" in printed, printed
    assert f"saved to {out}; parameters added: " in printed
    assert deltafy.load(out).config.deltafy["recipe"]["name"] == "ddl-scalar"
    example = REPO / "examples" / "load_with_transformers.py"
    generated = run_example(example, [out, "To be, or not to be"], tmp_path, without_deltafy=True)
    assert generated.startswith("To be, or not to be") and len(generated) > len("To be, or not to be\n"), generated


def test_eval_every_logs_held_out_loss(tiny, tmp_path):
    out = tmp_path / "run"
    result = train(tiny, out, steps=4, eval_every=2)
    evals = [r for r in read_metrics(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(math.isfinite(r["eval_loss"]) for r in evals)
    # The Trainer's evaluation at the last step is the held-out loss deltafy reports at the end.
    assert evals[-1]["eval_loss"] == pytest.approx(result.loss_after, rel=1e-4)


def test_ctrl_c_saves_a_checkpoint_and_resume_finishes(tiny, tmp_path):
    """A real SIGINT to `deltafy train` mid-run: one-line message, resumable checkpoint, exit 1."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "deltafy",
        "train",
        str(tiny.delta),
        "--data",
        str(tiny.train_txt),
        "--eval-data",
        str(tiny.held_txt),
        "--out",
        str(out),
        "--steps",
        "400",
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--save-every",
        "1000",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr  # 128 + SIGINT, as a shell expects of a Ctrl-C
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "interrupted at step" in errors[0] and "--resume" in errors[0], stderr
    assert "Traceback" not in stderr
    checkpoints = list((out / "training").glob("checkpoint-*"))
    assert len(checkpoints) == 1
    assert not (out / "config.json").exists(), "an interrupted run must not look like a finished model"
    step = int(checkpoints[0].name.split("-")[1])
    assert 3 <= step < 400
    # The settings the CLI run used: a resume with others is refused (tests/training/test_runs.py).
    resumed = train(tiny, out, resume=True, steps=step + 2, save_every=1000, batch_size=2, lr=TrainOptions().lr)
    assert resumed.steps == step + 2
    assert (out / "config.json").is_file()


@pytest.mark.parametrize(
    "train_mode, needle",
    [
        ("ln-tuning", "cannot save train: ln-tuning, which changes the base weights"),
        ("base", "cannot save train: base, which changes the base weights"),
        ("all", "cannot save train: all, which changes the base weights"),
        ("ia3", "cannot save train: ia3 with its adapter merged into the base weights; pass --keep-adapter"),
        ("lora", "cannot save train: lora with its adapter merged into the base weights; pass --keep-adapter"),
    ],
)
def test_heads_only_refuses_what_changes_the_base(train_mode, needle):
    from deltafy.options import options_from
    from deltafy.training.launch import check_heads_only

    config = {"deltafy": {"base": {"id": "gpt2", "revision": "0" * 40}}}
    with pytest.raises(DeltafyError, match=needle):
        check_heads_only(config, options_from(None, train=train_mode), "delta")
    if train_mode in ("ia3", "lora"):  # the adapter kept apart: allowed
        check_heads_only(config, options_from(None, train=train_mode, merge_lora=False), "delta")
