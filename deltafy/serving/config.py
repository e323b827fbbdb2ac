"""The ``deltafy`` model type for transformers' AutoConfig, so that vLLM reads a deltafy checkpoint's
config.json without running the modeling file inside it (no ``--trust-remote-code``)."""

from __future__ import annotations

import functools

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


@functools.cache
def _family_config(base_model_type: str) -> type[PretrainedConfig]:
    # the checkpoint's own DeltafyConfig is this: its base family's config under the model_type "deltafy"
    family = CONFIG_MAPPING[base_model_type]
    return type("DeltafyConfig", (family,), {"model_type": "deltafy", "__module__": __name__})


class DeltafyConfig(PretrainedConfig):
    """Builds the base family's config (with the ``deltafy`` section) from a deltafy config.json."""

    model_type = "deltafy"

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        section = config_dict.get("deltafy")
        base = section.get("base_model_type") if isinstance(section, dict) else None
        if base not in CONFIG_MAPPING:
            raise ValueError(
                f"this deltafy config names no base family transformers knows ({base!r}); convert it again with deltafy"
            )
        return _family_config(base).from_dict(config_dict, **kwargs)


def register_config() -> None:
    if "deltafy" not in CONFIG_MAPPING:
        AutoConfig.register("deltafy", DeltafyConfig)
