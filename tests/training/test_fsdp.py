"""Sharded training: `deltafy train --fsdp` under torchrun and an accelerate FSDP config, on 2 CPU
processes (gloo) with the shared tiny llama, compared with a single-process run.

A sharded run must train what an unsharded one trains (same losses, same heads), write one
complete model once (rank 0), and leave every pretrained tensor bitwise as it was.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from helpers.training import (
    REPO,
    deep_delta,
    interrupted_at,
    read_metrics,
    read_tensors,
    step_records,
    subprocess_env,
)

import deltafy
from deltafy.errors import DeltafyError
from deltafy.options import options_from
from deltafy.recipe import load_recipe
from deltafy.training.job import run_training

HEAD_LR = 0.05  # the heads move the loss within a few steps (as in test_train)
STEPS = 3

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("token_cache")]


def opts(**overrides):
    values = dict(steps=STEPS, seq_len=64, batch_size=4, lr=HEAD_LR, save_every=2)
    values.update(overrides)
    return options_from(load_recipe().training.model_dump(), **values)  # as `deltafy train` reads tiny.delta


def launch(launcher: list[str], tiny, out, *flags: str, model=None, env=None) -> subprocess.CompletedProcess:
    """`deltafy train` on 2 CPU processes: 2 blocks per rank per step, 4 in all (of tiny.delta, else ``model``)."""
    command = [
        *launcher, "-m", "deltafy", "train", str(model or tiny.delta), "--data", str(tiny.train_txt),
        "--eval-data", str(tiny.held_txt), "--out", str(out), "--steps", str(STEPS), "--seq-len", "64",
        "--batch-size", "2", "--save-every", "2", "--lr", str(HEAD_LR), *flags,
    ]  # fmt: skip
    return subprocess.run(
        command,
        cwd=out.parent,
        env=subprocess_env({"CUDA_VISIBLE_DEVICES": "", **(env or {})}),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=240,
    )


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory):
    """The reference: one process, batches of 4 blocks (the 2 ranks' global batch)."""
    out = tmp_path_factory.mktemp("single") / "run"
    run_training(str(tiny.delta), [str(tiny.train_txt)], out, opts(), [str(tiny.held_txt)], show_progress=False)
    return out


def check_sharded_run(proc, out, single, tiny, model=None) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone evaluates, saves and reports
    # FSDP's own optimizer checkpoint (save_fsdp_optimizer): the run was sharded, not DDP.
    assert (out / "training" / "checkpoint-2" / "optimizer.bin").is_file()
    assert not (out / "training" / "checkpoint-2" / "optimizer.pt").exists()

    steps = step_records(read_metrics(out))
    expected = [r["loss"] for r in step_records(read_metrics(single))]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # written once, not once per rank
    assert [r["loss"] for r in steps] == pytest.approx(expected, abs=1e-4)

    # One complete folder: one config, one set of weights, no leftovers of a half-written save.
    assert sorted(p.name for p in out.glob("config*.json")) == ["config.json"]
    weights = sorted(p.name for p in out.glob("*.safetensors"))
    assert weights == ["model.safetensors"] or "model.safetensors.index.json" in {p.name for p in out.iterdir()}
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "hidden leftovers in the output"

    check_heads_trained_base_unchanged(out, single, tiny, model)


def check_heads_trained_base_unchanged(out, single, tiny, model=None) -> tuple[list[str], dict]:
    """The heads trained as in the one-process run; every pretrained tensor is bitwise the input's (tiny.delta,
    else ``model``). Returns the heads' names and the input's tensors."""
    saved, start, one = read_tensors(out), read_tensors(model or tiny.delta), read_tensors(single)
    assert saved.keys() == start.keys()
    heads = [k for k in saved if ".delta." in k]
    assert any(not torch.equal(saved[k], start[k]) for k in heads), "the heads did not train"
    for key in saved.keys() - set(heads):
        assert torch.equal(saved[key], start[key]), f"pretrained tensor {key} changed"
    for key in heads:  # all-reduce vs local sums: rounding, magnified by the gate's lr (see test_train)
        torch.testing.assert_close(saved[key], one[key], atol=1e-3, rtol=0, msg=key)
    return heads, start


def test_torchrun_fsdp_matches_one_process(tiny, tmp_path, single):
    out = tmp_path / "fsdp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = launch(torchrun, tiny, out, "--fsdp")
    check_sharded_run(proc, out, single, tiny)
    check_loads_both_ways(out)


def test_fsdp_compiled_matches_one_process_and_resumes_exactly(tiny, tmp_path, single):
    """--compile over FSDP: each decoder layer compiled in place, then sharded; the checkpoints and output
    carry the model's own names; resumed after step 2, bitwise."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    out = tmp_path / "fsdp"
    check_sharded_run(launch(torchrun, tiny, out, "--fsdp", "--compile"), out, single, tiny)
    resumed = interrupted_at(out, 2, tmp_path / "resumed")
    proc = launch(torchrun, tiny, resumed, "--fsdp", "--compile", "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = read_tensors(out), read_tensors(resumed)
    for key, value in a.items():
        assert b[key].equal(value), key


def test_fsdp_compiled_compiles_every_layer_of_a_deep_model(tiny, tmp_path):
    """Under FSDP each decoder layer's forward is a frame dynamo compiles (regional compilation; FSDP's hooks
    break the graph there too). The graph of the first layer serves the others (nothing a site does names
    its layer); when it guarded
    each site call's identity, every layer was compiled again, and past torch's limit of 8 graphs a frame
    the other layers of this 12-layer model trained eagerly, silently."""
    delta = deep_delta(tiny.tokenizer, tmp_path, 12)
    out = tmp_path / "fsdp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {"TORCH_LOGS": "recompiles"}  # (deltafy's command line leaves a user's TORCH_LOGS as it is)
    proc = launch(torchrun, tiny, out, "--fsdp", "--compile", model=delta, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Recompiling function" in proc.stderr  # (logged: evaluation recompiles without grad)
    assert "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
    assert "check_obj_id" not in proc.stderr  # no graph failed on an object's identity: none was per layer


def check_loads_both_ways(out) -> None:
    """deltafy.load and plain transformers (the folder's own code) give the same logits."""
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 17, 42, 99, 3]])
    ours = deltafy.load(out, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, plain(ids).logits)


