"""The command line end to end on the machine it runs on: convert, train (heads, eager and --compile;
heads+LoRA kept apart), eval and inspect of a small random bf16 Llama, each command a child process as a
user runs it, every result checked. Run it on a GPU beside benchmarks/gpu.sh (about a minute): there
`deltafy train` runs under bf16 autocast with the frozen base held in bf16 and the fused path on (and
compiled once), eval and inspect on the GPU (and eval once more with half the layers left on the CPU),
none of which a CPU run reaches (CI runs it on CPU).

    python benchmarks/gpu_cli.py            # prints one line per command, exits 1 if any check failed
    python benchmarks/gpu_cli.py --keep DIR # leaves the folders in DIR

The model: 4 layers of width 256 (vocabulary 1024, a byte-level BPE trained here on the first acts of
examples/shakespeare, so that nothing is downloaded), text: the same acts, held out: act 5.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from deltafy.quiet import quiet_transformers

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "examples" / "shakespeare"
TRAIN, HELD = TEXT / "midsummer-acts-1-4.md", TEXT / "midsummer-act-5.md"
SIZE = ["--seq-len", "128", "--batch-size", "4", "--max-eval-blocks", "8"]


def make_stock(folder: Path) -> None:
    """A random Llama in bf16 with a tokenizer trained on the training text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.train([str(TRAIN)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    with quiet_transformers():
        LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)


def deltafy(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # (everything is local: no retries of an unreachable Hub)
    proc = subprocess.run([sys.executable, "-m", "deltafy", *args], capture_output=True, text=True, cwd=REPO, env=env)
    return proc, time.perf_counter() - start


def loss_after(run: Path) -> float:
    """The held-out loss the run reported, unrounded (its metrics' summary)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return next(r for r in map(json.loads, reversed(lines)) if r.get("event") == "summary")["loss_after"]


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def spread_loss(run: Path) -> tuple[float, list[str]]:
    """The run's held-out loss as eval measures it, with the GPU given room for half its weights: place()'s
    "auto" map (eval's default on a GPU) leaves the other decoder layers on the CPU, run on the GPU a layer at
    a time. Returns the loss and the devices each part ran from."""
    from deltafy.evaluate import evaluate_text, load_any, run_settings
    from deltafy.placement import place

    options = run_settings(str(run), {})
    model, tokenizer = load_any(str(run), options.dtype)
    half = sum(t.numel() * t.element_size() for t in model.parameters()) // 2
    model = place(model, "auto", max_memory={0: half})
    loss = evaluate_text(
        model, tokenizer, [str(HELD)], options.seq_len, options.batch_size, options.max_blocks, options.text_field
    ).loss
    return loss, sorted(map(str, set(model.hf_device_map.values())))


class Checks:
    def __init__(self):
        self.failed = 0

    def command(self, what: str, *args: str) -> str | None:
        proc, seconds = deltafy(*args)
        ok = proc.returncode == 0
        last = (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or [""])[-1]
        print(f"{'ok ' if ok else 'FAIL'} {seconds:6.1f} s  {what}: {last[:150]}", flush=True)
        if not ok:
            self.failed += 1
            print(proc.stderr[-2000:], file=sys.stderr)
            return None
        return proc.stdout

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok ' if ok else 'FAIL'}           {what}{': ' + detail if detail else ''}", flush=True)
        self.failed += not ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", type=Path, help="write the folders here and leave them")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="deltafy-cli-"))
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU run)"
    print(f"deltafy's command line on {device}, torch {torch.__version__}, in {work}", flush=True)
    stock, delta, run, lora = work / "stock", work / "delta", work / "run", work / "lora"
    make_stock(stock)
    c = Checks()
    if c.command("convert", "convert", str(stock), "--out", str(delta)) is None:
        return 1
    data = ["--data", str(TRAIN), "--eval-data", str(HELD)]
    train_heads = ("train", str(delta), *data, *SIZE, "--steps", "6", "--lr", "0.05", "--out", str(run))
    out = c.command("train heads", *train_heads)
    if out is not None:
        before, after = float(re.search(r"held-out loss ([\d.]+) →", out).group(1)), loss_after(run)
        c.check("the heads lowered the held-out loss", after < before, f"{before:.4f} → {after:.4f}")
        start, trained = tensors(delta), tensors(run)
        frozen = [k for k in start if ".delta." not in k]
        c.check("every pretrained tensor bitwise the input's", all(torch.equal(start[k], trained[k]) for k in frozen))
        dtypes = sorted({str(t.dtype) for t in trained.values()})
        c.check("written in the input's bf16", dtypes == ["torch.bfloat16"], ", ".join(dtypes))
        shown = c.command("eval of the run", "eval", str(run), "--data", str(HELD), "--json")
        if shown is not None:
            loss = json.loads(shown)["loss"]
            c.check("eval gives the run's loss after", abs(loss - after) < 1e-6, f"{loss:.6f} vs {after:.6f}")
            if torch.cuda.is_available():  # (on a CPU there is nothing to spread)
                spread, devices = spread_loss(run)
                c.check(
                    "eval with half the layers on the CPU gives the same loss",
                    devices == ["0", "cpu"] and abs(spread - loss) < 1e-6,
                    f"{spread:.6f} vs {loss:.6f}, on {' and '.join(devices)}",
                )
        shown = c.command("inspect --data", "inspect", str(run), "--data", str(HELD), "--json")
        if shown is not None:
            layers = json.loads(shown)["layers"]
            c.check(
                "inspect measured every site",
                len(layers) == 4 and all(None not in row["beta"].values() for row in layers),
            )
        if c.command("train heads --compile", *train_heads[:-1], str(work / "compiled"), "--compile") is not None:
            compiled = loss_after(work / "compiled")  # (the same steps as graphs: the same loss, up to rounding)
            c.check("a compiled run gives that loss", abs(compiled - after) < 2e-3, f"{compiled:.6f} vs {after:.6f}")
    out = c.command(
        "train heads+lora --keep-adapter", "train", str(delta), *data, *SIZE, "--steps", "3", "--lr", "0.05",
        "--train", "heads+lora", "--keep-adapter", "--out", str(lora),
    )  # fmt: skip
    if out is not None:
        after = loss_after(lora)
        shown = c.command("eval of the run with its adapter", "eval", str(lora), "--data", str(HELD), "--json")
        if shown is not None:
            loss = json.loads(shown)["loss"]
            c.check("eval gives that run's loss after", abs(loss - after) < 1e-6, f"{loss:.6f} vs {after:.6f}")
    print(f"{'all checks passed' if not c.failed else f'{c.failed} failed'}", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
