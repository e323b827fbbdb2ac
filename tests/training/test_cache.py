"""``deltafy cache info|clear`` in real subprocesses, over a cache filled by real runs of the library."""

from __future__ import annotations

import json
import os

import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.training import shared_tokenizer

from deltafy.data import token_stream

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow


@pytest.fixture
def filled(tmp_path, monkeypatch):
    """A cache with two token streams, one from an older deltafy, a GGUF copy and 0.1's kernels."""
    import datasets

    root = tmp_path / "cache [v1]"
    monkeypatch.setenv("DELTAFY_CACHE", str(root))
    notes = tmp_path / "notes [draft].txt"
    notes.write_text("Shall I compare thee to a summer's day?")
    datasets.Dataset.from_dict({"text": ["alpha", "beta"]}).save_to_disk(str(tmp_path / "ds"))
    token_stream([str(notes), str(tmp_path / "ds")], shared_tokenizer())
    (root / "tokens" / "0123456789abcdef01234567.pt").write_bytes(b"x" * 100)  # no sidecar: an older deltafy's
    (root / "gguf" / "9f86d081884c7d65").mkdir(parents=True)
    (root / "gguf" / "9f86d081884c7d65" / "model.safetensors").write_bytes(b"\0" * 3000)
    (root / "kernels").mkdir()
    (root / "kernels" / "delta_decode.so").write_bytes(b"\0" * 10)
    (root / "mine.txt").write_text("not deltafy's")  # DELTAFY_CACHE may hold other things
    return root, notes, tmp_path / "ds"


def test_cache_info_shows_every_kind_and_what_each_token_stream_came_from(tmp_path, filled):
    root, notes, ds = filled
    env = {"DELTAFY_CACHE": str(root)}
    proc = cli("cache", "info", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"cache folder: {root} (set by DELTAFY_CACHE)"  # brackets shown, not read as markup
    summary = {line.split("  ")[1].strip(): line for line in lines[1:4]}
    assert "3 entries" in summary["token streams"]
    gguf, kernels = summary["dequantized GGUF weights"], summary["compiled kernels (deltafy 0.1)"]
    assert "1 entry" in gguf and "3.0 kB" in gguf
    assert "1 entry" in kernels and "10 B" in kernels
    listed = "\n".join(lines[4:])
    assert f"  {notes} · text, 39 B → " in listed
    assert f"  {ds} · datasets field text, " in listed
    assert "0123456789abcdef01234567 (made by an older deltafy; no record of its source)" in listed

    data = json.loads(cli("cache", "info", "--json", cwd=tmp_path, env=env).stdout)
    assert {k: v["entries"] for k, v in data["kinds"].items()} == {"tokens": 3, "gguf": 1, "kernels": 1}
    assert data["kinds"]["kernels"]["bytes"] == 10
    sources = sorted(e.get("source", "") for e in data["tokens"])
    assert sources == ["", str(ds), str(notes)]


def test_cache_clear_drops_token_streams_and_all_drops_every_kind(tmp_path, filled):
    root, notes, _ = filled
    env = {"DELTAFY_CACHE": str(root)}
    proc = cli("cache", "clear", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("removed token streams: 3 entries, "), proc.stdout
    assert f"({root / 'tokens'})" in proc.stdout and f"in {root}" in proc.stdout
    assert not (root / "tokens").exists()
    assert (root / "gguf").is_dir() and (root / "kernels").is_dir()

    proc = cli("cache", "clear", "--all", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        f"removed dequantized GGUF weights: 1 entry, 3.0 kB ({root / 'gguf'})",
        f"removed compiled kernels (deltafy 0.1): 1 entry, 10 B ({root / 'kernels'})",
        f"freed 3.0 kB in {root}",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["mine.txt"]  # only deltafy's own folders went
    assert notes.is_file()

    proc = cli("cache", "clear", "--all", cwd=tmp_path, env=env)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"nothing to clear in {root}")


def test_a_missing_cache_folder_is_no_error_and_a_file_is_one_line(tmp_path):
    missing = tmp_path / "never made"
    env = {"DELTAFY_CACHE": str(missing)}
    info = cli("cache", "info", cwd=tmp_path, env=env)
    assert info.returncode == 0, info.stderr
    assert info.stdout.splitlines()[0] == f"cache folder: {missing} (set by DELTAFY_CACHE; it does not exist yet)"
    assert "0 entries" in info.stdout
    clear = cli("cache", "clear", "--all", cwd=tmp_path, env=env)
    assert (clear.returncode, clear.stdout.strip()) == (0, f"nothing to clear: {missing} does not exist")
    assert not missing.exists()

    a_file = tmp_path / "cache.txt"
    a_file.write_text("")
    for args in (("info",), ("clear",)):
        assert_one_line_error(cli("cache", *args, cwd=tmp_path, env={"DELTAFY_CACHE": str(a_file)}), "is a file")


def test_cache_clear_leaves_what_deltafy_did_not_write_in_its_folders(tmp_path):
    """DELTAFY_CACHE may be a folder of the user's; its tokens/ or gguf/ may hold the user's files too."""
    root = tmp_path / "cache"
    (root / "gguf" / "0123456789abcdef").mkdir(parents=True)
    (root / "gguf" / "0123456789abcdef" / "config.json").write_text("{}")
    (root / "gguf" / "0123456789abcdef.tmp-7").mkdir()  # a killed dequantization's leftover
    (root / "gguf" / "notes.txt").write_text("mine")
    key = "0123456789abcdef01234567"
    (root / "tokens" / "mine").mkdir(parents=True)
    for name, body in [(f"{key}.pt", "x" * 100), (f"{key}.json", "{}"), (f"{key}.pt.tmp-7", "xx"), ("corpus.txt", "m")]:
        (root / "tokens" / name).write_text(body)
    env = {"DELTAFY_CACHE": str(root)}
    data = json.loads(cli("cache", "info", "--json", cwd=tmp_path, env=env).stdout)
    assert {k: (v["entries"], v["bytes"]) for k, v in data["kinds"].items() if k != "kernels"} == {
        "tokens": (1, 104),  # the stream, its sidecar and a leftover; not corpus.txt
        "gguf": (1, 2),
    }
    proc = cli("cache", "clear", "--all", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"freed 106 B in {root}"
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    assert left == ["gguf", "gguf/notes.txt", "tokens", "tokens/corpus.txt", "tokens/mine"]
    assert (root / "gguf" / "notes.txt").read_text() == "mine"


def test_cache_clear_does_not_count_what_a_checkpoint_still_links(tmp_path):
    # a GGUF conversion hard-links the cache's dequantized shard into its checkpoint: clearing frees none of it
    root = tmp_path / "cache"
    entry = root / "gguf" / "0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"x" * 5000)
    (entry / "config.json").write_text("{}")
    (tmp_path / "ckpt").mkdir()
    os.link(entry / "model.safetensors", tmp_path / "ckpt" / "model.safetensors")
    proc = cli("cache", "clear", "--all", cwd=tmp_path, env={"DELTAFY_CACHE": str(root)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == (
        f"freed 2 B in {root} (5.0 kB more stays on disk: hard-linked into checkpoints you converted)"
    )
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"x" * 5000
