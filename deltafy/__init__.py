"""deltafy: turn a pretrained Hugging Face decoder into a Deep Delta Learning model.

import deltafy
model = deltafy.convert(model)              # in place; outputs unchanged at init
deltafy.save(model, "out", tokenizer=tok)   # self-contained checkpoint folder
model = deltafy.load("out")                 # deltafy's own classes, no remote code
with deltafy.disabled(model): ...           # every correction off: the original model
deltafy.unconvert(model)                    # heads removed, original forwards restored
"""

__version__ = "0.1.0"

from .checkpoint import load, load_tokenizer, save
from .convert import convert, head_parameter_groups, summarize, unconvert
from .errors import DeltafyError
from .modeling_deltafy import disabled
from .recipe import Recipe, load_recipe
from .verify import CheckReport

__all__ = [
    "convert",
    "unconvert",
    "disabled",
    "save",
    "load",
    "load_tokenizer",
    "summarize",
    "head_parameter_groups",
    "Recipe",
    "load_recipe",
    "DeltafyError",
    "CheckReport",
    "__version__",
]
