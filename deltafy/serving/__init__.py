"""deltafy in serving engines. vLLM finds ``register`` through the ``vllm.general_plugins`` entry point
(pyproject.toml) in every process it starts; the model class itself (deltafy.serving.vllm) is imported
only when vLLM builds a deltafy checkpoint, as vLLM's lazy "module:Class" form asks."""

from __future__ import annotations

ARCHITECTURE = "DeltafyForCausalLM"  # the architectures entry of every deltafy checkpoint's config.json


def register() -> None:
    """Serve deltafy checkpoints with vLLM's own model code and deltafy's heads, and read their configs
    without running the checkpoint's remote code."""
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "deltafy.serving.vllm:DeltafyForCausalLM")
    from .config import register_config

    register_config()
