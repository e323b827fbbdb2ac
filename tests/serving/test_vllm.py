"""deltafy's vLLM plugin against vLLM's CPU build: checkpoints with non-zero heads served by vLLM give
transformers' greedy tokens and log-probs (trust_remote_code), the heads visibly matter, and what the plugin
does not serve is refused. Each vLLM engine runs in a child process (vLLM keeps global state). These tests
need vLLM (its own environment: .ci/run sets one up); without it they are skipped."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from helpers.models import open_gates  # noqa: E402

import deltafy  # noqa: E402
from deltafy.modeling_deltafy import DeltafyError  # noqa: E402
from deltafy.serving.vllm import servable  # noqa: E402

pytestmark = pytest.mark.vllm
CHILD = Path(__file__).with_name("vllm_child.py")
PROMPTS = [[1, 5, 9, 33, 100, 7, 250], [2, 40, 41, 42]]
# head_dim 64: vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224 or 256
_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
)
FAMILIES = {
    "llama": _LLAMA | dict(tie_word_embeddings=True),
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA | dict(head_dim=64),
    "gpt2": dict(n_embd=256, n_layer=2, n_head=4, vocab_size=512, n_positions=256, bos_token_id=0, eos_token_id=0),
    "phi": _LLAMA,
}


def converted(folder: Path, family: str, recipe: str = "ddl-scalar") -> Path:
    """A tiny random ``family`` model converted with ``recipe``, every head given a visible effect."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, initializer_range=0.1, **FAMILIES[family])
    model = deltafy.convert(AutoModelForCausalLM.from_config(config).eval(), recipe)
    open_gates(model)
    deltafy.save(model, folder)
    return folder


def _child(folder: Path, dtype: str, prompts, llm_kwargs: dict) -> subprocess.CompletedProcess:
    """vllm_child.py on ``folder``: vLLM in a process of its own."""
    args = [sys.executable, str(CHILD), str(folder), dtype, json.dumps(prompts), json.dumps(llm_kwargs)]
    return subprocess.run(args, capture_output=True, text=True, timeout=600)


def served(folder: Path, dtype: str = "float32", prompts=PROMPTS, **llm_kwargs) -> list[dict]:
    run = _child(folder, dtype, prompts, llm_kwargs)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))


def refused(folder: Path, **llm_kwargs) -> str:
    run = _child(folder, "float32", PROMPTS, llm_kwargs)
    assert run.returncode != 0 and "RESULT " not in run.stdout
    return run.stdout + run.stderr


def transformers_logprobs(folder: Path, dtype: str, prompts, results, heads: bool = True) -> list[torch.Tensor]:
    """log-softmax over each prompt + vLLM's greedy continuation, from transformers (trust_remote_code)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=getattr(torch, dtype)).eval()
    out = []
    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([prompt + result["tokens"]])
        with torch.no_grad(), contextlib.nullcontext() if heads else deltafy.disabled(model):
            out.append(torch.log_softmax(model(ids).logits[0].float(), -1))
    return out


def compare(prompts, results, reference, mean: bool = False) -> tuple[bool, float]:
    """(greedy tokens equal, max |Δ log-prob|) over every prompt position and every generated token; ``mean``:
    the mean |Δ log-prob| over them instead of the max."""
    same, worst, gaps = True, 0.0, []
    for prompt, result, lp in zip(prompts, results, reference, strict=True):
        n, tokens = len(prompt), result["tokens"]
        same &= lp[n - 1 : n - 1 + len(tokens)].argmax(-1).tolist() == tokens
        ours = torch.tensor(result["prompt_logprobs"] + result["logprobs"])
        ref = torch.cat(
            [
                lp[torch.arange(n - 1), torch.tensor(prompt[1:])],
                lp[torch.arange(n - 1, n - 1 + len(tokens)), torch.tensor(tokens)],
            ]
        )
        worst = max(worst, (ours - ref).abs().max().item())
        gaps.append((ours - ref).abs())
    return same, torch.cat(gaps).mean().item() if mean else worst


CASES = [
    ("llama", "ddl-scalar"),  # sublayer direction, strength gate
    ("llama", "ddl-learned"),  # learned direction (rank 16), strength gate
    ("llama", "ddl-scalar-logit"),  # sublayer direction, logit gate
    ("llama", "ddl-write-only"),  # the control without the erase term
    ("mistral", "ddl-scalar"),
    ("qwen2", "ddl-learned"),
    ("qwen3", "ddl-scalar"),
    ("gpt2", "ddl-scalar"),  # GPT-2's block: no fused add+norm
    ("gpt2", "ddl-learned"),
]


@pytest.mark.parametrize("family,recipe", CASES, ids=[f"{f}-{r}" for f, r in CASES])
def test_vllm_serves_the_heads(tmp_path, family, recipe):
    folder = converted(tmp_path / "delta", family, recipe)
    results = served(folder)
    same, worst = compare(PROMPTS, results, transformers_logprobs(folder, "float32", PROMPTS, results))
    _, stock = compare(PROMPTS, results, transformers_logprobs(folder, "float32", PROMPTS, results, heads=False))
    print(f"{family} {recipe}: max |Δ log-prob| vs transformers {worst:.2g}, vs the stock model {stock:.2g}")
    assert same and worst <= 1e-4
    assert stock > 1e-2  # served without its heads, this test would fail


def test_vllm_compiles_the_heads(tmp_path):
    """vLLM's default: the model compiled by torch.compile (inductor on CPU), the sites traced into it."""
    folder = converted(tmp_path / "delta", "llama", "ddl-learned")
    results = served(folder, enforce_eager=False)
    same, worst = compare(PROMPTS, results, transformers_logprobs(folder, "float32", PROMPTS, results))
    print(f"llama ddl-learned compiled: max |Δ log-prob| vs transformers {worst:.2g}")
    assert same and worst <= 1e-4


