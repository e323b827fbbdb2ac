"""`deltafy convert` (and `train`, whose --out guard is the same) as a table of command lines: each row
a real subprocess on a tiny llama, its exit code, its first line, and the files it must leave exactly
as they were. Every row failed before deltafy guarded --out against its own inputs."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.cases import MOUNTS, Case, assert_case, mount_tmpfs, run_table, unmount_all
from helpers.training import build_stock_model

from deltafy.modeling_deltafy import HEADS_FILE

# slow: child processes and training runs (the quick run, -m 'not slow', leaves them to CI)
pytestmark = pytest.mark.slow


def _copy(name: str, into: str = "", key: str | None = None):
    """prepare: a copy of the table's folder ``name`` at ``{here}/<into>``."""

    def prepare(here: Path, paths: dict) -> dict:
        dest = here / (into or Path(paths[name]).name)
        shutil.copytree(paths[name], dest)
        return {key or name: str(dest)}

    return prepare


def _nested_source(here: Path, paths: dict) -> None:
    (here / "r1").mkdir()
    shutil.copytree(paths["stock"], here / "r1" / "stock")


def _user_folder(here: Path, paths: dict) -> None:
    (here / "mine").mkdir()
    (here / "mine" / "notes.txt").write_text("mine")
    (here / "mine" / "README.md").write_text("my own readme")


def _output_with_notes(here: Path, paths: dict) -> None:
    shutil.copytree(paths["delta"], here / "out")
    (here / "out" / "notes.txt").write_text("mine")
    (here / "out" / "data").mkdir()
    (here / "out" / "data" / "corpus.txt").write_text("my corpus")


def _notes_kept(paths: dict) -> None:
    out = Path(paths["here"]) / "out"
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "data" / "corpus.txt").read_text() == "my corpus"
    _assert_converted(out)


def _linked_source(here: Path, paths: dict) -> None:
    shutil.copytree(paths["sharded"], here / "src")
    (here / "link").symlink_to(here / "src")


def _bind_mounted_source(here: Path, paths: dict) -> None:
    """The source under a second name that no path resolves to: a bind mount (same device and inode)."""
    shutil.copytree(paths["sharded"], here / "src")
    (here / "mnt").mkdir()
    proc = subprocess.run(["mount", "--bind", str(here / "src"), str(here / "mnt")], capture_output=True, text=True)
    assert proc.returncode == 0, f"could not bind-mount {here / 'src'}: {proc.stderr}"
    MOUNTS.append(here / "mnt")


def _data_in_out(here: Path, paths: dict) -> None:
    shutil.copytree(paths["delta"], here / "run")
    shutil.copy(paths["train"], here / "run" / "corpus.txt")


def _heads_only_base(here: Path, paths: dict) -> None:
    shutil.copytree(paths["stock"], here / "stock")
    shutil.copytree(paths["heads_only"], here / "hd")
    config = json.loads((here / "hd" / "config.json").read_text())
    config["deltafy"]["base"]["path"] = "../stock"
    (here / "hd" / "config.json").write_text(json.dumps(config))


def _index_outside(here: Path, paths: dict) -> None:
    shutil.copytree(paths["sharded"], here / "ix")
    index = here / "ix" / "model.safetensors.index.json"
    record = json.loads(index.read_text())
    key = next(iter(record["weight_map"]))
    shutil.copy(here / "ix" / record["weight_map"][key], here / "other.safetensors")
    record["weight_map"][key] = "../other.safetensors"
    index.write_text(json.dumps(record))


def _empty_volume(here: Path, paths: dict) -> dict:
    """An empty folder that is a filesystem of its own, in a folder that cannot be written: a volume
    mounted into a container (``docker run -v``) whose root filesystem is read-only."""
    (here / "root" / "vol").mkdir(parents=True)
    _bind_read_only(here / "root")
    mount_tmpfs(here / "root" / "vol", "size=64m")
    return {"identity": _identity(here / "root" / "vol")}


def _output_volume(here: Path, paths: dict) -> None:
    (here / "vol").mkdir()
    mount_tmpfs(here / "vol", "size=64m")
    shutil.copytree(paths["delta"], here / "vol", dirs_exist_ok=True)


