import textwrap

from rich.text import Text

from ..recipe import DEFAULT_RECIPE, bundled_recipes, load_recipe
from ._console import console


def recipes_command() -> None:
    """List the bundled recipes. Pass a name, or a path to your own YAML file, to --recipe."""
    names = sorted(bundled_recipes(), key=lambda name: name != DEFAULT_RECIPE)  # the default first
    labels = {name: name + " (default)" * (name == DEFAULT_RECIPE) for name in names}
    width, indent = max(map(len, labels.values())), " " * 4
    for name in names:  # a line of settings, the description wrapped under it: readable at 80 columns
        recipe = load_recipe(name)
        direction = f"direction {recipe.direction}" + (f" (rank {recipe.rank})" if recipe.rank else "")
        gate = "strength α = 0" if recipe.gate == "strength" else f"gate logit {recipe.gate_bias:g}"
        settings = f"  {direction} · d_v = {recipe.channels} · {gate}"
        console.print(Text.assemble((f"{labels[name]:<{width}}", "bold"), settings))
        text = textwrap.fill(
            recipe.description, max(console.width, 40), initial_indent=indent, subsequent_indent=indent
        )
        console.print(text, markup=False)  # (a description is plain text, not markup)