def test_the_transformers_backend_refuses_instead_of_serving_the_stock_model(tmp_path):
    folder = converted(tmp_path / "delta", "llama")
    said = refused(folder, model_impl="transformers", trust_remote_code=True)
    assert "residual sites ran" in said and "deltafy's plugin" in said


def test_the_plugin_refuses_what_it_does_not_serve_in_one_line(tmp_path):
    said = refused(converted(tmp_path / "expanded", "llama", "ddl-expanded"))
    assert "DeltafyError: deltafy's vLLM plugin serves the scalar DDL" in said


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(base_model_type="phi"), "does not serve the 'phi' family"),
        (dict(base={"id": "gpt2", "revision": "0" * 40}), "heads-only deltafy folder"),
        (dict(channels=4), "expanded stream (channels=4)"),
        (dict(sites=[{"name": "attn", "write": "self_attn", "stream": "input_layernorm", "scale": 0.5}]), "site map"),
    ],
)
def test_servable_names_why_not(tmp_path, change, message):
    section = json.loads((converted(tmp_path / "d", "llama") / "config.json").read_text())["deltafy"]
    with pytest.raises(DeltafyError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        servable(section | change)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory):
    """The bundled SmolLM2-135M: its stock weights, and a conversion whose heads `deltafy train` trained
    (the README's 16 steps on the Shakespeare the repo ships)."""
    from transformers import AutoTokenizer

    from deltafy.conversion.job import convert_source
    from deltafy.sources.load import load_source

    root = tmp_path_factory.mktemp("smollm")
    convert_source("smollm2-135m", root / "converted")
    text = Path(__file__).parents[2] / "examples" / "shakespeare" / "midsummer-acts-1-4.md"
    train = [sys.executable, "-m", "deltafy", "train", str(root / "converted"), "--data", str(text)]
    train += ["--out", str(root / "trained"), "--steps", "16", "--seq-len", "128"]
    run = subprocess.run(train, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    load_source("smollm2-135m").model.save_pretrained(root / "stock")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "converted" / name, root / "stock" / name)
    tokenizer = AutoTokenizer.from_pretrained(root / "converted", trust_remote_code=True)
    texts = ["The quick brown fox", "To be, or not to be, that is the question:"]
    return root, [tokenizer(text)["input_ids"] for text in texts]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_serves_smollm2_with_its_trained_heads(smollm, dtype):
    root, prompts = smollm
    results = served(root / "trained", dtype, prompts)
    same, worst = compare(prompts, results, transformers_logprobs(root / "trained", dtype, prompts, results))
    _, stock = compare(prompts, results, transformers_logprobs(root / "trained", dtype, prompts, results, heads=False))
    # the stock model through vLLM's own Llama: how far vLLM and transformers part in this dtype anyway
    base = served(root / "stock", dtype, prompts)
    stock_reference = transformers_logprobs(root / "stock", dtype, prompts, base)
    _, control = compare(prompts, base, stock_reference)
    _, typical = compare(prompts, results, transformers_logprobs(root / "trained", dtype, prompts, results), mean=True)
    _, typical_control = compare(prompts, base, stock_reference, mean=True)
    print(
        f"SmolLM2 {dtype}: max |Δ log-prob| vs transformers {worst:.2g} (the stock model's: {control:.2g}), "
        f"mean {typical:.2g} (the stock model's: {typical_control:.2g}), vs the stock model {stock:.2g}"
    )
    assert same and stock > 0.5  # trained heads move SmolLM2's log-probs by about a nat
    if dtype == "float32":
        assert worst <= 1e-4
    else:  # bf16: the engines round differently anyway (the stock model's own gap); no worse than that, typically,
        # and the largest gap far below what serving the model without its heads would give
        assert typical <= 2 * typical_control and worst <= stock / 3


@pytest.mark.slow
def test_lm_eval_harness_scores_what_the_folder_holds(smollm, monkeypatch):
    """lm-evaluation-harness's hf route (the docs' evaluation route) on the repo's local task: a fresh
    conversion scores as its stock model, the trained heads score otherwise."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    root, _ = smollm
    repo = Path(__file__).parents[2]
    monkeypatch.chdir(repo)  # the task's data_files path is the repository's
    tasks = TaskManager(include_path=str(repo / "examples" / "lm-eval"))

    def bits_per_byte(folder: str) -> float:
        args = f"pretrained={root / folder},trust_remote_code=True,dtype=float32"
        out = lm_eval.simple_evaluate(
            model="hf", model_args=args, tasks=["midsummer"], task_manager=tasks, limit=4, device="cpu"
        )
        return out["results"]["midsummer"]["bits_per_byte,none"]

    stock, converted, trained = (bits_per_byte(folder) for folder in ("stock", "converted", "trained"))
    print(f"lm-eval midsummer bits/byte: stock {stock:.6f}, converted {converted:.6f}, trained {trained:.6f}")
    assert converted == pytest.approx(stock, abs=1e-6)
    assert abs(trained - stock) > 1e-3