def _empty_folder(here: Path, paths: dict) -> dict:
    (here / "work").mkdir()
    return {"identity": _identity(here / "work")}


def _dead_partial_inside(here: Path, paths: dict) -> dict:
    """What a convert into the existing folder ``o`` left when it was killed: its staging folder inside."""
    exited = subprocess.Popen(["true"])
    exited.wait()  # its id is nobody's now (until the kernel reuses it)
    partial = here / "o" / f".deltafy-partial-{exited.pid}"
    partial.mkdir(parents=True)
    (partial / "model.safetensors").write_bytes(b"\0" * 100_000)
    return {"identity": _identity(here / "o")}


def _linked_output(here: Path, paths: dict) -> None:
    """``out``, a link to a previous output ``real`` (an output kept on another disk)."""
    shutil.copytree(paths["delta"], here / "real")
    (here / "real" / "README.md").write_text("the old card")
    (here / "out").symlink_to(here / "real")


def _link_kept(paths: dict) -> None:
    """check: the output replaced the folder the link points at; the link is still that link."""
    here = Path(paths["here"])
    assert (here / "out").is_symlink() and (here / "out").readlink() == here / "real"
    _assert_converted(here / "real")
    assert (here / "real" / "README.md").read_text() != "the old card"
    assert sorted(p.name for p in here.iterdir()) == ["out", "real"]  # nothing left beside them


def _dangling_link(here: Path, paths: dict) -> None:
    (here / "out").symlink_to(here / "made")


def _looping_link(here: Path, paths: dict) -> None:
    (here / "out").symlink_to(here / "out")


def _identity(folder: Path) -> str:
    info = folder.stat()
    return f"{info.st_dev}:{info.st_ino}"


def _filled(folder: str):
    """check: a converted model was written into ``folder`` itself, which is still the same folder."""

    def check(paths: dict) -> None:
        where = Path(folder.format(**paths))
        assert _identity(where) == paths["identity"]
        _assert_converted(where)
        assert (where / "model.safetensors").is_file() or (where / "model.safetensors.index.json").is_file()
        assert not [p.name for p in where.parent.iterdir() if ".deltafy-" in p.name]

    return check


def _assert_converted(folder: Path) -> None:
    assert json.loads((folder / "config.json").read_text())["model_type"] == "deltafy"


def _gguf_cache(here: Path, paths: dict) -> None:
    (here / "cache" / "gguf" / "0123456789abcdef").mkdir(parents=True)
    (here / "cache" / "gguf" / "0123456789abcdef" / "config.json").write_text("{}")


def _read_only(here: Path, paths: dict) -> None:
    (here / "ro").mkdir()
    mount_tmpfs(here / "ro", "ro,size=1m")


def _full_disk(here: Path, paths: dict) -> None:
    (here / "small").mkdir()
    mount_tmpfs(here / "small", "size=300k")


def _bind_read_only(where: Path) -> None:
    for args in (["--bind", str(where), str(where)], ["-o", "remount,bind,ro", str(where)]):
        proc = subprocess.run(["mount", *args], capture_output=True, text=True)
        assert proc.returncode == 0, f"could not make {where} read-only: {proc.stderr}"
    MOUNTS.append(where)


INTERRUPTED = "interrupted by"

