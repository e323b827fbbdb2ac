from rich.markup import escape
from rich.table import Table

from ..options import DEFAULT_RECIPE, bundled_recipes, load_recipe
from ._console import console


def recipes_command() -> None:
    """List the bundled recipes. Pass a name, or a path to your own YAML file, to --recipe."""
    table = Table("name", "direction", "channels", "gate at init", "description", box=None)
    for name in bundled_recipes():
        recipe = load_recipe(name)
        direction = recipe.direction + (f" (rank {recipe.rank})" if recipe.rank else "")
        label = name + (" (default)" if name == DEFAULT_RECIPE else "")
        gate = "strength α = 0" if recipe.gate == "strength" else f"logit {recipe.gate_bias:g}"
        cells = (label, direction, str(recipe.channels), gate, recipe.description)
        table.add_row(*map(escape, cells))  # a Table reads its cells as markup; a description is plain text
    console.print(table)
