"""Heads-only (delta) checkpoints, and the bare model (AutoModel) of every checkpoint.

A heads-only folder holds the DDL heads alone and names its base; loaded with plain transformers
(in a subprocess where deltafy cannot be imported) or with deltafy.load, it must give exactly the
logits of the full checkpoint of the same model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.cli import assert_one_line_error
from helpers.models import DELTAFY_FREE_PREAMBLE, fixed_ids, randomize_heads, run_deltafy_free, tiny_model
from helpers.training import read_tensors, run_cli
from safetensors import safe_open

import deltafy
from deltafy.checkpoint import HEADS_FILE
from deltafy.sources.folders import file_mode
from deltafy.surgery import delta_sites

CASES = [
    ("llama-untied", "ddl-scalar"),
    ("gpt2", "ddl-learned"),
    ("opt-post-ln", "ddl-scalar"),
    ("mixtral", "ddl-scalar"),  # MoE: experts in transformers' fused layout, run by grouped_mm
]

CHILD = (
    DELTAFY_FREE_PREAMBLE
    + r"""
import json, traceback
import torch
from transformers import AutoModel, AutoModelForCausalLM

jobs, result_file = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for job in jobs:
    try:
        ids = torch.tensor(job["ids"])
        lm = AutoModelForCausalLM.from_pretrained(job["path"], trust_remote_code=True).eval()
        bare = AutoModel.from_pretrained(job["path"], trust_remote_code=True).eval()
        with torch.no_grad():
            out = lm(input_ids=ids, output_hidden_states=True)
            hidden = bare(input_ids=ids).last_hidden_state
        # trained on with plain transformers and saved as a Trainer's save_model saves, then loaded again
        with torch.no_grad():
            for name, param in lm.named_parameters():
                if ".delta." in name:
                    param.mul_(1.5)
            trained = lm(input_ids=ids).logits
        lm.save_pretrained(job["path"] + "-resaved")
        again = AutoModelForCausalLM.from_pretrained(job["path"] + "-resaved", trust_remote_code=True).eval()
        with torch.no_grad():
            resaved = again(input_ids=ids).logits
        with open(job["path"] + "-resaved/config.json") as fh:
            resaved_config = fh.read()
        fired = []
        for name, module in bare.named_modules():
            if type(module).__name__ == "DeltaSite":
                module.register_forward_hook(lambda m, a, o, name=name: fired.append(name))
        with torch.no_grad():
            bare(input_ids=ids)
        results[job["key"]] = {
            "logits": out.logits, "lm_hidden": out.hidden_states[-1], "bare_hidden": hidden,
            "lm_class": type(lm).__name__, "bare_class": type(bare).__name__,
            "bare_base": type(bare).__mro__[1].__name__, "fired": sorted(set(fired)),
            "kernels": [getattr(lm.config, f"_{kind}_implementation", None) for kind in ("attn", "experts")],
            "trained": trained, "resaved": resaved, "resaved_config": resaved_config,
        }
    except Exception:
        results[job["key"]] = {"error": traceback.format_exc()}
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"results": results, "deltafy_modules": loaded}, result_file)
"""
)


def converted_from_folder(root: Path, case: str, recipe: str, seed: int = 0):
    """A stock folder of ``case``, and the model loaded from it, converted, with heads that matter."""
    from transformers import AutoModelForCausalLM

    stock = root / f"stock-{case}"
    tiny_model(case, seed=seed).save_pretrained(stock)
    model = deltafy.convert(AutoModelForCausalLM.from_pretrained(stock).eval(), recipe)
    randomize_heads(model, seed=seed)
    return stock, model


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Full and heads-only checkpoints of the same models, reloaded in one deltafy-free child."""
    root = tmp_path_factory.mktemp("heads-only")
    entries, jobs = {}, []
    for case, recipe in CASES:
        stock, model = converted_from_folder(root, case, recipe)
        full = deltafy.save(model, root / f"full-{case}")
        heads = deltafy.save(model, root / f"heads-{case}", heads_only=True)
        ids = fixed_ids(model)
        entries[case] = dict(stock=stock, model=model, full=full, heads=heads, ids=ids)
        for kind, path in (("full", full), ("heads", heads)):
            jobs.append(dict(key=f"{kind}-{case}", path=str(path), ids=ids.tolist()))
    return entries, run_deltafy_free(CHILD, [json.dumps(jobs)], root)["results"]


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_heads_only_folder_holds_only_the_heads_and_pins_its_base(pairs, case):
    entry = pairs[0][case]
    heads, model = entry["heads"], entry["model"]
    assert not list(heads.glob("model*.safetensors"))
    with safe_open(str(heads / HEADS_FILE), framework="pt") as fh:
        stored = set(fh.keys())
    expected = {k for k in model.state_dict() if ".delta." in k}
    assert stored == expected and stored
    assert (heads / HEADS_FILE).stat().st_mode & 0o777 == file_mode()  # not safetensors' own 0600
    assert (heads / "modeling_deltafy.py").is_file() and (heads / "recipe.yaml").is_file()
    base = json.loads((heads / "config.json").read_text())["deltafy"]["base"]
    assert base["path"] == f"../{entry['stock'].name}"  # relative: no place on this machine is written down
    digest = hashlib.sha256((entry["stock"] / "model.safetensors").read_bytes()).hexdigest()
    assert base["sha256"] == {"model.safetensors": digest}
    assert "base" not in json.loads((entry["full"] / "config.json").read_text())["deltafy"]


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_heads_only_and_full_load_bitwise_equal_without_deltafy(pairs, case):
    entries, results = pairs
    entry = entries[case]
    full, heads = results[f"full-{case}"], results[f"heads-{case}"]
    assert "error" not in full, full.get("error")
    assert "error" not in heads, heads.get("error")
    with torch.no_grad():
        in_memory = entry["model"](input_ids=entry["ids"]).logits
    stock = tiny_model(case)
    with torch.no_grad():
        assert (in_memory - stock(input_ids=entry["ids"]).logits).abs().max() > 1e-2, "the heads must matter"
    # (another process may split the CPU kernels differently: equal to rounding, not bitwise)
    assert (full["logits"] - in_memory).abs().max() <= 1e-5
    assert torch.equal(heads["logits"], full["logits"])
    # deltafy.load gives the same model from either folder.
    loaded = deltafy.load(entry["heads"])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=entry["ids"]).logits, in_memory)


