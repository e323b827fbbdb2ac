"""Streaming conversion: the output's pretrained tensors are the source's shards (linked, copied or
cast a tensor at a time), the heads a shard of their own; it must load exactly as the in-memory
conversion of the same source does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import assert_one_line_error, cli
from helpers.models import DELTAFY_FREE_PREAMBLE, fixed_ids, run_deltafy_free, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import deltafy
from deltafy.conversion.job import convert_source
from deltafy.sources.folders import file_mode
from deltafy.sources.shards import INDEX_FILE, read_header, write_file

# Families whose files transformers reads under the names the model has in memory (streamed), in
# every layout: sequential pre-norm, tied embeddings, post-LN, parallel, a two-norm parallel one.
STREAMED = ["llama-untied", "llama-tied", "gpt2", "opt-post-ln", "phi", "falcon-new-2ln", "gemma"]

CHILD = (
    DELTAFY_FREE_PREAMBLE
    + r"""
import json
import torch
from transformers import AutoModelForCausalLM

jobs, result_file = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for key, path, ids in jobs:
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    with torch.no_grad():
        results[key] = model(input_ids=torch.tensor(ids)).logits
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"results": results, "deltafy_modules": loaded}, result_file)
"""
)


def both_ways(source: Path, root: Path, **kwargs) -> tuple[Path, Path]:
    """The streamed and the in-memory conversion of ``source``, from the same RNG state."""
    torch.manual_seed(0)
    streamed = convert_source(str(source), root / f"streamed-{source.name}", **kwargs)
    torch.manual_seed(0)
    in_memory = convert_source(str(source), root / f"in-memory-{source.name}", streaming=False, **kwargs)
    return streamed.out, in_memory.out


def state(folder: Path) -> dict[str, torch.Tensor]:
    return deltafy.load(folder).state_dict()


def assert_same_model(a: Path, b: Path) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every STREAMED family in bf16 (the dtype real checkpoints ship in), streamed and in memory,
    and the logits of both in one deltafy-free child."""
    root = tmp_path_factory.mktemp("stream")
    pairs, jobs = {}, []
    for case in STREAMED:
        source = root / case
        tiny_model(case).to(torch.bfloat16).save_pretrained(source)
        pairs[case] = both_ways(source, root)
        ids = fixed_ids(tiny_model(case)).tolist()
        streamed, in_memory = pairs[case]
        jobs += [(f"streamed-{case}", str(streamed), ids), (f"memory-{case}", str(in_memory), ids)]
    return root, pairs, run_deltafy_free(CHILD, [json.dumps(jobs)], root)["results"]