CASES = [
    # -- no command deletes or rewrites what it reads, whatever the flags
    Case(
        "out-contains-the-source",  # the first case: every base weight deleted, exit 0
        ["convert", "{here}/r1/stock", "--out", "{here}/r1", "--overwrite", "--heads-only", "--no-verify"],
        1,
        "--out {here}/r1 contains the base model {here}/r1/stock",
        untouched=("{here}/r1",),
        prepare=_nested_source,
    ),
    Case(
        "out-is-the-source",
        ["convert", "{sharded}", "--out", "{sharded}", "--overwrite"],
        1,
        "--out {sharded} is the source {sharded}",
        untouched=("{sharded}",),
        prepare=_copy("sharded"),
    ),
    Case(
        "out-is-the-source-through-a-link",
        ["convert", "{here}/src", "--out", "{here}/link", "--overwrite"],
        1,
        "--out {here}/link is the source {here}/src",
        untouched=("{here}/src",),
        prepare=_linked_source,
    ),
    Case(
        "out-is-the-source-mounted-a-second-time",
        ["convert", "{here}/src", "--out", "{here}/mnt", "--overwrite"],
        1,
        "--out {here}/mnt is the source {here}/src",
        untouched=("{here}/src",),
        prepare=_bind_mounted_source,
    ),
    Case(
        "heads-only-out-inside-its-base",
        ["convert", "{stock}", "--out", "{stock}/delta", "--heads-only"],
        1,
        "--out {stock}/delta is inside the base model {stock}",
        untouched=("{stock}",),
        prepare=_copy("stock"),
    ),
    Case(
        "out-holds-the-gguf-cache",
        ["convert", "smollm2-135m", "--out", "{here}/cache", "--overwrite"],
        1,
        "--out {here}/cache contains deltafy's cache of dequantized GGUF models {here}/cache/gguf",
        untouched=("{here}/cache",),
        prepare=_gguf_cache,
        env={"DELTAFY_CACHE": "{here}/cache"},
    ),
    Case(
        "out-is-a-gguf-cache-entry",
        ["convert", "smollm2-135m", "--out", "{here}/cache/gguf/0123456789abcdef", "--overwrite"],
        1,
        "is inside deltafy's cache of dequantized GGUF models {here}/cache/gguf",
        untouched=("{here}/cache",),
        prepare=_gguf_cache,
        env={"DELTAFY_CACHE": "{here}/cache"},
    ),
    # -- --overwrite replaces only what a previous deltafy output wrote
    Case(
        "overwrite-a-folder-deltafy-did-not-write",
        ["convert", "{stock}", "--out", "{here}/mine", "--overwrite"],
        1,
        "--overwrite replaces only a folder deltafy wrote, and {here}/mine is not one",
        untouched=("{here}/mine",),
        prepare=_user_folder,
    ),
    Case(
        "overwrite-keeps-the-users-files-in-an-output",
        ["convert", "{stock}", "--out", "{here}/out", "--overwrite"],
        0,
        "llama · sequential pre-norm",
        untouched=("{here}/out/notes.txt", "{here}/out/data"),
        prepare=_output_with_notes,
        check=_notes_kept,
    ),
    Case(
        "train-out-holds-its-data",
        ["train", "{delta}", "--data", "{here}/run/corpus.txt", "--out", "{here}/run", "--overwrite", "--steps", "1"],
        1,
        "--out {here}/run contains the training data {here}/run/corpus.txt",
        untouched=("{here}/run",),
        prepare=_data_in_out,
    ),
    Case(
        "train-overwrite-a-folder-deltafy-did-not-write",
        ["train", "{delta}", "--data", "{train}", "--out", "{here}/mine", "--overwrite", "--steps", "1"],
        1,
        "{here}/mine holds files that deltafy did not write",
        untouched=("{here}/mine",),
        prepare=_user_folder,
    ),
    Case(
        "train-heads-only-out-inside-the-base",
        ["train", "{here}/hd", "--data", "{train}", "--out", "{here}/stock/run", "--heads-only", "--steps", "1"],
        1,
        "--out {here}/stock/run is inside the base model {here}/stock",
        untouched=("{here}/stock",),
        prepare=_heads_only_base,
    ),
    # -- an existing empty folder is written into, never replaced: a mounted volume, the folder one is in
    Case(
        "out-is-an-empty-mounted-volume",
        ["convert", "{stock}", "--out", "{here}/root/vol"],
        0,
        "llama · sequential pre-norm",
        prepare=_empty_volume,
        check=_filled("{here}/root/vol"),
    ),
    Case(
        "train-into-a-mounted-volume",  # its final save moves the model into --out: across filesystems, it failed
        ["train", "{delta}", "--data", "{train}", "--out", "{here}/root/vol", "--steps", "1"],
        0,
        "held-out loss",
        prepare=_empty_volume,
        check=_filled("{here}/root/vol"),
    ),
    Case(
        "out-is-the-empty-current-folder",
        ["convert", "{stock}", "--out", "."],
        0,
        "llama · sequential pre-norm",
        prepare=_empty_folder,
        cwd="{here}/work",
        check=_filled("{here}/work"),
    ),
    Case(
        "overwrite-the-current-folder",
        ["convert", "{stock}", "--out", ".", "--overwrite"],
        1,
        "--overwrite replaces . with a new folder, which cannot be done to the folder this command runs in; "
        "empty it first",
        untouched=("{here}/out",),
        prepare=_copy("delta", "out"),
        cwd="{here}/out",
    ),
    Case(
        "overwrite-a-mounted-volume",
        ["convert", "{stock}", "--out", "{here}/vol", "--overwrite"],
        1,
        "--overwrite replaces {here}/vol with a new folder, which cannot be done to a mount point",
        untouched=("{here}/vol",),
        prepare=_output_volume,
    ),
    Case(
        "killed-convert-into-an-existing-folder",  # its staging folder inside is cleared, not taken for files
        ["convert", "{stock}", "--out", "{here}/o"],
        0,
        "llama · sequential pre-norm",
        prepare=_dead_partial_inside,
        check=_filled("{here}/o"),
    ),
    # -- an --out that is a symbolic link: followed (replacing the link left the folder it named as it was)
    Case(
        "overwrite-through-a-link",
        ["convert", "{stock}", "--out", "{here}/out", "--overwrite"],
        0,
        "llama · sequential pre-norm",
        prepare=_linked_output,
        check=_link_kept,
    ),
    Case(
        "out-is-a-link-to-a-folder-yet-to-be-made",  # was: "could not write …: Not a directory", after the work
        ["convert", "{stock}", "--out", "{here}/out"],
        0,
        "llama · sequential pre-norm",
        prepare=_dangling_link,
        check=lambda paths: _assert_converted(Path(paths["here"]) / "made"),
    ),
    Case(
        "out-is-a-looping-link",
        ["convert", "{stock}", "--out", "{here}/out"],
        1,
        "--out {here}/out is a symbolic link that cannot be followed (Too many levels of symbolic links)",
        untouched=("{here}/out",),
        prepare=_looping_link,
    ),
    # -- output that cannot show "·", "α·β" or "Δ" gets "?" in their place, not an encoding error (stderr
    # already escapes what it cannot show)
    Case(
        "ascii-only-output",
        ["convert", "{stock}", "--out", "{here}/o"],
        0,
        "llama ? sequential pre-norm ? 2 layers",
        env={"PYTHONIOENCODING": "ascii"},
        check=lambda paths: _assert_converted(Path(paths["here"]) / "o"),
    ),
    # -- faults are named, up front where possible
    Case(
        "read-only-out",
        ["convert", "{stock}", "--out", "{here}/ro/out"],
        1,
        "cannot write --out {here}/ro/out: {here}/ro is not writable",
        needles=("Read-only file system",),
        prepare=_read_only,
    ),
    Case(
        "full-disk-checked-before-streaming",
        ["convert", "{stock}", "--out", "{here}/small/out"],
        1,
        "not enough disk space for {here}/small/out: it needs",  # (560 kB of weights and a margin; 300 kB free)
        needles=("MB and {here}/small has 3", "kB free"),
        prepare=_full_disk,
        absent=("{here}/small/out",),
    ),
    Case(
        "full-disk-while-writing",
        ["convert", "{stock}", "--out", "{here}/small/out", "--in-memory"],
        1,
        "could not write {here}/small/out: ran out of disk space",
        needles=("(it needs about 5", "kB free); nothing was written: free space or choose another --out"),
        prepare=_full_disk,
        absent=("{here}/small/out",),
    ),
    Case(
        "float16-overflow-streamed",
        ["convert", "{big}", "--out", "{here}/o", "--dtype", "float16", "--no-verify"],
        1,
        "model.layers.1.mlp.down_proj.weight does not fit in float16",
        absent=("{here}/o",),
    ),
    Case(
        "float16-overflow-in-memory",
        ["convert", "{big}", "--out", "{here}/o", "--dtype", "float16", "--in-memory"],
        1,
        "model.layers.1.mlp.down_proj.weight of {big} does not fit in float16",
        absent=("{here}/o",),
    ),
    Case(
        "index-names-a-file-outside-the-folder",
        ["convert", "{here}/ix", "--out", "{here}/o", "--in-memory"],
        1,
        "{here}/ix/model.safetensors.index.json names '../other.safetensors', which is not a file in {here}/ix",
        absent=("{here}/o",),
        prepare=_index_outside,
    ),
    # -- an interrupt never exits 0, and leaves no partial folder
    Case(
        "sigterm-while-writing",
        ["convert", "{large}", "--out", "{here}/o", "--in-memory"],
        143,
        f"{INTERRUPTED} SIGTERM; nothing was written to {{here}}/o",
        absent=("{here}/o",),
        interrupt=(signal.SIGTERM, ".o.deltafy-partial-*"),
    ),
    Case(
        "ctrl-c-while-writing-over-an-output",
        ["convert", "{large}", "--out", "{here}/out", "--in-memory", "--overwrite"],
        130,
        f"{INTERRUPTED} Ctrl-C (SIGINT); nothing was written to {{here}}/out, which is as it was",
        untouched=("{here}/out",),
        prepare=_copy("delta", "out", key="previous"),
        interrupt=(signal.SIGINT, ".out.deltafy-partial-*"),
    ),
    Case(
        "sigterm-while-writing-into-an-empty-folder",
        ["convert", "{large}", "--out", "{here}/o", "--in-memory"],
        143,
        f"{INTERRUPTED} SIGTERM; nothing was written to {{here}}/o",
        untouched=("{here}/o",),  # still there, and still empty
        prepare=lambda here, paths: (here / "o").mkdir(),
        interrupt=(signal.SIGTERM, "o/.deltafy-partial-*"),
    ),
    Case(
        "ctrl-c-while-starting",  # before torch is even imported
        ["convert", "{stock}", "--out", "{here}/o"],
        130,
        f"{INTERRUPTED} Ctrl-C (SIGINT); nothing was written",
        absent=("{here}/o",),
        interrupt=(signal.SIGINT, 0.3),
    ),
    Case(
        "sigterm-during-eval",
        ["eval", "{delta}", "--data", "{held}", "--seq-len", "32"],
        143,
        f"{INTERRUPTED} SIGTERM; nothing was written",
        interrupt=(signal.SIGTERM, 1.0),
    ),
    Case(
        "sigterm-during-inspect",
        ["inspect", "{delta}"],
        143,
        f"{INTERRUPTED} SIGTERM; nothing was written",
        interrupt=(signal.SIGTERM, 1.0),
    ),
]