@pytest.mark.parametrize("job", [f"{kind}-{case}" for kind in ("full", "heads") for case, _ in CASES])
def test_a_checkpoint_trained_on_and_saved_with_plain_transformers_loads_as_it_was_saved(pairs, job):
    # (loaded from a heads-only folder it is a full model: saved so, with no base to look for and no path of
    # this machine in its config)
    result = pairs[1][job]
    assert not result.get("error"), result.get("error")
    assert not torch.equal(result["trained"], result["logits"]), "the heads changed"
    assert torch.equal(result["resaved"], result["trained"])
    config = json.loads(result["resaved_config"])
    assert config["model_type"] == "deltafy" and "base" not in config["deltafy"]
    assert str(pairs[0][job.split("-", 1)[1]]["stock"].parent) not in result["resaved_config"]


@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_a_heads_only_checkpoint_deltafy_loaded_saves_whole_and_keeps_its_base_apart(pairs, case, tmp_path):
    from transformers import AutoModelForCausalLM

    entry = pairs[0][case]
    model = deltafy.load(entry["heads"])
    model.save_pretrained(tmp_path / "resaved")
    assert "base" not in json.loads((tmp_path / "resaved" / "config.json").read_text())["deltafy"]
    # the modeling file its config names is there, the folder's own: plain transformers loads it too
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resaved", trust_remote_code=True)
    assert type(again).__module__ != type(model).__module__
    with torch.no_grad():
        want = model(input_ids=entry["ids"]).logits
        assert torch.equal(deltafy.load(tmp_path / "resaved")(input_ids=entry["ids"]).logits, want)
        assert torch.equal(again(input_ids=entry["ids"]).logits, want)
    # where its base was found stays on the model, for a heads-only save of it
    assert model.deltafy_base["location"] == str(entry["stock"].resolve())