@pytest.mark.parametrize("case", STREAMED)
def test_streamed_output_is_the_source_shards_plus_a_heads_shard(converted, case):
    root, pairs, _ = converted
    streamed, _ = pairs[case]
    assert not (streamed / "model.safetensors").exists()  # transformers would read it alone
    index = json.loads((streamed / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    # the source's file itself (a hard link: no bytes copied), and only heads in the new shard
    assert os.stat(streamed / shards[0]).st_ino == os.stat(root / case / "model.safetensors").st_ino
    heads, _ = read_header(streamed / shards[1])
    assert heads and all(".delta." in k for k in heads)
    assert {k for k, f in index["weight_map"].items() if f == shards[1]} == set(heads)
    on_disk = sum((streamed / s).stat().st_size for s in shards)
    assert index["metadata"]["total_size"] <= on_disk


@pytest.mark.parametrize("case", STREAMED)
def test_streamed_loads_exactly_as_the_in_memory_conversion(converted, case):
    _, pairs, logits = converted
    assert_same_model(*pairs[case])
    assert torch.equal(logits[f"streamed-{case}"], logits[f"memory-{case}"])
    for name in ("config.json", "generation_config.json"):
        a, b = (json.loads((p / name).read_text()) for p in pairs[case])
        for config in (a, b):
            config.get("deltafy", {}).get("provenance", {}).pop("created", None)
        assert a == b, name


def test_sharded_source_and_a_learned_direction(tmp_path):
    source = tmp_path / "sharded"
    tiny_model("llama-untied").save_pretrained(source, max_shard_size="60KB")
    assert len(list(source.glob("model-*.safetensors"))) >= 3
    for shard in source.glob("model-*.safetensors"):
        shard.chmod(0o640)  # the user's own mode, which a linked shard shares and deltafy leaves alone
    streamed, in_memory = both_ways(source, tmp_path, recipe="ddl-learned")  # random heads, same seed
    assert_same_model(streamed, in_memory)
    *linked, heads = sorted(streamed.glob("model-*.safetensors"))
    sources = {os.stat(p).st_ino for p in source.glob("model-*.safetensors")}
    assert {os.stat(p).st_ino for p in linked} == sources
    assert {p.stat().st_mode & 0o777 for p in linked} == {0o640}
    assert heads.stat().st_mode & 0o777 == file_mode() == (streamed / "config.json").stat().st_mode & 0o777


def test_gpt2_files_without_the_base_prefix(tmp_path):
    # GPT-2's own checkpoints store h.0.attn... and the causal mask buffers that transformers ignores.
    source = tmp_path / "gpt2-hub-layout"
    tiny_model("gpt2").save_pretrained(source)
    weights = load_file(source / "model.safetensors")
    weights = {k.removeprefix("transformer."): v for k, v in weights.items()}
    weights["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    streamed, in_memory = both_ways(source, tmp_path)
    heads, _ = read_header(streamed / "model-00002-of-00002.safetensors")
    assert all(k.startswith("h.") for k in heads)  # named the way the files are
    assert_same_model(streamed, in_memory)


def test_dtype_casts_a_tensor_at_a_time(tmp_path):
    source = tmp_path / "fp32"
    tiny_model("llama-untied").save_pretrained(source)
    streamed, in_memory = both_ways(source, tmp_path, dtype="bfloat16")
    with safe_open(str(streamed / "model-00001-of-00002.safetensors"), "pt") as fh:
        assert {fh.get_slice(k).get_dtype() for k in fh.keys()} == {"BF16"}
    assert os.stat(streamed / "model-00001-of-00002.safetensors").st_nlink == 1  # written, not linked
    assert_same_model(streamed, in_memory)


def test_hf_cache_symlinks_are_resolved(tmp_path):
    # The HF cache's snapshot folders hold symlinks into blobs/: the output links the blob itself.
    stock = tmp_path / "stock"
    tiny_model("qwen2").save_pretrained(stock)
    snapshot, blobs = tmp_path / "models--x--y" / "snapshots" / ("a" * 40), tmp_path / "models--x--y" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in stock.iterdir():
        blob = blobs / f"blob-{file.name}"
        shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    out = convert_source(str(snapshot), tmp_path / "out").out
    shard = out / "model-00001-of-00002.safetensors"
    assert not shard.is_symlink() and os.stat(shard).st_ino == os.stat(blobs / "blob-model.safetensors").st_ino
    assert_same_model(out, convert_source(str(stock), tmp_path / "mem", streaming=False).out)


def test_another_filesystem_gets_a_copy(tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second filesystem to copy across")  # (/dev/shm is one on every Linux CI runner)
    source = tmp_path / "stock"
    tiny_model("llama-untied").save_pretrained(source)
    out = Path(shm) / f"deltafy-test-{os.getpid()}"
    try:
        convert_source(str(source), out)
        shard = out / "model-00001-of-00002.safetensors"
        assert os.stat(shard).st_nlink == 1
        assert shard.read_bytes() == (source / "model.safetensors").read_bytes()
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_moe_checkpoints_fall_back_to_the_in_memory_conversion(tmp_path):
    source = tmp_path / "mixtral"
    tiny_model("mixtral").save_pretrained(source)  # experts one by one: transformers fuses them on load
    notes = []
    out = convert_source(str(source), tmp_path / "out", status=notes.append).out
    assert any("loading the whole model" in n and "maps on load" in n for n in notes), notes
    assert (out / "model.safetensors").is_file() and not (out / INDEX_FILE).exists()
    with pytest.raises(deltafy.DeltafyError, match="cannot be converted by streaming: it stores tensors under"):
        convert_source(str(source), tmp_path / "refused", streaming=True)
    assert not (tmp_path / "refused").exists()


def test_heads_only_from_a_stream(tmp_path):
    source = tmp_path / "stock"
    tiny_model("llama-untied").save_pretrained(source)
    heads = convert_source(str(source), tmp_path / "heads", heads_only=True).out
    assert not list(heads.glob("model*.safetensors"))
    full = convert_source(str(source), tmp_path / "full").out
    assert_same_model(heads, full)


def test_failed_self_check_or_interrupt_writes_nothing(tmp_path):
    source = tmp_path / "stock"
    tiny_model("llama-untied").save_pretrained(source)
    with pytest.raises(deltafy.DeltafyError, match="self-check failed.*nothing was written"):
        # beta = 3e-8 is not the original exactly
        convert_source(str(source), tmp_path / "out", recipe="ddl-scalar-logit", tolerance=0.0)

    def interrupt(what, advance, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_source(str(source), tmp_path / "out", progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stock"]  # no partial folder either
    assert (source / "model.safetensors").stat().st_nlink == 1


def test_not_enough_disk_space_is_one_line_before_any_work(tmp_path, monkeypatch):
    import deltafy.conversion.stream as stream

    source = tmp_path / "stock"
    tiny_model("llama-untied").save_pretrained(source)
    real = shutil.disk_usage
    monkeypatch.setattr(stream.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(deltafy.DeltafyError, match=r"not enough disk space .* needs 1\.\d MB and .* has 1\.0 kB free"):
        convert_source(str(source), tmp_path / "out", dtype="bfloat16")  # a cast writes every byte anew
    assert not (tmp_path / "out").exists()


def test_writer_streams_what_safetensors_reads(tmp_path):
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "mask": torch.tensor([True, False, True]),
    }
    asked = []

    def tensor(key):
        asked.append(key)
        return tensors[key]

    layout = [(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    write_file(tmp_path / "x.safetensors", layout, tensor)
    assert asked == list(tensors)  # one at a time, in order
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    entries, metadata = read_header(tmp_path / "x.safetensors")
    assert metadata == {"format": "pt"} and entries["a"].shape == (3, 5)


def test_cli_streams_and_says_so(tmp_path):
    source = tmp_path / "stock"
    tiny_model("llama-untied").save_pretrained(source)
    proc = cli("convert", str(source), "--out", str(tmp_path / "out"), "--streaming", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "greedy generation not run" in proc.stdout and "hard-linked" in proc.stdout
    proc = cli("convert", str(tmp_path / "out"), "--out", str(tmp_path / "again"), "--streaming", cwd=tmp_path)
    assert_one_line_error(proc, "already a deltafy model")
