"""A table of hostile and unlucky command lines, each a real ``python -m deltafy`` subprocess on a tiny
model: its exit code, its message, and what it leaves on disk. Then every command once more with
paths holding brackets, markup, spaces and unicode, existing and missing.

All the subprocesses run at once (a few at a time) in one module fixture; each test reads its result.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.cli import assert_one_line_error, stderr_lines
from helpers.models import tiny_config
from helpers.training import run_cli, shared_tokenizer

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow

FUZZ = "fuzz [draft] ü"  # a folder name with a markup tag, a space and a non-ASCII letter
CACHE = "cache [c] ü"  # DELTAFY_CACHE of every run here
NARROW = {"COLUMNS": "60"}  # narrower than most lines: one that names a path must still hold it whole


@dataclass
class Case:
    """One command line. ``argv`` is formatted with the paths the module fixture built; ``needles``
    must appear in the one ``error:`` line (exit 1) or in stdout (exit 0); ``notices`` are lines
    allowed on stderr before the error (or on success), each holding its fragment; ``check`` looks
    at the files afterwards."""

    name: str
    argv: list[str]
    code: int
    needles: tuple[str, ...] = ()
    notices: tuple[str, ...] = ()
    check: Callable[[dict], None] | None = None


def _absent(paths: dict, name: str) -> None:
    assert not (Path(paths["root"]) / name).exists(), f"{name} was created"


def _no_auto_map(paths: dict) -> None:
    config = json.loads((Path(paths["root"]) / "out-tokmap" / "tokenizer_config.json").read_text())
    assert "auto_map" not in config, config["auto_map"]


def _partial_removed(paths: dict) -> None:
    root = Path(paths["root"])
    assert not (root / paths["dead_partial"]).exists()
    assert (root / "out-dead" / "config.json").is_file()


def _running_partial_kept(paths: dict) -> None:
    root = Path(paths["root"])
    assert (root / paths["live_partial"] / "model.safetensors").is_file()
    assert not (root / "out-live").exists()


def _old_restored(paths: dict) -> None:
    root = Path(paths["root"])
    assert (root / "out-old" / "mine.txt").read_text() == "precious"
    assert not (root / paths["dead_old"]).exists()


def _converted(folder: str) -> Callable[[dict], None]:
    def check(paths: dict) -> None:
        out = Path(paths["root"]) / folder.format(**paths)
        assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
        assert not [p for p in out.parent.iterdir() if "deltafy-partial" in p.name]

    return check


CASES = [
    # -- messages hold user strings verbatim: no markup error, no tag eaten
    Case("eval-data-markup-close", ["eval", "{delta}", "--data", "nope[/]x.txt"], 1, ("nope[/]x.txt",)),
    Case("eval-data-tag", ["eval", "{delta}", "--data", "missing [draft].txt"], 1, ("missing [draft].txt",)),
    # (`convert --out` with a markup close tag: FUZZ_CASES)
    # -- every size, seed and rate checked before work, all bad ones at once, each named
    Case(
        "eval-zero-sizes",  # once ZeroDivisionError and friends
        ["eval", "{delta}", "--data", "{held}", "--seq-len", "0", "--batch-size", "0", "--max-blocks", "0"],
        1,
        ("--seq-len takes an integer ≥ 2", "got 0", "--batch-size takes an integer ≥ 1", "--max-blocks takes"),
    ),
    Case(
        "eval-seq-len-above-llama-positions",
        ["eval", "{delta}", "--data", "{held}", "--seq-len", "{llama_too_long}"],
        1,
        ("--seq-len {llama_too_long}", "{llama_positions} positions"),
    ),
    Case(
        "eval-seq-len-above-gpt2-positions",  # once an IndexError deep in GPT-2's position embedding
        ["eval", "{gpt2}", "--data", "{held}", "--seq-len", "1025"],
        1,
        ("--seq-len 1025", "1024 positions"),
    ),
    Case(
        "convert-tolerance-nan",
        ["convert", "{stock}", "--out", "{root}/o-nan", "--tolerance", "nan"],
        1,
        ("--tolerance",),
    ),
    Case(
        "train-negative-seed-and-infinite-lr",
        ["train", "{delta}", "--data", "{train}", "--out", "{root}/o-seed", "--seed", "-1", "--lr", "inf"],
        1,
        ("--seed: Input should be greater than or equal to 0", "--lr: Input should be a finite number"),
        check=lambda paths: _absent(paths, "o-seed"),
    ),
    Case(
        "train-on-its-held-out-text",  # was accepted: the "held-out loss" it printed was on trained text
        ["train", "{delta}", "--data", "{train}", "--eval-data", "{train}", "--out", "{root}/o-same"],
        1,
        ("--eval-data {train} holds the same text as --data {train}: the held-out text must not be trained on",),
        check=lambda paths: _absent(paths, "o-same"),
    ),
    Case(
        "train-flags-the-mode-does-not-read",  # were ignored without a word: ia3 has no rank, lora no heads' rate
        ["train", "{delta}", "--data", "{train}", "--out", "{root}/o-unread", "--train", "ia3", "--lora-r", "4"]
        + ["--lr", "0.1", "--keep-adapter"],
        1,
        (
            "--train ia3 does not read --lr (learning rate of the target and direction heads), --lora-r (LoRA rank); "
            + "drop them or choose a --train that does",
        ),
        check=lambda paths: _absent(paths, "o-unread"),
    ),
    Case(
        "train-recipe-lr-1e400",  # YAML reads 1e400 as a string, which pydantic would turn into inf
        ["train", "{delta}", "--data", "{train}", "--out", "{root}/o-lr400", "--recipe", "{root}/lr400.yaml"],
        1,
        ("training.lr", "finite"),
    ),
    Case(
        "convert-recipe-rank-1e20",
        ["convert", "{stock}", "--out", "{root}/o-rank", "--recipe", "{root}/rank1e20.yaml"],
        1,
        ("invalid recipe", "rank:"),
    ),
    Case(  # said "is not a model folder (no config.json)" of a folder that is not there
        "inspect-a-folder-that-is-not-there",
        ["inspect", "{root}/no-such-run"],
        1,
        ("{root}/no-such-run does not exist; pass the folder `deltafy convert` or `deltafy train` wrote",),
    ),
    # -- custom code: refused at once, never an interactive prompt
    Case(
        "convert-custom-code", ["convert", "{custom}", "--out", "{root}/o-custom"], 1, ("needs its own modeling code",)
    ),
    Case("eval-custom-code", ["eval", "{custom}", "--data", "{held}"], 1, ("needs its own modeling code",)),
    Case(  # a built-in family with an auto_map: transformers' own class loads it, no prompt
        "eval-auto-map-on-a-builtin-family",
        ["eval", "{builtin_auto_map}", "--data", "{held}", "--seq-len", "32"],
        0,
        ("loss ", "perplexity"),
    ),
    Case(
        "convert-tokenizer-auto-map-not-copied",
        ["convert", "{tokmap}", "--out", "{root}/out-tokmap"],
        0,
        ("self-check passed",),
        check=_no_auto_map,
    ),
    # -- folders a killed convert left beside --out
    Case(
        "convert-removes-a-dead-runs-partial",
        ["convert", "{stock}", "--out", "{root}/out-dead"],
        0,
        ("self-check passed",),
        notices=("removed {root}/{dead_partial}",),
        check=_partial_removed,
    ),
    Case(
        "convert-refuses-while-the-partials-process-runs",
        ["convert", "{stock}", "--out", "{root}/out-live"],
        1,
        ("process {live_pid} is writing", "{live_partial}"),
        check=_running_partial_kept,
    ),
    Case(  # killed between its two renames: the previous --out is put back, then guarded as usual
        "convert-restores-the-out-a-killed-overwrite-moved-aside",
        ["convert", "{stock}", "--out", "{root}/out-old"],
        1,
        ("already holds files",),
        notices=("restored {root}/out-old",),
        check=_old_restored,
    ),
]

# Every command with paths holding brackets, a markup close tag, spaces and unicode: real files and
# folders with such names, and missing ones. Each path must come back verbatim, with no traceback.
FUZZ_CASES = [
    Case(
        "convert",
        ["convert", "{stock}", "--out", "{fuzz}/runs/a[/]b ü"],  # once a MarkupError after the whole job
        0,
        ("wrote {fuzz}/runs/a[/]b ü ", "from_pretrained('{fuzz}/runs/a[/]b ü', trust_remote_code=True)"),
        check=_converted("{fuzz}/runs/a[/]b ü"),
    ),
    Case("convert-missing", ["convert", "{fuzz}/missing [/] ü", "--out", "{fuzz}/o"], 1, ("{fuzz}/missing [/] ü",)),
    Case(
        "convert-missing-recipe",
        ["convert", "{stock}", "--dry-run", "--recipe", "{fuzz}/no [b] ü.yaml"],
        1,
        ("{fuzz}/no [b] ü.yaml",),
    ),
    Case(
        "convert-dry-run-recipe",
        ["convert", "{stock}", "--dry-run", "--recipe", "{fuzz}/recipe [r] ü.yaml"],
        0,
        ("recipe mine [draft] ü",),
    ),
    Case("inspect", ["inspect", "{fuzz}/model [v1] ü"], 0, ("{fuzz}/model [v1] ü: llama",)),
    Case("inspect-missing", ["inspect", "{fuzz}/missing [/] ü"], 1, ("{fuzz}/missing [/] ü",)),
    Case(
        "eval",
        ["eval", "{fuzz}/model [v1] ü", "--data", "{fuzz}/held [x] ü.txt", "--seq-len", "32"],
        0,
        ("loss ", "perplexity"),
    ),
    Case("eval-missing-model", ["eval", "{fuzz}/missing [/] ü", "--data", "{held}"], 1, ("{fuzz}/missing [/] ü",)),
    Case("eval-missing-data", ["eval", "{delta}", "--data", "{fuzz}/nope [/] ü.txt"], 1, ("{fuzz}/nope [/] ü.txt",)),
    Case(
        "train",
        [
            "train",
            "{fuzz}/model [v1] ü",
            "--data",
            "{fuzz}/held [x] ü.txt",
            "--out",
            "{fuzz}/trained [/] ü",
            "--steps",
            "1",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--eval-every",
            "1",
            "--max-eval-blocks",
            "1",
        ],
        0,
        ("wrote {fuzz}/trained [/] ü",),
        notices=("train: step 1/1",),  # progress, shown on a non-terminal too
    ),  # fmt: skip
    Case(
        "train-missing-model",
        ["train", "{fuzz}/missing [/] ü", "--data", "{held}", "--out", "{fuzz}/o2"],
        1,
        ("{fuzz}/missing [/] ü",),
    ),
    Case("recipes", ["recipes"], 0, ("ddl-scalar",)),
    Case("cache-info", ["cache", "info"], 0, ("cache folder: {root}/" + CACHE + " ",)),
]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: no process has this id (until the kernel reuses it)


def _custom_code_folder(stock: Path, dest: Path, model_type: str) -> Path:
    """A copy of ``stock`` whose config points at its own modeling code, as custom-code models do."""
    shutil.copytree(stock, dest)
    config = json.loads((dest / "config.json").read_text())
    config["model_type"] = model_type
    config["auto_map"] = {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "configuration_my.py").write_text(
        f"from transformers import LlamaConfig\n\n\nclass MyConfig(LlamaConfig):\n    model_type = {model_type!r}\n"
    )
    (dest / "modeling_my.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_my import MyConfig\n\n\n"
        "class MyModel(LlamaForCausalLM):\n    config_class = MyConfig\n"
    )
    return dest


def _build(root: Path, tiny, live_pid: int) -> dict:
    from transformers import AutoModelForCausalLM

    paths = {"root": str(root), "delta": str(tiny.delta), "stock": str(tiny.stock)}
    paths |= {"held": str(tiny.held_txt), "train": str(tiny.train_txt)}
    positions = json.loads((tiny.delta / "config.json").read_text())["max_position_embeddings"]
    paths |= {"llama_positions": str(positions), "llama_too_long": str(positions + 1)}

    config = tiny_config("gpt2")
    config.vocab_size = len(tiny.tokenizer)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "gpt2")
    tiny.tokenizer.save_pretrained(root / "gpt2")
    paths["gpt2"] = str(root / "gpt2")

    paths["custom"] = str(_custom_code_folder(tiny.stock, root / "custom", "my-custom-llama"))
    paths["builtin_auto_map"] = str(_custom_code_folder(tiny.stock, root / "builtin-auto-map", "llama"))
    tokmap = root / "tokmap"
    shutil.copytree(tiny.stock, tokmap)
    tok_config = json.loads((tokmap / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_my.MyTokenizerFast"]}
    (tokmap / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (tokmap / "tokenization_my.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass MyTokenizerFast(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    paths["tokmap"] = str(tokmap)

    (root / "lr400.yaml").write_text("name: lr400\ntraining:\n  lr: 1e400\n")
    (root / "rank1e20.yaml").write_text("name: r\ndirection: learned\nrank: 1.0e+20\n")

    # What killed converts leave: a model-sized partial folder (its process gone, or still running),
    # and an overwrite killed between its renames (--out moved aside, the new one not yet in place).
    dead = _dead_pid()
    for name, pid in (("dead", dead), ("live", live_pid)):
        partial = root / f".out-{name}.deltafy-partial-{pid}"
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"\0" * 100_000)
        paths[f"{name}_partial"] = partial.name
    old = root / f".out-old.deltafy-old-{dead}"
    old.mkdir()
    (old / "mine.txt").write_text("precious")
    paths |= {"live_pid": str(live_pid), "dead_old": old.name}

    fuzz = root / FUZZ
    fuzz.mkdir()
    shutil.copytree(tiny.delta, fuzz / "model [v1] ü")
    shutil.copy(tiny.held_txt, fuzz / "held [x] ü.txt")
    (fuzz / "recipe [r] ü.yaml").write_text("name: mine [draft] ü\ndescription: '[bold]not bold[/]'\n")
    paths["fuzz"] = str(fuzz)
    return paths


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    assert tiny.tokenizer is shared_tokenizer()
    root = tmp_path_factory.mktemp("cli-cases")
    env = {"DELTAFY_CACHE": str(root / CACHE), **NARROW}
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        paths = _build(root, tiny, live.pid)
        table = [("case", c) for c in CASES] + [("fuzz", c) for c in FUZZ_CASES]
        with ThreadPoolExecutor(max_workers=3) as pool:
            futures = {
                (kind, c.name): pool.submit(run_cli, *[a.format(**paths) for a in c.argv], cwd=root, env=env)
                for kind, c in table
            }
            results = {key: future.result() for key, future in futures.items()}
    finally:
        live.kill()
        live.wait()
    return paths, results


def _assert_case(case: Case, proc, paths: dict) -> None:
    def fill(text: str) -> str:
        return text.format(**paths)

    for output in (proc.stdout, proc.stderr):
        assert "Traceback" not in output and "MarkupError" not in output, output
        assert "Do you wish to run the custom code" not in output, output
    assert proc.returncode == case.code, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = stderr_lines(proc)
    notices = [fill(n) for n in case.notices]
    extra = [line for line in lines if any(n in line for n in notices)]
    for notice in notices:
        assert any(notice in line for line in extra), f"{notice!r} not on stderr:\n{proc.stderr}"
    if case.code == 0:
        assert lines == extra, proc.stderr
        for needle in case.needles:
            assert fill(needle) in proc.stdout, f"{fill(needle)!r} not in stdout:\n{proc.stdout}"
    else:
        proc.stderr = "\n".join(line for line in lines if line not in extra)
        assert_one_line_error(proc, *map(fill, case.needles))
    if case.check is not None:
        case.check(paths)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cli_case(runs, case):
    paths, results = runs
    _assert_case(case, results["case", case.name], paths)


@pytest.mark.parametrize("case", FUZZ_CASES, ids=[c.name for c in FUZZ_CASES])
def test_paths_with_brackets_spaces_and_unicode(runs, case):
    paths, results = runs
    _assert_case(case, results["fuzz", case.name], paths)