@pytest.mark.parametrize("kind", ["full", "heads"])
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_checkpoints_run_the_kernels_their_family_runs(pairs, case, kind):
    # transformers picks attention and expert kernels by reading the model class's source file; a
    # converted checkpoint must get what its stock family gets (grouped_mm experts for an MoE).
    from transformers import AutoModelForCausalLM

    got = pairs[1][f"{kind}-{case}"]
    assert "error" not in got, got.get("error")
    stock = AutoModelForCausalLM.from_pretrained(pairs[0][case]["stock"]).config
    assert got["kernels"] == [stock._attn_implementation, getattr(stock, "_experts_implementation", None)]
    if case == "mixtral":
        assert got["kernels"][1] == "grouped_mm"


@pytest.mark.parametrize("kind", ["full", "heads"])
@pytest.mark.parametrize("case", [c for c, _ in CASES])
def test_auto_model_is_the_converted_bare_model(pairs, case, kind):
    entries, results = pairs
    got = results[f"{kind}-{case}"]
    assert "error" not in got, got.get("error")
    assert got["lm_class"] == "DeltafyForCausalLM"
    assert got["bare_class"] == "DeltafyModel"
    assert got["bare_base"] == type(entries[case]["model"].base_model).__name__  # LlamaModel, GPT2Model, ...
    prefix = entries[case]["model"].base_model_prefix + "."
    expected = sorted(n.removeprefix(prefix) for n, _ in delta_sites(entries[case]["model"]))
    assert got["fired"] == expected and len(expected) >= 4
    assert torch.equal(got["bare_hidden"], got["lm_hidden"])


def test_wrong_or_missing_base_is_one_clear_error(tmp_path):
    stock, model = converted_from_folder(tmp_path, "llama-untied", "ddl-scalar")
    heads = deltafy.save(model, tmp_path / "heads", heads_only=True)
    ids = fixed_ids(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    moved = tmp_path / "moved"
    shutil.move(stock, moved)
    with pytest.raises(deltafy.DeltafyError, match="base model .* was not found at .*stock-llama-untied") as err:
        deltafy.load(heads)
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)
    # Found where the user says it is, it loads (and is still checked).
    with torch.no_grad():
        assert torch.equal(deltafy.load(heads, base=moved)(input_ids=ids).logits, expected)
    # Other weights under the same name: refused, naming the file and the hash expected.
    tiny_model("llama-untied", seed=5).save_pretrained(stock)
    with pytest.raises(deltafy.DeltafyError, match="is not the base model .* model.safetensors is sha256") as err:
        deltafy.load(heads)
    assert "\n" not in str(err.value)


def test_heads_only_resave_and_full_save_of_a_delta_model(tmp_path):
    stock, model = converted_from_folder(tmp_path, "gpt2", "ddl-scalar")
    first = deltafy.save(model, tmp_path / "a" / "heads", heads_only=True)
    loaded = deltafy.load(first)
    again = deltafy.save(loaded, tmp_path / "b" / "c" / "heads", heads_only=True)  # elsewhere: path re-based
    base = json.loads((again / "config.json").read_text())["deltafy"]["base"]
    assert base["path"] == f"../../../{stock.name}" and "location" not in base
    full = deltafy.save(loaded, tmp_path / "full")
    assert "base" not in json.loads((full / "config.json").read_text())["deltafy"]
    ids = fixed_ids(model)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for folder in (again, full):
            assert torch.equal(deltafy.load(folder)(input_ids=ids).logits, want)


def test_hub_base_is_pinned_and_offline_gives_one_line(tmp_path):
    model = deltafy.convert(tiny_model("llama-untied"))
    model.config._commit_hash = "0123456789abcdef0123456789abcdef01234567"
    heads = deltafy.save(model, tmp_path / "heads", heads_only=True, base="someone/tiny-llama")
    base = json.loads((heads / "config.json").read_text())["deltafy"]["base"]
    assert base == {"id": "someone/tiny-llama", "revision": "0123456789abcdef0123456789abcdef01234567"}
    with pytest.raises(deltafy.DeltafyError, match="base model someone/tiny-llama at revision 0123456789ab") as err:
        deltafy.load(heads)  # HF_HUB_OFFLINE=1, nothing cached
    assert "\n" not in str(err.value)
    # A base with no known commit cannot be pinned.
    del model.config._commit_hash
    with pytest.raises(deltafy.DeltafyError, match="must pin its base"):
        deltafy.save(model, tmp_path / "unpinned", heads_only=True, base="someone/tiny-llama")
    assert not (tmp_path / "unpinned").exists()


