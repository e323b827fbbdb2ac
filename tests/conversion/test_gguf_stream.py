"""A GGUF file's dequantized HF-format copy, written a tensor at a time (deltafy.sources.gguf).

Checked against what transformers itself gives (``from_pretrained(gguf_file=)`` then
``save_pretrained``) on the bundled SmolLM2-135M GGUF: the same tensors to the bit, the same
config, generation config and tokenizer files, at a fraction of the memory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltafy.errors import DeltafyError
from deltafy.sources.load import load_source, resolve_alias
from deltafy.sources.provenance import sha256_file

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

# Each child reports its peak RSS in bytes after its imports and at the end: its own, not the one getrusage
# would report, which starts from this test process's peak (deltafy.bench.child.peak_rss_bytes).
# transformers imports its modeling code lazily, on the first load (about 190 MiB): each child imports
# what loading this Llama needs before it reads its base, so the base is a process ready to load and
# peak - base is what the load itself costs.
REFERENCE = r"""
import json, sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from deltafy.bench.child import peak_rss_bytes
from deltafy.sources.gguf import clear_quantizer
import gguf as _, transformers.modeling_utils, transformers.models.llama.modeling_llama
gguf, out = Path(sys.argv[1]), sys.argv[2]
base = peak_rss_bytes()
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
clear_quantizer(model)
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
print(json.dumps({"base": base, "peak": peak_rss_bytes()}))
"""

# deltafy's own GGUF load into a private DELTAFY_CACHE, stopped once the cache is complete (the
# reload from it is not what is measured), with GgufPlan.write wrapped to read the RSS around it.
STREAMED = r"""
import json, sys
import deltafy.sources.gguf, deltafy.sources.load
from deltafy.bench.child import peak_rss_bytes as rss
from deltafy.sources.shards import read_header
import gguf, transformers.modeling_utils, transformers.models.llama.modeling_llama
report = {"base": rss()}
write = deltafy.sources.gguf.GgufPlan.write
def measured(plan, folder, *args):
    report["planned"] = rss()
    write(plan, folder, *args)
    report["written"] = rss()
    entries, _ = read_header(folder / "model.safetensors")
    report["largest"] = max(e.nbytes for e in entries.values())
    report["nbytes"] = sum(e.nbytes for e in entries.values())
deltafy.sources.gguf.GgufPlan.write = measured
class Cached(Exception):
    pass
def reload(*args, **kwargs):
    raise Cached
deltafy.sources.load._load_pretrained = reload
try:
    deltafy.sources.load.load_source("smollm2-135m", "float32")
except Cached:
    print(json.dumps(report | {"peak": rss()}))
"""


def _children(*runs: tuple[str, list, dict]) -> list[dict]:
    """Run the scripts side by side (the reference takes as long as the streamed write) and read their reports."""
    started = [
        subprocess.Popen(
            [sys.executable, "-c", script, *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=os.environ | env,
        )
        for script, args, env in runs
    ]
    reports = []
    for child in started:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


@pytest.fixture(scope="module")
def smollm_gguf() -> Path:
    try:
        return resolve_alias("smollm2-135m")
    except DeltafyError as err:
        pytest.fail(f"{err} (see README set-up)")


@pytest.fixture(scope="module")
def both(smollm_gguf, tmp_path_factory):
    """transformers' whole-model copy and the streamed one, each written by a fresh process."""
    root = tmp_path_factory.mktemp("gguf-stream")
    reference, streamed = _children(
        (REFERENCE, [smollm_gguf, root / "reference"], {}),
        (STREAMED, [], {"DELTAFY_CACHE": str(root / "cache")}),
    )
    cached = root / "cache" / "gguf" / sha256_file(smollm_gguf)[:16]
    return root / "reference", cached, reference, streamed


def _assert_same_tensors(expected: Path, got: Path) -> None:
    with safe_open(expected, "pt") as want, safe_open(got, "pt") as have:
        assert sorted(want.keys()) == sorted(have.keys())
        for key in want.keys():
            a, b = want.get_tensor(key), have.get_tensor(key)
            assert a.dtype == b.dtype and a.shape == b.shape, key
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), key  # bitwise, NaN or not


def test_streamed_copy_has_transformers_tensors_to_the_bit(both):
    reference, streamed, _, _ = both
    assert sorted(p.name for p in streamed.glob("*.safetensors")) == ["model.safetensors"]
    _assert_same_tensors(reference / "model.safetensors", streamed / "model.safetensors")
    with safe_open(streamed / "model.safetensors", "pt") as have:
        assert "lm_head.weight" not in have.keys()  # tied to the embeddings, as save_pretrained leaves it


def test_streamed_config_matches_transformers(both):
    reference, streamed, _, _ = both
    for name in ("config.json", "generation_config.json"):
        assert json.loads((streamed / name).read_text()) == json.loads((reference / name).read_text()), name


def test_streamed_copy_needs_a_fraction_of_the_memory(both):
    _, _, reference, streamed = both
    mib = 2**20
    print(
        f"peak RSS: transformers {reference['peak'] / mib:.0f} MiB (after imports {reference['base'] / mib:.0f}); "
        f"streamed {streamed['peak'] / mib:.0f} MiB (after imports {streamed['base'] / mib:.0f}, after the plan "
        f"{streamed['planned'] / mib:.0f}); fp32 weights {streamed['nbytes'] / 2**20:.0f} MiB, largest tensor "
        f"{streamed['largest'] / 2**20:.0f} MiB"
    )
    # Writing adds at most a few copies of the largest tensor, never the model, and ends below
    # transformers' whole-model dequantization (whose own baseline varies with what it parsed first,
    # so only the peaks are compared).
    assert streamed["written"] - streamed["planned"] <= 3 * streamed["largest"]
    assert streamed["peak"] - streamed["base"] < streamed["nbytes"]
    assert streamed["peak"] < reference["peak"]


def test_the_cache_is_complete_and_loads(both, smollm_gguf, monkeypatch):
    reference, cached, _, _ = both
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no staging folder left behind
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (cached / name).read_bytes() == (reference / name).read_bytes(), name
    monkeypatch.setenv("DELTAFY_CACHE", str(cached.parent.parent))
    source = load_source("smollm2-135m", "float32")  # from the cache the streamed load wrote
    with safe_open(reference / "model.safetensors", "pt") as want:
        embed = want.get_tensor("model.embed_tokens.weight")
    assert torch.equal(source.model.get_input_embeddings().weight, embed)
    assert source.provenance["kind"] == "alias" and source.provenance["sha256"] == sha256_file(smollm_gguf)


def test_big_copies_are_sharded_like_save_pretrained(monkeypatch):
    import deltafy.sources.gguf as streamed

    monkeypatch.setattr(streamed, "SHARD_BYTES", 4 * 100)  # 100 fp32 values a shard
    tensors = [(None, "a", (60,)), (None, "b", (40,)), (None, "c", (150,)), (None, "d", (10,))]
    shards = streamed._shards(tensors, torch.float32)
    assert {name: [key for _, key, _ in group] for name, group in shards.items()} == {
        "model-00001-of-00003.safetensors": ["a", "b"],
        "model-00002-of-00003.safetensors": ["c"],  # bigger than a shard: on its own
        "model-00003-of-00003.safetensors": ["d"],
    }
    assert list(streamed._shards(tensors[:1], torch.float32)) == ["model.safetensors"]
