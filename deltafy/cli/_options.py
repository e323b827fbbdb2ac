"""Option types shared by several commands."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer


class DType(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


RecipeOpt = Annotated[
    str,
    typer.Option("--recipe", "-r", help="Bundled recipe name (see `deltafy recipes`) or a YAML file."),
]
DTypeOpt = Annotated[DType, typer.Option("--dtype", help="Precision to load and save the model in.")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace --out if it already holds files.")]