def test_cli_convert_and_train_heads_only(tiny, tmp_path):
    delta = tmp_path / "delta"
    proc = run_cli("convert", tiny.stock, "--out", delta, "--heads-only", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not list(delta.glob("model*.safetensors")) and (delta / HEADS_FILE).is_file()
    assert (delta / "tokenizer.json").is_file()
    run = tmp_path / "run"
    args = ["train", delta, "--data", tiny.train_txt, "--eval-data", tiny.held_txt, "--out", run, "--steps", "2"]
    refused = run_cli(*args, "--seq-len", "32", "--heads-only", "--train", "heads+lora", cwd=tmp_path)
    assert_one_line_error(refused, "--keep-adapter", "--heads-only")
    assert not (run / "config.json").exists()
    proc = run_cli(*args, "--seq-len", "32", "--batch-size", "2", "--heads-only", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not list(run.glob("model*.safetensors"))
    trained = read_tensors(run)
    assert set(trained) == set(read_tensors(delta)) and all(".delta." in k for k in trained)
    assert any(not torch.equal(trained[k], v) for k, v in read_tensors(delta).items()), "the heads trained"
    base = json.loads((run / "config.json").read_text())["deltafy"]["base"]
    assert base["path"] == f"../{tiny.stock.name}" if tiny.stock.parent == tmp_path else base["path"].endswith("stock")
    model = deltafy.load(run)
    assert {k: v for k, v in model.state_dict().items() if ".delta." in k}.keys() == trained.keys()


# -- heads load exactly or not at all ---------------------------------------------------------------

REFUSE_CHILD = (
    DELTAFY_FREE_PREAMBLE
    + r"""
import json
import torch
from transformers import AutoModelForCausalLM

jobs, result_file = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for job in jobs:
    try:
        model = AutoModelForCausalLM.from_pretrained(job["path"], trust_remote_code=True, **job.get("kwargs", {}))
        results[job["key"]] = {"loaded": True, "strength": model.model.layers[0].delta.attn.strength.detach().clone()}
    except Exception as err:
        results[job["key"]] = {"loaded": False, "type": type(err).__name__, "message": str(err)}
loaded = sorted(name for name, mod in sys.modules.items() if name.split(".")[0] == "deltafy" and mod is not None)
torch.save({"results": results, "deltafy_modules": loaded}, result_file)
"""
)

HEAD = "model.layers.0.delta.attn."
# name -> (how the stored heads change, the refusal's words; None: it loads, the float cast to the model's dtype)
MISFITS = {
    "target-of-one": (
        lambda t: t.update({HEAD + "target.weight": torch.zeros(1)}),
        f"{HEAD}target.weight in {{file}} has shape (1,), the model's is (1, 64)",
    ),
    "strength-0d": (lambda t: t.update({HEAD + "strength": torch.tensor(0.5)}), "has shape (), the model's is (1,)"),
    "int-strength": (
        lambda t: t.update({HEAD + "strength": torch.ones(1, dtype=torch.int64)}),
        f"{HEAD}strength in {{file}} holds torch.int64, not floats",
    ),
    "bool-gate": (lambda t: t.update({HEAD + "gate.bias": torch.ones(1, dtype=torch.bool)}), "holds torch.bool"),
    "missing": (lambda t: t.pop(HEAD + "strength"), f"{{file}} lacks the head {HEAD}strength of this model"),
    "unexpected": (
        lambda t: t.update({HEAD + "extra": torch.ones(1)}),
        f"{{file}} holds {HEAD}extra, which is not a head of this model (0 missing, 1 unexpected)",
    ),
    "bf16-strength": (lambda t: t.update({HEAD + "strength": torch.full((1,), 0.75, dtype=torch.bfloat16)}), None),
}


def _edit_tensors(file: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    stored = load_file(str(file))
    edit(stored)
    save_file(stored, str(file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def misfits(tmp_path_factory):
    """Heads-only and full checkpoints of one model, each with one head changed by hand, loaded by
    deltafy here and by plain transformers in one deltafy-free child."""
    root = tmp_path_factory.mktemp("misfits")
    _, model = converted_from_folder(root, "llama-untied", "ddl-scalar")
    heads = deltafy.save(model, root / "heads", heads_only=True)
    full = deltafy.save(model, root / "full")
    folders, jobs = {}, []
    for name, (edit, _) in MISFITS.items():
        for kind, source, file in (("heads", heads, HEADS_FILE), ("full", full, "model.safetensors")):
            folder = root / f"{kind}-{name}"
            shutil.copytree(source, folder)
            _edit_tensors(folder / file, edit)
            folders[kind, name] = folder
            jobs.append(dict(key=f"{kind}-{name}", path=str(folder)))
    return folders, run_deltafy_free(REFUSE_CHILD, [json.dumps(jobs)], root)["results"]


@pytest.mark.parametrize("name", sorted(MISFITS))
def test_a_heads_file_that_does_not_fit_is_refused_by_name(misfits, name):
    folders, plain = misfits
    words = MISFITS[name][1]
    if words is None:  # another float precision: cast, as transformers casts every weight to the dtype asked for
        loaded = deltafy.load(folders["heads", name])
        assert loaded.model.layers[0].delta.attn.strength.dtype == torch.float32
        assert loaded.model.layers[0].delta.attn.strength.item() == 0.75
        assert plain[f"heads-{name}"]["loaded"] and plain[f"heads-{name}"]["strength"].item() == 0.75
        return
    words = words.format(file=HEADS_FILE)
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(folders["heads", name])
    assert words in str(err.value) and "\n" not in str(err.value)
    got = plain[f"heads-{name}"]
    assert not got["loaded"] and got["type"] == "DeltafyError", got
    assert got["message"] == str(err.value).split(": ", 1)[1]  # the same line, less "could not load"


@pytest.mark.parametrize("name", sorted(MISFITS))
def test_a_full_checkpoint_whose_heads_do_not_fit_is_refused_in_one_line(misfits, name):
    folders, plain = misfits
    words = MISFITS[name][1]
    got = plain[f"full-{name}"]
    if words is None:
        assert deltafy.load(folders["full", name]).model.layers[0].delta.attn.strength.item() == 0.75
        assert got["loaded"] and got["strength"].item() == 0.75
        return
    # deltafy.load reads the weight files' headers first: one line, before transformers prints its table
    with pytest.raises(deltafy.DeltafyError) as err:
        deltafy.load(folders["full", name])
    assert words.format(file="model.safetensors") in str(err.value) and "\n" not in str(err.value)
    # Plain transformers: a missing head would be left uninitialized and an unknown one dropped; the
    # checkpoint's code refuses both. A wrong shape transformers refuses itself; an integer it casts.
    if name in ("missing", "unexpected"):
        assert not got["loaded"] and got["type"] == "DeltafyError", got
        assert got["message"].startswith(words.format(file=f"the checkpoint {folders['full', name]}"))
    elif name in ("target-of-one", "strength-0d"):
        assert not got["loaded"] and "ignore_mismatched_sizes" in got["message"], got
    else:
        assert got["loaded"], got


# -- a heads-only base is verified or refused ---------------------------------------------------------

GOOD_SHA = "0" * 64
COMMIT = "0123456789abcdef0123456789abcdef01234567"
FORMS = 'deltafy.base must be {"id", "revision"} (a Hub model) or {"path", "sha256"} (a local one), got'


@pytest.mark.parametrize(
    "record, words",
    [
        ("../stock", f"{FORMS} '../stock'"),
        ({}, f"{FORMS} {{}}"),
        ({"revision": COMMIT}, f"{FORMS} {{'revision'"),
        ({"id": "someone/tiny"}, "deltafy.base names the Hub model someone/tiny but no revision"),
        ({"id": "a/b", "revision": "main"}, "deltafy.base.revision must be a commit (40 hex digits), got 'main'"),
        ({"id": 7, "revision": COMMIT}, "deltafy.base.id must be a non-empty string, got 7"),
        ({"path": "../stock"}, "deltafy.base names the local model ../stock but no sha256 of its weight files"),
        ({"path": ["a"], "sha256": {"model.safetensors": GOOD_SHA}}, "deltafy.base.path must be a non-empty string"),
        ({"path": "../stock", "sha256": "abc"}, "deltafy.base.sha256 must map each weight file's name to its SHA-256"),
        ({"path": "../stock", "sha256": {}}, "deltafy.base.sha256 must map"),
        ({"path": "../stock", "sha256": {"model.safetensors": "abc"}}, "got {'model.safetensors': 'abc'}"),
        ({"path": "../stock", "sha256": {"model.safetensors": 5}}, "deltafy.base.sha256 must map"),
    ],
)
def test_a_mistyped_base_record_is_one_line_naming_the_field(record, words):
    from deltafy.modeling_deltafy import check_base_record

    with pytest.raises(ValueError) as err:
        check_base_record(record)
    assert type(err.value).__name__ == "DeltafyError" and words in str(err.value)
    assert check_base_record({"path": "../x", "sha256": {"model.safetensors": GOOD_SHA}})
    assert check_base_record({"id": "someone/tiny", "revision": COMMIT})


def _edit_base(folder: Path, edit) -> None:
    file = folder / "config.json"
    config = json.loads(file.read_text())
    edit(config["deltafy"])
    file.write_text(json.dumps(config))


def test_a_local_base_without_hashes_or_of_another_model_is_never_loaded(tmp_path):
    stock, model = converted_from_folder(tmp_path, "llama-untied", "ddl-scalar")
    heads = deltafy.save(model, tmp_path / "heads", heads_only=True)
    unhashed = tmp_path / "unhashed"
    shutil.copytree(heads, unhashed)
    _edit_base(unhashed, lambda spec: spec["base"].pop("sha256"))
    with pytest.raises(deltafy.DeltafyError, match="unhashed/config.json: deltafy.base names the local model"):
        deltafy.load(unhashed)
    # the path of another model: its hashes are not the ones recorded
    tiny_model("llama-untied", seed=3).save_pretrained(tmp_path / "other")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(heads, elsewhere)
    _edit_base(elsewhere, lambda spec: spec["base"].update(path="../other"))
    with pytest.raises(deltafy.DeltafyError, match="other is not the base model .* model.safetensors is sha256"):
        deltafy.load(elsewhere)
    # the checkpoint's own code, without deltafy, refuses both
    jobs = [dict(key=folder.name, path=str(folder)) for folder in (unhashed, elsewhere)]
    plain = run_deltafy_free(REFUSE_CHILD, [json.dumps(jobs)], tmp_path)["results"]
    unhashed = plain["unhashed"]
    assert unhashed["type"] == "DeltafyError" and "no sha256 of its weight files" in unhashed["message"]
    assert plain["elsewhere"]["type"] == "BaseModelError" and "is not the base model" in plain["elsewhere"]["message"]


def test_a_local_copy_of_a_hub_base_must_fill_the_model_exactly(tmp_path):
    from transformers import AutoModelForCausalLM

    stock, model = converted_from_folder(tmp_path, "llama-untied", "ddl-scalar")
    model.config._commit_hash = COMMIT
    heads = deltafy.save(model, tmp_path / "heads", heads_only=True, base="someone/tiny-llama")
    ids = fixed_ids(model)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        # no hashes to check a copy by: it loads when its tensors are exactly the model's
        assert torch.equal(deltafy.load(heads, base=stock)(input_ids=ids).logits, expected)
    bigger = tiny_model("llama-untied").config
    bigger.num_hidden_layers = 4
    AutoModelForCausalLM.from_config(bigger).save_pretrained(tmp_path / "bigger")
    with pytest.raises(deltafy.DeltafyError, match="bigger is not the base model .* left over .*layers.2") as err:
        deltafy.load(heads, base=tmp_path / "bigger")
    assert "\n" not in str(err.value)
    smaller = tiny_model("llama-untied").config
    smaller.num_hidden_layers = 1
    AutoModelForCausalLM.from_config(smaller).save_pretrained(tmp_path / "smaller")
    with pytest.raises(deltafy.DeltafyError, match="smaller is not the base model .* missing .*layers.1"):
        deltafy.load(heads, base=tmp_path / "smaller")


def test_base_given_for_a_full_checkpoint_is_refused(tmp_path):
    stock, model = converted_from_folder(tmp_path, "gpt2", "ddl-scalar")
    full = deltafy.save(model, tmp_path / "full")
    with pytest.raises(deltafy.DeltafyError, match="applies to a heads-only checkpoint, and .*full is a full one"):
        deltafy.load(full, base=stock)
    heads = deltafy.save(model, tmp_path / "heads", heads_only=True)
    with pytest.raises(deltafy.DeltafyError, match="the base model given for this heads-only checkpoint is not there"):
        deltafy.load(heads, base=tmp_path / "nowhere")
