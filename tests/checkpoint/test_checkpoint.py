"""The checkpoint folder: it loads with plain transformers (no deltafy), round-trips, and is atomic.

The headline tests convert tiny models of several families, then reload each checkpoint in a
subprocess where ``import deltafy`` fails, with ``trust_remote_code=True`` only, and compare
its logits and greedy generations with the in-memory model and the original.
"""

from __future__ import annotations

import ast
import datetime as dt
import errno
import hashlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from helpers.models import DELTAFY_FREE_PREAMBLE, fixed_ids, randomize_heads, run_deltafy_free, tiny_model
from safetensors import safe_open

import deltafy
from deltafy.conversion.job import convert_source
from deltafy.files import MODELING_FILE
from deltafy.sources.folders import file_mode
from deltafy.surgery import delta_sites

SOURCE_CASES = [
    "llama-tied",
    "llama-untied",
    "gpt2",
    "gemma2",
    "opt-post-ln",
    "falcon-new-2ln",
    "granite",
    "gpt_neox-parallel",
]
# (case, recipe) converted in memory with heads that really change the outputs before saving.
NONTRIVIAL_CASES = [
    ("llama-untied", "ddl-scalar"),
    ("gpt2", "ddl-learned"),
    ("opt-post-ln", "ddl-scalar"),
    ("falcon-new-2ln", "ddl-learned"),
    ("granite", "ddl-learned"),
    ("llama-tied", "ddl-expanded"),
    ("gpt_neox-parallel", "ddl-expanded"),
    ("opt-post-ln", "ddl-expanded"),
    ("granite", "ddl-write-only"),  # the control without the erase term, at Granite's write scale
]
NEW_TOKENS = 16

# Runs in `python -I`: no cwd on sys.path, no PYTHON* variables, and deltafy made unimportable.
CHILD = (
    DELTAFY_FREE_PREAMBLE
    + r"""
import json, traceback
import torch
from transformers import AutoModelForCausalLM

jobs, result_file = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for job in jobs:
    try:
        if job.get("no_trust"):
            try:
                model = AutoModelForCausalLM.from_pretrained(job["path"])
            except Exception as err:
                results[job["key"]] = {"raised": type(err).__name__, "message": str(err)}
            else:
                results[job["key"]] = {"raised": None, "class": type(model).__name__}
            continue
        model = AutoModelForCausalLM.from_pretrained(job["path"], trust_remote_code=True,
                                                     dtype=torch.float32).eval()
        ids = torch.tensor(job["ids"])
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
            generated = model.generate(input_ids=ids[:1], max_new_tokens=job["new_tokens"],
                                       min_new_tokens=job["new_tokens"], do_sample=False, pad_token_id=0)
        out_emb = model.get_output_embeddings()
        results[job["key"]] = {
            "logits": logits,
            "generated": generated,
            "class": type(model).__name__,
            "module": type(model).__module__,
            "bases": [c.__name__ for c in type(model).__mro__[1:3]],
            "sites": sorted(n for n, m in model.named_modules() if type(m).__name__ == "DeltaSite"),
            "heads": {k: v.clone() for k, v in model.state_dict().items() if ".delta." in k},
            "tied": out_emb.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr(),
        }
    except Exception:
        results[job["key"]] = {"error": traceback.format_exc()}
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"results": results, "deltafy_modules": loaded}, result_file)
"""
)


def run_child(jobs: list[dict], cwd: Path) -> dict:
    """Load each job's checkpoint with plain transformers in a deltafy-free subprocess."""
    return run_deltafy_free(CHILD, [json.dumps(jobs)], cwd)["results"]


@torch.no_grad()
def run_model(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    logits = model(input_ids=ids).logits.float()
    generated = model.generate(
        input_ids=ids[:1], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
    )
    return logits, generated


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = fh.get_tensor(key)
    return out


def assert_state_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key], sb[key]), key


