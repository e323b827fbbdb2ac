"""deltafy: turn a pretrained Hugging Face decoder into a Deep Delta Learning model.

import deltafy
model = deltafy.convert(model)              # in place; outputs unchanged at init
deltafy.save(model, "out", tokenizer=tok)   # self-contained checkpoint folder
model = deltafy.load("out")                 # deltafy's own classes, no remote code
with deltafy.disabled(model): ...           # every correction off: the original model
deltafy.unconvert(model)                    # heads removed, original forwards restored
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported on first use: the command line starts (and takes over Ctrl-C) before torch is loaded.
_EXPORTS = {
    "convert": ".surgery",
    "unconvert": ".surgery",
    "summarize": ".surgery",
    "head_parameter_groups": ".surgery",
    "disabled": ".modeling_deltafy",
    "save": ".checkpoint",
    "load": ".checkpoint",
    "load_tokenizer": ".checkpoint",
    "Recipe": ".recipe",
    "load_recipe": ".recipe",
    "DeltafyError": ".errors",
    "CheckReport": ".conversion.verify",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deltafy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [*_EXPORTS, "__version__"]