def _with_one_big_weight(tokenizer, dest: Path) -> None:
    model = build_stock_model(tokenizer)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = 1e5  # fine in fp32 and bf16, beyond float16's range
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _large(tokenizer, dest: Path) -> None:
    """A llama big enough (about 120 MB) that writing and checking it take a while to interrupt."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama", hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)
    tokenizer.save_pretrained(dest)


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    from deltafy.conversion.job import convert_source

    root = tmp_path_factory.mktemp("convert-cases")
    paths = {"stock": str(tiny.stock), "delta": str(tiny.delta), "train": str(tiny.train_txt)}
    paths["held"] = str(tiny.held_txt)
    build_stock_model(tiny.tokenizer).to(torch.bfloat16).save_pretrained(root / "sharded", max_shard_size="50KB")
    tiny.tokenizer.save_pretrained(root / "sharded")
    _with_one_big_weight(tiny.tokenizer, root / "big")
    _large(tiny.tokenizer, root / "large")
    convert_source(str(tiny.stock), root / "heads-only", heads_only=True)
    assert (root / "heads-only" / HEADS_FILE).is_file()
    paths |= {name: str(root / name) for name in ("sharded", "big", "large", "heads-only")}
    paths["heads_only"] = paths.pop("heads-only")
    try:
        yield run_table(CASES, paths, root, env={"DELTAFY_CACHE": str(root / "cache")})
    finally:
        unmount_all()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_convert_case(runs, case):
    assert_case(case, runs[case.name])


def test_every_row_guards_something():
    """A row that checks neither files nor a refusal could pass on any code."""
    for case in CASES:
        assert case.untouched or case.absent or case.check or case.code != 0, case.name