def no_partial_left(folder: Path) -> None:
    leftovers = [p.name for p in folder.iterdir() if "deltafy-partial" in p.name or "deltafy-old" in p.name]
    assert leftovers == []


def tiny_tokenizer():
    """A real (tokenizers-backed) word-level tokenizer small enough for the tiny models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "</s>", "<s>"] + (
        "the capital of france is def fibonacci ( n ) : once upon a time , in small village by sea "
        "deep learning models are trained"
    ).split()
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>", bos_token="<s>"
    )


# -- deltafy-free reload with trust_remote_code ----------------------------------------------------
@pytest.fixture(scope="module")
def reloaded(tmp_path_factory):
    """Build every checkpoint, then reload them all in one deltafy-free child process."""
    root = tmp_path_factory.mktemp("reload")
    entries, jobs = {}, []
    for case in SOURCE_CASES:
        stock = tiny_model(case)
        src = root / f"src-{case}"
        stock.save_pretrained(src)
        out = root / f"out-{case}"
        result = convert_source(str(src), out)  # tiny models have no tokenizer: must still work
        assert result.check is not None and result.check.passed
        assert not any(out.glob("tokenizer*"))
        converted = deltafy.convert(tiny_model(case))  # the same conversion, in memory
        ids = fixed_ids(stock)
        entries[f"src-{case}"] = dict(out=out, stock=stock, converted=converted, ids=ids)
        jobs.append(dict(key=f"src-{case}", path=str(out), ids=ids.tolist(), new_tokens=NEW_TOKENS))
    for i, (case, recipe) in enumerate(NONTRIVIAL_CASES):
        stock = tiny_model(case, seed=1)
        converted = deltafy.convert(tiny_model(case, seed=1), recipe)
        randomize_heads(converted, seed=i)
        out = root / f"heads-{case}-{recipe}"
        deltafy.save(converted, out)
        ids = fixed_ids(stock)
        entries[f"heads-{case}-{recipe}"] = dict(out=out, stock=stock, converted=converted, ids=ids)
        jobs.append(dict(key=f"heads-{case}-{recipe}", path=str(out), ids=ids.tolist(), new_tokens=NEW_TOKENS))
    # A sharded checkpoint with non-trivial heads, and one load attempt without trust_remote_code.
    stock = tiny_model("llama-untied", seed=2)
    converted = deltafy.convert(tiny_model("llama-untied", seed=2), "ddl-learned")
    randomize_heads(converted, seed=7)
    out = root / "sharded"
    deltafy.save(converted, out, max_shard_size="100KB")
    ids = fixed_ids(stock)
    entries["sharded"] = dict(out=out, stock=stock, converted=converted, ids=ids)
    jobs.append(dict(key="sharded", path=str(out), ids=ids.tolist(), new_tokens=NEW_TOKENS))
    jobs.append(dict(key="no-trust", path=str(entries["src-llama-tied"]["out"]), no_trust=True))
    results = run_child(jobs, root)
    return entries, results


def _child_result(reloaded, key):
    entries, results = reloaded
    got = results[key]
    assert "error" not in got, got.get("error")
    return entries[key], got


@pytest.mark.parametrize("case", SOURCE_CASES)
def test_converted_folder_reloads_without_deltafy(reloaded, case):
    entry, got = _child_result(reloaded, f"src-{case}")
    assert got["class"] == "DeltafyForCausalLM"
    assert got["module"].startswith("transformers_modules"), got["module"]  # the folder's own file
    assert got["bases"][0] == type(entry["stock"]).__name__
    expected_sites = sorted(n for n, _ in delta_sites(entry["converted"]))
    assert got["sites"] == expected_sites and len(expected_sites) >= 4

    logits, generated = run_model(entry["converted"], entry["ids"])
    assert got["logits"].shape == logits.shape
    assert (got["logits"] - logits).abs().max().item() <= 1e-5
    assert torch.equal(got["generated"], generated)
    assert got["generated"].shape[1] == entry["ids"].shape[1] + NEW_TOKENS

    stock_logits, stock_generated = run_model(entry["stock"], entry["ids"])
    assert (got["logits"] - stock_logits).abs().max().item() <= 1e-3
    assert torch.equal(got["generated"], stock_generated)


@pytest.mark.parametrize("key", [f"heads-{c}-{r}" for c, r in NONTRIVIAL_CASES] + ["sharded"])
def test_trained_heads_reload_without_deltafy(reloaded, key):
    entry, got = _child_result(reloaded, key)
    converted = entry["converted"]
    # The heads travelled bit for bit...
    heads = {k: v for k, v in converted.state_dict().items() if ".delta." in k}
    assert got["heads"].keys() == heads.keys() and heads
    for name, value in heads.items():
        assert torch.equal(got["heads"][name], value), name
    # ...and they matter: the converted model is far from the original, and the reload matches it.
    logits, generated = run_model(converted, entry["ids"])
    stock_logits, _ = run_model(entry["stock"], entry["ids"])
    assert (logits - stock_logits).abs().max().item() > 1e-2, "heads had no effect; the test would be trivial"
    assert (got["logits"] - logits).abs().max().item() <= 1e-5
    assert torch.equal(got["generated"], generated)


def test_tied_embeddings_stay_tied_after_remote_code_reload(reloaded):
    _, tied = _child_result(reloaded, "src-llama-tied")
    _, untied = _child_result(reloaded, "src-llama-untied")
    assert tied["tied"] is True
    assert untied["tied"] is False


def test_loading_without_trust_remote_code_fails_loudly(reloaded, tmp_path):
    # Default trust_remote_code in a non-interactive child: an error, never the stock model.
    _, results = reloaded
    got = results["no-trust"]
    assert got["raised"] is not None, f"loaded {got.get('class')} without trust_remote_code"
    assert "trust_remote_code" in got["message"]
    # Explicit trust_remote_code=False in this process (where deltafy is imported) fails too.
    entries, _ = reloaded
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="trust_remote_code"):
        AutoModelForCausalLM.from_pretrained(str(entries["src-llama-tied"]["out"]), trust_remote_code=False)


def test_remote_code_model_keeps_its_sites_through_train_and_eval_and_refuses_use_kernels(reloaded):
    from transformers import AutoModelForCausalLM

    entries, _ = reloaded
    entry = entries["heads-llama-untied-ddl-scalar"]
    model = AutoModelForCausalLM.from_pretrained(str(entry["out"]), trust_remote_code=True)
    logits, _ = run_model(entry["converted"], entry["ids"])
    model.train()
    model.eval()  # (transformers >= 5.25 would hand the norms' forwards to its kernels library here)
    got, _ = run_model(model, entry["ids"])
    assert (got - logits).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="use_kernels=True would replace the forwards") as err:
        AutoModelForCausalLM.from_pretrained(str(entry["out"]), trust_remote_code=True, use_kernels=True)
    assert len(str(err.value).splitlines()) == 1


# -- folder contents --------------------------------------------------------------------------------
def test_sharded_checkpoint_has_index_and_reloads_equal(reloaded):
    entries, _ = reloaded
    out, converted = entries["sharded"]["out"], entries["sharded"]["converted"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3
    assert not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert any(".delta." in k for k in index["weight_map"])
    assert set(index["weight_map"]) == set(tensors(out))
    loaded = deltafy.load(out)
    assert_state_equal(loaded, converted)


def test_tied_checkpoint_does_not_store_lm_head_twice(tmp_path):
    stock = tiny_model("llama-tied")
    stock.save_pretrained(tmp_path / "stock")
    model = deltafy.convert(tiny_model("llama-tied"))
    deltafy.save(model, tmp_path / "out")
    stored = tensors(tmp_path / "out")
    assert "lm_head.weight" not in stored
    assert {k for k in stored if ".delta." not in k} == set(tensors(tmp_path / "stock"))
    loaded = deltafy.load(tmp_path / "out")
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    # The untied family stores its own head, and it is not tied after loading.
    untied = deltafy.convert(tiny_model("llama-untied"))
    deltafy.save(untied, tmp_path / "untied")
    assert "lm_head.weight" in tensors(tmp_path / "untied")
    loaded = deltafy.load(tmp_path / "untied")
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("case,recipe", [("llama-tied", "ddl-scalar"), ("gpt2", "ddl-learned")])
def test_save_load_save_round_trip_is_bitwise(tmp_path, case, recipe):
    model = deltafy.convert(tiny_model(case), recipe)
    randomize_heads(model, seed=3)
    provenance = {"kind": "local", "source": "/somewhere/model", "config_sha256": "0" * 64}
    first = deltafy.save(model, tmp_path / "first", provenance=provenance)
    loaded = deltafy.load(first)
    assert type(loaded).__name__ == "DeltafyForCausalLM"
    assert_state_equal(loaded, model)
    second = deltafy.save(loaded, tmp_path / "second")

    a, b = tensors(first), tensors(second)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    ca = json.loads((first / "config.json").read_text())
    cb = json.loads((second / "config.json").read_text())
    for config in (ca, cb):
        created = config["deltafy"]["provenance"].pop("created")
        assert dt.datetime.fromisoformat(created).tzinfo is not None
    assert ca["deltafy"] == cb["deltafy"]
    assert ca == cb
    assert (first / MODELING_FILE).read_text() == (second / MODELING_FILE).read_text()
    assert yaml.safe_load((first / "recipe.yaml").read_text()) == yaml.safe_load((second / "recipe.yaml").read_text())


def test_every_family_loads_back_with_deltafy_load(tmp_path, case):
    # transformers renames some tensors on save (gpt_neox lm_head -> embed_out, MoE experts
    # unpacked); every tensor must still come back, not be silently re-initialized.
    model = deltafy.convert(tiny_model(case))
    randomize_heads(model)
    out = deltafy.save(model, tmp_path / "out")
    loaded = deltafy.load(out)
    assert_state_equal(loaded, model)
    ids = fixed_ids(model)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_modeling_file_is_core_verbatim_and_imports_only_torch_and_transformers(tmp_path):
    model = deltafy.convert(tiny_model("gemma2"))
    out = deltafy.save(model, tmp_path / "out")
    text = (out / MODELING_FILE).read_text()
    core = Path(deltafy.modeling_deltafy.__file__).read_text()
    assert text.startswith(core)
    generated = text[len(core) :]
    assert "from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma2Model" in generated
    binding = "DeltafyConfig, DeltafyForCausalLM, DeltafyModel = deltafy_classes("
    assert binding + "Gemma2Config, Gemma2ForCausalLM, Gemma2Model)" in generated
    assert len(generated.strip().splitlines()) <= 5, "the generated tail is a few lines of binding"
    # The checkpoint carries one Python file, importing torch, transformers (and safetensors and
    # hashlib, to read and check a heads-only checkpoint's files; importlib.metadata, to find a
    # bundled base in its package; math and re, to check the config's numbers and hashes; weakref, for
    # a site's call to hold its module) and the standard library's plain modules: no native code, no
    # compiler, no subprocess, no ctypes, nothing written to disk.
    assert sorted(p.name for p in out.glob("*.py")) == [MODELING_FILE]
    imported = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, "a relative import would need a second file"
            imported.add(node.module.split(".")[0])
    allowed = {
        "torch",
        "transformers",
        "safetensors",
        "__future__",
        "contextlib",
        "functools",
        "threading",
        "dataclasses",
        "weakref",
    }
    assert imported <= allowed | {"hashlib", "pathlib", "importlib", "math", "re"}, imported
    for word in ("ctypes", "subprocess", "cffi", "load_inline", "numpy", "os", "CDLL", "cpp_extension", "save_file"):
        assert not re.search(rf"\b{word}\b", text), f"the checkpoint's code uses {word}"
    opened = re.findall(r"\bopen\(([^)]*)\)", text)
    assert opened == ['"rb"'], f"the checkpoint's code opens files other than for reading: {opened}"
    assert not re.search(r"\.write(_text|_bytes)?\(|\bmkdir\(|\bunlink\(", text), "the checkpoint's code writes"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deltafy"
    assert config["architectures"] == ["DeltafyForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "modeling_deltafy.DeltafyConfig",
        "AutoModel": "modeling_deltafy.DeltafyModel",
        "AutoModelForCausalLM": "modeling_deltafy.DeltafyForCausalLM",
    }
    assert config["deltafy"]["base_model_type"] == "gemma2"
    assert config["deltafy"]["base_architecture"] == "Gemma2ForCausalLM"
    assert config["deltafy"]["format_version"] == deltafy.modeling_deltafy.DELTAFY_FORMAT_VERSION


@pytest.fixture(scope="module")
def converted_with_tokenizer(tmp_path_factory):
    """convert_source on a local folder that has a real tokenizer and a custom generation config."""
    root = tmp_path_factory.mktemp("withtok")
    src = root / "src"
    stock = tiny_model("llama-untied")
    stock.generation_config.repetition_penalty = 1.25
    stock.generation_config.eos_token_id = 2
    stock.save_pretrained(src)
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(src)
    out = root / "out"
    result = convert_source(str(src), out)
    return src, out, result


def test_tokenizer_and_generation_config_carried_over(converted_with_tokenizer):
    from transformers import AutoTokenizer, GenerationConfig

    src, out, _ = converted_with_tokenizer
    assert (out / "tokenizer.json").is_file()
    text = "the capital of France is"
    assert (
        AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]
        == AutoTokenizer.from_pretrained(str(src))(text)["input_ids"]
    )
    gen = GenerationConfig.from_pretrained(str(out))
    assert gen.repetition_penalty == 1.25
    assert gen.eos_token_id == 2


def test_model_card_recipe_and_provenance(converted_with_tokenizer):
    src, out, result = converted_with_tokenizer
    card = (out / "README.md").read_text()
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "transformers"
    assert front["pipeline_tag"] == "text-generation"
    assert "deltafy" in front["tags"] and "llama" in front["tags"]
    assert "base_model" not in front  # a local source is not a Hub model to link to
    check = result.check
    assert check is not None and check.passed and check.greedy_tokens == 32
    assert "## Init equivalence (measured at conversion, float32)" in card
    assert f"| max abs Δlogits vs original, default init | {check.max_abs_dlogits:.2e} (tolerance 0.001) |" in card
    assert "| logits with β = 0 bitwise identical | yes |" in card
    assert "| greedy generation, 32 tokens with KV cache | identical |" in card

    recipe = deltafy.load_recipe(out / "recipe.yaml")
    assert recipe == deltafy.load_recipe("ddl-scalar")
    config = json.loads((out / "config.json").read_text())
    assert config["deltafy"]["recipe"] == recipe.model_dump(mode="json")

    prov = config["deltafy"]["provenance"]
    assert prov["kind"] == "local"
    assert prov["source"] == src.name  # the folder name, never its place on this machine
    assert prov["config_sha256"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert prov["versions"] == {
        "deltafy": deltafy.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    created = dt.datetime.fromisoformat(prov["created"])
    assert abs((dt.datetime.now(dt.timezone.utc) - created).total_seconds()) < 3600
    # The card's provenance block is the config's.
    block = card.split("## Provenance")[1].split("```json\n")[1].split("```")[0]
    assert json.loads(block) == prov


# -- atomic writes ----------------------------------------------------------------------------------
class FailingTokenizer:
    """Stands in for a tokenizer whose save fails after the weights are already on disk."""

    def __init__(self, exc: BaseException | None = None, action=None):
        self.exc, self.action = exc, action
        self.seen: list[str] = []

    def save_pretrained(self, path):
        self.seen = sorted(os.listdir(path))
        (Path(path) / "tokenizer.json").write_text("{")  # half-written
        if self.action is not None:
            self.action()
        if self.exc is not None:
            raise self.exc


@pytest.fixture(scope="module")
def small_converted():
    return deltafy.convert(tiny_model("llama-untied"))


def test_every_file_saved_has_the_mode_of_a_new_file(tmp_path, small_converted):
    # safetensors alone writes its files 0600: a folder shared with another user could not be loaded.
    out = deltafy.save(small_converted, tmp_path / "out", max_shard_size="100KB")
    assert len(list(out.glob("*.safetensors"))) > 1
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {p.name: file_mode() for p in out.iterdir()}


def test_interrupted_save_leaves_nothing(tmp_path, small_converted):
    out = tmp_path / "out"
    tok = FailingTokenizer(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        deltafy.save(small_converted, out, tokenizer=tok)
    assert "model.safetensors" in tok.seen and "config.json" in tok.seen  # it failed mid-write
    assert not out.exists()
    no_partial_left(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "empty-out"])
def test_an_interrupt_as_the_staging_folder_is_made_leaves_nothing(tmp_path, small_converted, monkeypatch, existing):
    # A signal may land right after the staging folder's mkdir returns (the CLI's interrupt tests wait
    # for that folder to appear, then signal): it must be removed like one interrupted later.
    out = tmp_path / "out"
    if existing:
        out.mkdir()  # staged inside it
    make = Path.mkdir

    def mkdir(self, *args, **kwargs):
        make(self, *args, **kwargs)
        if ".deltafy-partial-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(KeyboardInterrupt):
        deltafy.save(small_converted, out)
    assert [p.name for p in tmp_path.rglob("*")] == (["out"] if existing else [])


def test_saving_into_an_empty_folder_fills_it_in_place(tmp_path, small_converted):
    out = tmp_path / "out"
    out.mkdir()
    identity = (out.stat().st_dev, out.stat().st_ino)
    deltafy.save(small_converted, out)
    assert (out.stat().st_dev, out.stat().st_ino) == identity  # (a mount point or the cwd stays what it is)
    assert_state_equal(deltafy.load(out), small_converted)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    no_partial_left(out)


def test_saving_through_a_link_writes_where_it_points_and_keeps_it(tmp_path, small_converted):
    link, real = tmp_path / "out", tmp_path / "disk" / "out"
    link.symlink_to(real)  # (a folder yet to be made: it was "Not a directory" after the work)
    assert deltafy.save(small_converted, link).resolve() == real.resolve()
    deltafy.save(small_converted, link, overwrite=True)  # replaced the folder it points at, not the link
    assert link.is_symlink() and link.readlink() == real
    assert_state_equal(deltafy.load(link), small_converted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "out"] and os.listdir(real.parent) == ["out"]
    no_partial_left(real)


def test_disk_full_during_save_is_a_clear_error(tmp_path, small_converted):
    out = tmp_path / "out"
    tok = FailingTokenizer(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(deltafy.DeltafyError, match="disk space"):
        deltafy.save(small_converted, out, tokenizer=tok)
    assert tok.seen
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_disk_full_reported_by_safetensors_is_a_clear_error(tmp_path, small_converted):
    # safetensors (Rust) reports I/O failures as SafetensorError, not OSError; the errno is only
    # in the message. The weights are by far the largest write, so this is where disks fill up.
    from safetensors import SafetensorError

    out = tmp_path / "out"
    err = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    with pytest.raises(deltafy.DeltafyError, match="disk space"):
        deltafy.save(small_converted, out, tokenizer=FailingTokenizer(err))
    assert list(tmp_path.iterdir()) == []


def test_other_os_error_during_save_is_a_clear_error(tmp_path, small_converted):
    out = tmp_path / "out"
    tok = FailingTokenizer(PermissionError(errno.EACCES, os.strerror(errno.EACCES)))
    with pytest.raises(
        deltafy.DeltafyError, match="could not write .*Permission denied; nothing was written: choose another --out$"
    ):
        deltafy.save(small_converted, out, tokenizer=tok)
    assert list(tmp_path.iterdir()) == []


def test_failed_overwrite_keeps_the_old_folder(tmp_path, small_converted):
    out = tmp_path / "out"
    deltafy.save(small_converted, out)
    (out / "keep.txt").write_text("mine")  # the user's own file, beside a previous output
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(deltafy.DeltafyError, match="ran out of disk space"):
        deltafy.save(
            small_converted,
            out,
            overwrite=True,
            tokenizer=FailingTokenizer(OSError(errno.ENOSPC, "No space left on device")),
        )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    no_partial_left(tmp_path)
    # Without --overwrite an occupied folder is refused before anything is written.
    with pytest.raises(deltafy.DeltafyError, match="already holds files"):
        deltafy.save(small_converted, out)
    # A successful overwrite replaces deltafy's files there, and keeps the user's.
    (tmp_path / "sibling.txt").write_text("untouched")
    (out / "README.md").write_text("an old card")
    deltafy.save(small_converted, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine" and (out / "config.json").is_file()
    assert (out / "README.md").read_text() != "an old card"
    assert (tmp_path / "sibling.txt").read_text() == "untouched"
    no_partial_left(tmp_path)
    # A folder deltafy did not write is no output to replace.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(deltafy.DeltafyError, match="replaces only a folder deltafy wrote"):
        deltafy.save(small_converted, mine, overwrite=True)
    assert sorted(os.listdir(mine)) == ["notes.txt"]


class _StrayTerm(Exception):
    pass


def test_sigterm_during_save_unwinds_and_cleans_up(tmp_path, small_converted):
    def ours(signum, frame):  # if deltafy did not handle SIGTERM, this (not the default) would run
        raise _StrayTerm()

    previous = signal.signal(signal.SIGTERM, ours)
    try:

        def terminate():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(200):  # the handler runs at the next bytecode boundary
                time.sleep(0.01)

        out = tmp_path / "out"
        with pytest.raises(KeyboardInterrupt):
            deltafy.save(small_converted, out, tokenizer=FailingTokenizer(action=terminate))
        assert signal.getsignal(signal.SIGTERM) is ours  # restored afterwards
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_unconverted_model(tmp_path):
    with pytest.raises(deltafy.DeltafyError, match="not converted"):
        deltafy.save(tiny_model("gpt2"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_save_refuses_a_tokenizer_that_is_not_one_before_writing(tmp_path, small_converted):
    # a path there failed with AttributeError once the weights were written
    with pytest.raises(deltafy.DeltafyError, match="tokenizer= takes a loaded tokenizer.*not 'gpt2'"):
        deltafy.save(small_converted, tmp_path / "out", tokenizer="gpt2")
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_stock_folder_and_other_format_version(tmp_path, small_converted):
    stock = tmp_path / "stock"
    tiny_model("gpt2").save_pretrained(stock)
    with pytest.raises(deltafy.DeltafyError, match="not a deltafy checkpoint"):
        deltafy.load(stock)
    with pytest.raises(deltafy.DeltafyError, match="nowhere does not exist; pass the folder `deltafy convert`"):
        deltafy.load(tmp_path / "nowhere")
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(deltafy.DeltafyError, match="nowhere is not a model folder \\(no config.json\\)"):
        deltafy.load(tmp_path / "nowhere")
    out = deltafy.save(small_converted, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    config["deltafy"]["format_version"] = 999
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(deltafy.DeltafyError, match="format 999"):
        deltafy.load(out)


def test_load_refuses_a_device_it_cannot_run_on_before_loading(tmp_path, small_converted):
    out = deltafy.save(small_converted, tmp_path / "out")
    with pytest.raises(deltafy.DeltafyError, match=r"^device='cuda:99': cuda:99: "):  # no machine has 100 GPUs
        deltafy.load(out, device="cuda:99")
    with pytest.raises(deltafy.DeltafyError, match=r"^device='tpu': 'tpu' is not a device"):
        deltafy.load(tmp_path / "nowhere", device="tpu")  # (refused before the folder is read)
    assert next(deltafy.load(out, device=torch.device("cpu")).parameters()).device.type == "cpu"


def test_load_refuses_a_dtype_name_torch_does_not_have(tmp_path, small_converted):
    out = deltafy.save(small_converted, tmp_path / "out")
    for name in ("float8", "Tensor"):  # (torch.Tensor is no dtype either)
        with pytest.raises(deltafy.DeltafyError, match=rf"^dtype='{name}' is not a torch dtype; e.g. 'float32'"):
            deltafy.load(out, dtype=name)
    assert next(deltafy.load(out, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_a_config_whose_recipe_is_not_an_object_is_refused_in_one_line(tmp_path, small_converted):
    # (eval and inspect read a trained folder's recipe for its run's settings: once an internal error)
    from deltafy.evaluate import run_settings

    out = deltafy.save(small_converted, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    for recipe in ("ddl-scalar", {"name": "mine", "training": ["seq_len", 64]}):
        config["deltafy"]["recipe"] = recipe
        (out / "config.json").write_text(json.dumps(config))
        for read in (deltafy.load, run_settings):
            with pytest.raises(deltafy.DeltafyError) as err:
                read(str(out))
            assert (
                str(err.value)
                == f"invalid {out / 'config.json'}: deltafy.recipe and its training section must be objects"
            )


def test_a_config_whose_spec_could_not_run_is_refused_naming_the_field(tmp_path, small_converted):
    out = deltafy.save(small_converted, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    config["deltafy"]["eps"] = float("nan")  # json writes NaN, and reads it back: it once loaded and gave loss nan
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(out)
    assert str(err.value) == f"invalid {out / 'config.json'}: eps must be a finite number > 0, got nan"
    config["deltafy"]["eps"], config["deltafy"]["sites"][1]["scale"] = 1e-6, float("inf")
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(deltafy.DeltafyError, match="site 'mlp': scale must be a finite number > 0, got inf"):
        deltafy.load(out)
    result = run_child([{"key": "inf-scale", "path": str(out), "ids": [[1, 2]], "new_tokens": 1}], tmp_path)
    assert "DeltafyError: site 'mlp': scale must be a finite number > 0, got inf" in result["inf-scale"]["error"]


@pytest.mark.parametrize("case", ["gpt2", "gemma2", "gpt_neox-parallel", "llama-untied"])
def test_folder_without_tokenizer_files_gives_no_tokenizer(tmp_path, case):
    # transformers can build a special-tokens-only tokenizer for such a folder; it must not be used
    # for the self-check (it encodes prompts to nothing) nor copied into the checkpoint.
    from deltafy.sources.load import load_source

    tiny_model(case).save_pretrained(tmp_path / "src")
    assert load_source(str(tmp_path / "src")).tokenizer is None


# -- checkpoints written by deltafy 0.1 -------------------------------------------------------------
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("name", ["v0.1-llama-scalar", "v0.1-llama-learned"])
def test_checkpoints_written_by_0_1_load_with_deltafy_load(tmp_path, name):
    """Folders saved by deltafy 0.1 (config.json and weights as it wrote them, with heads that
    change the outputs; its modeling files are not needed: deltafy.load runs none of a folder's code)."""
    folder = FIXTURES / name
    expected = json.loads((folder / "expected.json").read_text())
    model = deltafy.load(folder)
    ids = torch.tensor(expected["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with deltafy.disabled(model):
            plain = model(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=0, atol=1e-5)
    assert (logits - plain).abs().max() > 1e-2, "the fixture's heads must matter"
    out = deltafy.save(model, tmp_path / "resaved")  # saved again, it is a checkpoint of today's format
    assert sorted(p.name for p in out.glob("*.py")) == [MODELING_FILE]
    assert_state_equal(deltafy.load(out), model)
