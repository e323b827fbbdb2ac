"""Tiny random models of every supported family (built from AutoConfig), gates set by hand, and
children that prove they run without deltafy."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import torch

from deltafy.modeling_deltafy import DeltaRead
from deltafy.surgery import delta_sites

_SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)

# case name -> (model_type, config overrides). Every supported layout appears at least once.
TINY_CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-untied": ("llama", dict(tie_word_embeddings=False)),
    "mistral": ("mistral", {}),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", {}),
    "qwen2_moe": (
        "qwen2_moe",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)),
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": ("gemma2", dict(head_dim=16)),
    "gemma3_text": ("gemma3_text", dict(head_dim=16)),
    "phi": ("phi", {}),
    "phi3": ("phi3", dict(pad_token_id=0, eos_token_id=1, bos_token_id=1)),
    "gpt_neox-parallel": ("gpt_neox", dict(use_parallel_residual=True)),
    "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False)),
    "gptj": (
        "gptj",
        dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=128, bos_token_id=0, eos_token_id=0),
    ),
    "opt-pre-ln": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=True)),
    "opt-post-ln": ("opt", dict(ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=False)),
    "falcon-new-2ln": ("falcon", dict(new_decoder_architecture=True, num_ln_in_parallel_attn=2, num_kv_heads=2)),
    "falcon-new-1ln": ("falcon", dict(new_decoder_architecture=True, num_ln_in_parallel_attn=1, num_kv_heads=2)),
    "falcon-parallel": ("falcon", dict(new_decoder_architecture=False, parallel_attn=True)),
    "falcon-sequential": ("falcon", dict(new_decoder_architecture=False, parallel_attn=False)),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "starcoder2": ("starcoder2", {}),
    "granite": ("granite", dict(residual_multiplier=0.22)),
    "cohere": ("cohere", {}),
    "stablelm-parallel": ("stablelm", dict(use_parallel_residual=True)),
    "stablelm-sequential": ("stablelm", dict(use_parallel_residual=False)),
    "smollm3": ("smollm3", dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}


def tiny_config(case: str, layers: int | None = None):
    from transformers import AutoConfig

    model_type, overrides = TINY_CASES[case]
    kwargs = {} if model_type in ("gpt2", "gptj") else dict(_SMALL)
    kwargs.update(overrides)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_model(case: str, seed: int = 0, layers: int | None = None):
    """A randomly initialized tiny model of ``case`` in eval mode (deterministic per seed)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(case, layers)).eval()


@contextlib.contextmanager
def gates_at(model: torch.nn.Module, beta: float):
    """Pin every gate of a converted model (or one DeltaSite) at ``beta`` in {0, 1, 2}, exactly in
    fp32 (a zero gate weight and a logit of -200, 0 or +200; a strength of 1 where the site has one),
    and restore the gates afterwards."""
    from deltafy.modeling_deltafy import DeltaSite

    logit = {0.0: -200.0, 1.0: 0.0, 2.0: 200.0}[float(beta)]
    sites = [model] if isinstance(model, DeltaSite) else [m for m in model.modules() if isinstance(m, DeltaSite)]
    saved = [[p.detach().clone() for p in (s.gate.weight, s.gate.bias, s.strength) if p is not None] for s in sites]
    with torch.no_grad():
        for site in sites:
            site.gate.weight.zero_()
            site.gate.bias.fill_(logit)
            if site.strength is not None:
                site.strength.fill_(1.0)
    try:
        yield
    finally:
        with torch.no_grad():
            for site, values in zip(sites, saved, strict=True):
                params = [p for p in (site.gate.weight, site.gate.bias, site.strength) if p is not None]
                for param, value in zip(params, values, strict=True):
                    param.copy_(value)


def open_gates(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every head of a converted model a visible effect, so a misrouted tensor shows in the logits."""
    from deltafy.modeling_deltafy import DeltaSite

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for site in (m for m in model.modules() if isinstance(m, DeltaSite)):
            site.gate.bias.fill_(0.0)
            site.gate.weight.copy_(0.5 * torch.randn(site.gate.weight.shape, generator=gen))
            site.target.weight.copy_(0.5 * torch.randn(site.target.weight.shape, generator=gen))
            site.target.bias.fill_(0.3)
            if site.strength is not None:  # gate: strength, zero at init
                site.strength.fill_(1.0)


# Child processes that must prove they run without deltafy: `python -I` (no cwd on sys.path, no
# PYTHON* variables) plus this preamble, which makes deltafy unimportable and checks it.
DELTAFY_FREE_PREAMBLE = r"""
import sys
sys.modules["deltafy"] = None
try:
    import deltafy  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("deltafy is importable in the child process")
"""


def run_deltafy_free(child: str, args: list[str], cwd: Path) -> dict:
    """Run ``child`` (which starts with DELTAFY_FREE_PREAMBLE) in `python -I` with ``args`` and the
    path of a result file appended; return the dict it saved there, once sure no deltafy module
    was loaded in it. Remote code is cached under ``cwd``."""
    result_file = cwd / "child-results.pt"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "hf_modules"), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, "-I", "-c", child, *args, str(result_file)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = torch.load(result_file, weights_only=True)
    assert data["deltafy_modules"] == [], f"the child imported deltafy: {data['deltafy_modules']}"
    return data


def fixed_ids(model) -> torch.Tensor:
    vocab = model.get_input_embeddings().num_embeddings
    return torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def randomize_heads(model, seed: int = 0) -> None:
    """Open the gates (logit 0, beta = 1) and give the targets random weights."""
    gen = torch.Generator().manual_seed(seed)
    for _, site in delta_sites(model):
        site.gate.bias.zero_()
        site.gate.weight.copy_(torch.randn(site.gate.weight.shape, generator=gen) * 0.1)
        site.target.weight.copy_(torch.randn(site.target.weight.shape, generator=gen))
        site.target.bias.copy_(torch.randn(site.target.bias.shape, generator=gen))
        if site.strength is not None:  # gate: strength, zero at init
            site.strength.fill_(1.0)
    for module in model.modules():  # an expanded stream's reads
        if isinstance(module, DeltaRead):
            module.weight.copy_(torch.rand(module.weight.shape, generator=gen) / module.channels)
