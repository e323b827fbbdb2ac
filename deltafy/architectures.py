"""Where each supported decoder family writes to its residual stream, as data.

A *site* is one residual write ``x <- x + scale * h`` inside a decoder layer:

- ``write``: the module whose output is h (the last module before the addition);
- ``stream``: the module whose first input is the stream x at that write ("" = the layer);
- ``context``: ``"output"`` if c is the stream module's output (pre-norm), ``"input"`` if the
  sublayer sees the raw stream (post-LN OPT, OLMo 2);
- ``norm_after``: a norm applied to ``x + h`` before the next site (post-LN only).

Layouts are keyed by ``model_type``; families with several layouts pick one from config fields.
The self-check in :mod:`deltafy.conversion.verify` proves on real activations that a layout's residual
algebra holds for the model at hand, so a wrong entry fails loudly instead of converting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .errors import DeltafyError
from .modeling_deltafy import SiteSpec as Site


@dataclass(frozen=True)
class Layout:
    layers: str
    sites: tuple[Site, ...]
    parallel: bool = False  # every site reads the same x and the writes are summed
    description: str = "sequential pre-norm"


@dataclass(frozen=True)
class Architecture:
    layers: str
    choose: Callable[[Any], tuple[tuple[Site, ...], bool, str]]
    scale_attr: str | None = None  # config field by which the layer multiplies every write


def _fixed(sites: tuple[Site, ...], parallel: bool = False, description: str = "sequential pre-norm"):
    return lambda config: (sites, parallel, description)


PRE_NORM = (
    Site("attn", write="self_attn", stream="input_layernorm"),
    Site("mlp", write="mlp", stream="post_attention_layernorm"),
)
SANDWICH = (  # Gemma 2/3: the post-norm's output is what the stream receives
    Site("attn", write="post_attention_layernorm", stream="input_layernorm"),
    Site("mlp", write="post_feedforward_layernorm", stream="pre_feedforward_layernorm"),
)
OLMO2 = (  # norm after the sublayer only: the sublayer reads the raw stream
    Site("attn", write="post_attention_layernorm", stream="self_attn", context="input"),
    Site("mlp", write="post_feedforward_layernorm", stream="mlp", context="input"),
)
PARALLEL_ONE_NORM = (
    Site("attn", write="self_attn", stream="input_layernorm"),
    Site("mlp", write="mlp", stream="input_layernorm"),
)
PHI3 = (
    Site("attn", write="resid_attn_dropout", stream="input_layernorm"),
    Site("mlp", write="resid_mlp_dropout", stream="post_attention_layernorm"),
)
GPT2 = (
    Site("attn", write="attn", stream="ln_1"),
    Site("mlp", write="mlp", stream="ln_2"),
)
GPTJ = (
    Site("attn", write="attn", stream="ln_1"),
    Site("mlp", write="mlp", stream="ln_1"),
)
GPT_NEOX = (  # one map fits both layouts: post_attention_layernorm reads x (parallel) or x + attn
    Site("attn", write="post_attention_dropout", stream="input_layernorm"),
    Site("mlp", write="post_mlp_dropout", stream="post_attention_layernorm"),
)


def _gpt_neox(config):
    if config.use_parallel_residual:
        return GPT_NEOX, True, "parallel residual (two norms)"
    return GPT_NEOX, False, "sequential pre-norm"


def _opt(config):
    if config.do_layer_norm_before:
        sites = (
            Site("attn", write="self_attn", stream="self_attn_layer_norm"),
            Site("mlp", write="fc2", stream="final_layer_norm"),
        )
        return sites, False, "sequential pre-norm"
    sites = (
        Site("attn", write="self_attn", stream="self_attn", context="input", norm_after="self_attn_layer_norm"),
        Site("mlp", write="fc2", stream="fc1", context="input", norm_after="final_layer_norm"),
    )
    return sites, False, "post-LN (norm after each addition)"


def _falcon(config):
    if config.new_decoder_architecture:
        if config.num_ln_in_parallel_attn == 2:
            sites = (
                Site("attn", write="self_attention", stream="ln_attn"),
                Site("mlp", write="mlp", stream="ln_mlp"),
            )
            return sites, True, "parallel, two norms (new decoder architecture)"
        sites = (
            Site("attn", write="self_attention", stream="input_layernorm"),
            Site("mlp", write="mlp", stream="input_layernorm"),
        )
        return sites, True, "parallel, one norm (new decoder architecture)"
    if config.parallel_attn:
        sites = (
            Site("attn", write="self_attention", stream="input_layernorm"),
            Site("mlp", write="mlp", stream="input_layernorm"),
        )
        return sites, True, "parallel, one norm"
    sites = (
        Site("attn", write="self_attention", stream="input_layernorm"),
        Site("mlp", write="mlp", stream="post_attention_layernorm"),
    )
    return sites, False, "sequential pre-norm"


def _stablelm(config):
    if config.use_parallel_residual:
        return PARALLEL_ONE_NORM, True, "parallel, one norm"
    return PRE_NORM, False, "sequential pre-norm"


_llama_like = Architecture("model.layers", _fixed(PRE_NORM))

ARCHITECTURES: dict[str, Architecture] = {
    "gpt2": Architecture("transformer.h", _fixed(GPT2)),
    "llama": _llama_like,
    "mistral": _llama_like,
    "mixtral": _llama_like,
    "qwen2": _llama_like,
    "qwen2_moe": _llama_like,
    "qwen3": _llama_like,
    "qwen3_moe": _llama_like,
    "gemma": _llama_like,
    "gemma2": Architecture("model.layers", _fixed(SANDWICH, description="sandwich norm")),
    "gemma3_text": Architecture("model.layers", _fixed(SANDWICH, description="sandwich norm")),
    "phi": Architecture("model.layers", _fixed(PARALLEL_ONE_NORM, True, "parallel, one norm")),
    "phi3": Architecture("model.layers", _fixed(PHI3)),
    "gpt_neox": Architecture("gpt_neox.layers", _gpt_neox),
    "gptj": Architecture("transformer.h", _fixed(GPTJ, True, "parallel, one norm")),
    "opt": Architecture("model.decoder.layers", _opt),
    "falcon": Architecture("transformer.h", _falcon),
    "olmo": _llama_like,
    "olmo2": Architecture("model.layers", _fixed(OLMO2, description="post-sublayer norm")),
    "starcoder2": _llama_like,
    "granite": Architecture("model.layers", _fixed(PRE_NORM), scale_attr="residual_multiplier"),
    "cohere": Architecture("model.layers", _fixed(PARALLEL_ONE_NORM, True, "parallel, one norm")),
    "stablelm": Architecture("model.layers", _stablelm),
    "smollm3": _llama_like,
}

SUPPORTED = tuple(sorted(ARCHITECTURES))

# Families that are not decoder-only language models get a more helpful message.
_NOT_DECODERS = {
    "bert",
    "roberta",
    "distilbert",
    "albert",
    "electra",
    "deberta",
    "deberta-v2",
    "t5",
    "mt5",
    "bart",
    "mbart",
    "pegasus",
    "marian",
    "whisper",
    "vit",
    "clip",
}


def layout_for(config) -> Layout:
    """The residual layout of ``config``'s model family, or a DeltafyError naming what is supported."""
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        kind = "an encoder or encoder-decoder model" if model_type in _NOT_DECODERS else "not supported"
        raise DeltafyError(
            f"model type {model_type!r} is {kind}; deltafy converts decoder-only LLMs of these "
            f"types: {', '.join(SUPPORTED)}"
        )
    sites, parallel, description = arch.choose(config)
    return Layout(layers=arch.layers, sites=sites, parallel=parallel, description=description)


def site_specs(config, site_names: tuple[str, ...] | None = None) -> tuple[Site, ...]:
    """The sites to convert in ``config``'s model, each with the layer's scale on its write."""
    arch = ARCHITECTURES[config.model_type]
    scale = float(getattr(config, arch.scale_attr)) if arch.scale_attr else 1.0
    sites = layout_for(config).sites
    return tuple(replace(s, scale=scale) for s in sites if site_names is None or s.name in site_names)
