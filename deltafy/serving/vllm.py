"""deltafy checkpoints in vLLM: the base family's own vLLM model, each decoder layer's residual writes passed
through the checkpoint's DeltaSites (deltafy.modeling_deltafy, the one implementation of the math) before
vLLM adds them to the stream, the heads loaded by vLLM's loader with the rest of the weights.

A layout is a decoder layer's forward written out again with the sites in it: vLLM's pre-norm layers add
the attention write inside the next norm (``norm(h, residual)`` returns the sum as the new residual), so
the site has to change h before that call, where the stream x is ``residual`` and the context c the
normed input the sublayer read. What the table does not name is refused in one line, never served
without its heads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deltafy.modeling_deltafy import DeltafyError, DeltaSite, DeltaSpec, SiteSpec


def _pre_norm(layer, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, **kwargs):
    # vLLM's LlamaDecoderLayer.forward (and Qwen2's, Qwen3's, Mistral's), each write through its site
    if residual is None:
        residual, hidden_states = hidden_states, layer.input_layernorm(hidden_states)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    h = layer.self_attn(positions=positions, hidden_states=hidden_states)
    h = layer.delta["attn"](residual, hidden_states, h)
    hidden_states, residual = layer.post_attention_layernorm(h, residual)
    return layer.delta["mlp"](residual, hidden_states, layer.mlp(hidden_states)), residual


def _gpt2(layer, hidden_states: torch.Tensor):
    # vLLM's GPT2Block.forward, each write through its site
    c = layer.ln_1(hidden_states)
    x = hidden_states + layer.delta["attn"](hidden_states, c, layer.attn(hidden_states=c))
    c = layer.ln_2(x)
    return x + layer.delta["mlp"](x, c, layer.mlp(c))


@dataclass(frozen=True)
class Layout:
    sites: tuple[SiteSpec, ...]  # the site map the forward is written for, as deltafy's conversion writes it
    forward: Callable


_PRE_NORM = Layout(
    (SiteSpec("attn", "self_attn", "input_layernorm"), SiteSpec("mlp", "mlp", "post_attention_layernorm")),
    _pre_norm,
)
# base_model_type -> layout of vLLM's model for that family (resolved by the config's base_architecture)
LAYOUTS: dict[str, Layout] = {
    "llama": _PRE_NORM,  # SmolLM2 too
    "mistral": _PRE_NORM,
    "qwen2": _PRE_NORM,
    "qwen3": _PRE_NORM,
    "gpt2": Layout((SiteSpec("attn", "attn", "ln_1"), SiteSpec("mlp", "mlp", "ln_2")), _gpt2),
}


def servable(section) -> tuple[DeltaSpec, Layout]:
    """The spec and layout of a config's deltafy section, or a one-line DeltafyError saying why the plugin
    does not serve it and what does."""
    spec = DeltaSpec.from_dict(section)
    family = section.get("base_model_type")
    elsewhere = "serve it with transformers (AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))"
    if family not in LAYOUTS:
        raise DeltafyError(
            f"deltafy's vLLM plugin does not serve the {family!r} family (it serves {', '.join(sorted(LAYOUTS))}); "
            f"{elsewhere}"
        )
    if "base" in section:
        raise DeltafyError(
            "this is a heads-only deltafy folder, and vLLM loads full weights: save a full copy "
            "(deltafy.save(deltafy.load(DIR), OUT)) and serve that"
        )
    if spec.channels > 1:
        raise DeltafyError(
            f"deltafy's vLLM plugin serves the scalar DDL; this checkpoint has an expanded stream "
            f"(channels={spec.channels}): {elsewhere}"
        )
    layout = LAYOUTS[family]
    if spec.sites != layout.sites:
        raise DeltafyError(
            f"this checkpoint's site map ({', '.join(f'{s.stream} -> {s.write}' for s in spec.sites)}) is not the "
            f"one deltafy's vLLM plugin serves for {family}: {elsewhere}"
        )
    return spec, layout


@functools.cache
def _with_sites(layer_class: type, forward: Callable) -> type:
    # a class-level forward (vLLM compiles the model's forward, which traces the layers' classes)
    return type(f"Deltafy{layer_class.__name__}", (layer_class,), {"forward": forward})


class DeltafyForCausalLM(nn.Module):
    """vLLM's model of the checkpoint's base family (``stock``) with a DeltaSite on every residual write."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.utils import PPMissingLayer

        model_config = vllm_config.model_config
        section = getattr(model_config.hf_config, "deltafy", None)
        if not isinstance(section, dict):
            raise DeltafyError("this config has no deltafy section: convert the model with deltafy first")
        spec, layout = servable(section)
        stock_class, _ = ModelRegistry.resolve_model_cls([section["base_architecture"]], model_config)
        self.stock = stock_class(vllm_config=vllm_config, prefix=prefix)
        for layer in self.stock.get_submodule(spec.layers):
            if isinstance(layer, PPMissingLayer):  # another pipeline stage's layer
                continue
            layer.delta = nn.ModuleDict({site.name: DeltaSite(spec, site) for site in spec.sites})
            layer.__class__ = _with_sites(type(layer), layout.forward)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.stock.embed_input_ids(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, *args, **kwargs):
        return self.stock(input_ids, positions, *args, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.stock.compute_logits(hidden_states)

    def load_weights(self, weights) -> set[str]:
        # the checkpoint's names are the stock model's (the heads: <layer>.delta.<site>.<head>)
        return {f"stock.{name}" for name in self.stock.load_weights(weights)}