def test_fsdp_in_bf16_shards_a_bf16_base_with_float32_heads(tiny, tmp_path):
    """Under bf16 a bf16 input's frozen weights stay bf16 and what trains is float32: each FSDP unit mixes
    the two, which FSDP2 gathers (it asks only that what trains share one dtype)."""
    from deltafy.conversion.job import convert_source

    delta = tmp_path / "delta-bf16"
    convert_source(str(tiny.stock), delta, dtype="bfloat16")
    single = tmp_path / "single"
    run_training(str(delta), [str(tiny.train_txt)], single, opts(precision="bf16"), [str(tiny.held_txt)], False)
    out = tmp_path / "fsdp"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = launch(torchrun, tiny, out, "--fsdp", "--precision", "bf16", model=delta)
    check_sharded_run(proc, out, single, tiny, delta)
    assert {t.dtype for t in read_tensors(out).values()} == {torch.bfloat16}
    trained = read_tensors(out / "training" / "checkpoint-2")  # (the heads as the run held them)
    assert trained and {t.dtype for t in trained.values()} == {torch.float32}


def test_accelerate_fsdp_config_matches_one_process(tiny, tmp_path, single):
    out = tmp_path / "accelerate"
    with socket.socket() as probe:  # a free port: another job on the machine may hold accelerate's default
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    accelerate = [
        sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port),
        "--config_file", str(REPO / "examples" / "accelerate_fsdp.yaml"), "--num_processes", "2",
    ]  # fmt: skip
    check_sharded_run(launch(accelerate, tiny, out), out, single, tiny)


def test_fsdp_needs_a_distributed_launch(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    out = tmp_path / "plain"
    with pytest.raises(DeltafyError, match=r"torchrun --nproc_per_node N -m deltafy train \.\.\. --fsdp"):
        run_training(str(tiny.delta), [str(tiny.train_txt)], out, opts(fsdp=True), show_progress=False)
    assert not out.exists()  # refused before anything was written


def test_fsdp_is_a_flag_not_a_recipe_setting(tiny):
    from deltafy.recipe import Recipe

    assert opts(fsdp=True).fsdp
    with pytest.raises(Exception, match="fsdp"):
        Recipe.model_validate({"name": "x", "training": {"fsdp": True}})


# -- device_map offload ---------------------------------------------------------------------------


def two_head_steps(model, ids):
    """Two AdamW steps of the heads alone; the losses and the trained heads."""
    from deltafy.training.trainable import select_trainable

    model, groups = select_trainable(model, "heads", opts())
    optimizer = torch.optim.AdamW([{k: v for k, v in g.items() if k != "name"} for g in groups])
    losses = []
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        # (the strength alpha's at once; the other heads' once alpha has moved: they are scaled by it)
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for g in groups for p in g["params"])
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_offloaded_base_trains_the_heads_like_a_resident_one(tiny, tmp_path):
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    resident = two_head_steps(deltafy.load(tiny.delta, dtype=torch.float32), ids)
    # Layer 1's pretrained weights live on disk (accelerate loads them for each forward); its DDL
    # heads stay in memory, where the optimizer can update them.
    on_disk = ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1.delta": "cpu"}
    device_map |= {f"model.layers.1.{name}": "disk" for name in on_disk}
    device_map |= {"model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = deltafy.load(tiny.delta, dtype=torch.float32, device_map=device_map, offload_folder=str(tmp_path))
    assert model.get_submodule("model.layers.1.mlp.up_proj").weight.device.type == "meta"  # really offloaded
    offloaded = two_head_steps(model, ids)
    assert offloaded[0] == pytest.approx(resident[0], abs=1e-5)
    assert offloaded[1].keys() == resident[1].keys()
    for key, value in resident[1].items():
        torch.testing.assert_close(offloaded[1][key], value, atol=1e-5, rtol=0, msg=key)


def test_auto_device_map_keeps_the_heads_resident(tiny, tmp_path):
    # accelerate's "auto" map offloads whole decoder layers when memory runs short; deltafy.load keeps
    # each layer's DDL heads where the model runs, so they train as in a resident model.
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    resident = two_head_steps(deltafy.load(tiny.delta, dtype=torch.float32), ids)
    model = deltafy.load(
        tiny.delta, dtype=torch.float32, device_map="auto", max_memory={"cpu": "300KB"}, offload_folder=str(tmp_path)
    )
    offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    assert any(".layers." in n and ".delta." not in n for n in offloaded), "the memory cap must offload layers"
    assert not [n for n in offloaded if ".delta." in n]
    losses, heads = two_head_steps(model, ids)
    assert losses == pytest.approx(resident[0], abs=1e-5)
    for key, value in resident[1].items():
        torch.testing.assert_close(heads[key], value, atol=1e-5, rtol=0, msg=key)
