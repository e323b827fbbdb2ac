"""Converting a big checkpoint: peak memory and wall time of `deltafy convert`, against `cp -r`.

    python benchmarks/convert_memory.py --size 7b --work /big/disk   # Llama-2-7B shape, 13.5 GB bf16
    python benchmarks/convert_memory.py --size 1b                    # Llama-3.2-1B shape, 2.5 GB
    python benchmarks/convert_memory.py --size tiny                  # seconds, for a smoke test

Writes a synthetic checkpoint of that shape (random bf16 tensors, in shards of --shard-gb, written
a tensor at a time so this script stays small in memory), then times, each in a fresh process
whose peak RSS is read with getrusage:

- `cp -r` of the folder (the cost of a copy);
- `deltafy convert SRC --out OUT --no-verify` (the conversion alone: hard links + a heads shard);
- `deltafy convert SRC --out OUT` (plus the self-check, a decoder layer at a time above 2 GiB);
- `deltafy convert SRC --out OUT --dtype float16 --no-verify` (every byte rewritten, cast a
  tensor at a time: the streamed-copy path).

Targets (issue 14): peak RSS below 2 GB for the 7B shape and about the same for every size;
conversion wall time at most 1.5x the copy (hard links: near zero) plus the self-check.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Llama-family shapes of models people convert
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, tie_word_embeddings=False),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=4096, tie_word_embeddings=False),
}  # fmt: skip

MEASURE = r"""
import resource, subprocess, sys, time
start = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
wall = time.perf_counter() - start
print(rc, wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def write_checkpoint(folder: Path, size: str, shard_bytes: int) -> int:
    """A random bf16 Llama checkpoint of ``size``'s shape, sharded like save_pretrained's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from deltafy.sources.shards import INDEX_FILE, write_file

    config = LlamaConfig(**SHAPES[size], dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    layout = [(n, t.dtype, tuple(t.shape)) for n, t in model.state_dict().items() if n != "lm_head.weight" or
              not config.tie_word_embeddings]  # fmt: skip
    shards, current, used = [], [], 0
    for item in layout:
        nbytes = torch.Size(item[2]).numel() * item[1].itemsize
        if current and used + nbytes > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(item)
        used += nbytes
    shards.append(current)
    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)

    def tensor(key: str) -> torch.Tensor:
        shape = dict((k, s) for k, _, s in layout)[key]
        if len(shape) == 1:  # norms
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    weight_map, total = {}, 0
    for i, items in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_file(folder / name, items, tensor)
        weight_map |= {k: name for k, _, _ in items}
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    return total


def measure(*command: str) -> tuple[float, float]:
    """Wall seconds and peak RSS (GiB) of ``command`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", MEASURE, *command], capture_output=True, text=True, check=True)
    rc, wall, rss_kib = out.stdout.split()
    if rc != "0":
        raise SystemExit(f"{' '.join(command)} failed with exit code {rc}")
    return float(wall), int(rss_kib) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="7b")
    parser.add_argument("--shard-gb", type=float, default=4.0)
    parser.add_argument("--work", type=Path, default=None, help="a folder on the disk to test (default: a temp dir)")
    parser.add_argument("--skip-cast", action="store_true", help="skip the --dtype float16 run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltafy-bench-", dir=args.work))
    try:
        src = work / f"llama-{args.size}"
        started = time.perf_counter()
        nbytes = write_checkpoint(src, args.size, int(args.shard_gb * 2**30))
        files = len(list(src.glob("*.safetensors")))
        print(f"synthetic {args.size}: {nbytes / 2**30:.2f} GiB in {files} shards, written in "
              f"{time.perf_counter() - started:.0f} s")  # fmt: skip
        deltafy = [sys.executable, "-m", "deltafy", "convert", str(src)]
        runs = [
            ("cp -r", ["cp", "-r", str(src), str(work / "copy")], work / "copy"),
            ("start-up (import deltafy)", [sys.executable, "-c", "import deltafy.conversion.job"], work / "none"),
            ("convert --no-verify", [*deltafy, "--out", str(work / "a"), "--no-verify"], work / "a"),
            ("convert (self-check)", [*deltafy, "--out", str(work / "b")], work / "b"),
        ]
        if not args.skip_cast:
            runs.append(("convert --dtype float16", [*deltafy, "--out", str(work / "c"), "--dtype", "float16",
                                                     "--no-verify"], work / "c"))  # fmt: skip
        copy = None
        print(f"{'run':<26}{'wall s':>9}{'x cp':>9}{'peak RSS GiB':>14}")
        for name, command, out in runs:
            wall, rss = measure(*command)
            copy = copy or wall
            print(f"{name:<26}{wall:>9.1f}{wall / copy:>9.2f}{rss:>14.2f}", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
