from rich.markup import escape
from rich.table import Table

from ..recipe import DEFAULT_RECIPE, bundled_recipes, load_recipe
from ._console import console


def recipes_command() -> None:
    """List the bundled recipes. Pass a name, or a path to your own YAML file, to --recipe."""
    table = Table("name", "direction", "sites", "gate init", "description", box=None)
    for name in bundled_recipes():
        recipe = load_recipe(name)
        direction = recipe.direction + (f" (rank {recipe.rank})" if recipe.rank else "")
        label = name + (" (default)" if name == DEFAULT_RECIPE else "")
        cells = (label, direction, ",".join(recipe.sites), f"{recipe.gate_bias:g}", recipe.description)
        table.add_row(*map(escape, cells))  # a Table reads its cells as markup; a description is plain text
    console.print(table)
