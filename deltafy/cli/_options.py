"""Option types shared by several commands, and flags generated from a pydantic options model."""

from __future__ import annotations

import inspect
import types
import typing
from typing import Annotated, Any, get_args, get_origin

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from rich.markup import escape

from ..errors import DeltafyError

RecipeOpt = Annotated[
    str,
    typer.Option("--recipe", "-r", help="Bundled recipe name (see `deltafy recipes`) or a YAML file."),
]
# A flag that is off unless given: typer shows no default for it, so it is named here.
OFF = "off"


def described(text: str, default: str) -> dict:
    """``help=`` and ``show_default=`` of a flag whose default is a description (off, the recipe's) rather than a
    value: shown as typer shows a value, a dim ``[default: off]`` after the help (typer would show ``(off)``)."""
    return {"help": f"{escape(text)} [dim]{escape(f'[default: {default}]')}[/dim]", "show_default": False}


def sentence(description: str) -> str:
    """A field's description, a phrase ("learning rate of the heads"), as a flag's help: a sentence."""
    return description[:1].upper() + description[1:] + ("" if description.endswith(".") else ".")


BaseOpt = Annotated[
    str | None,
    typer.Option(
        "--base",
        metavar="PATH",
        **described(
            "Where a heads-only checkpoint's base model is now, if it moved (checked against its hashes).",
            "where the checkpoint says",
        ),
    ),
]
OverwriteOpt = Annotated[
    bool, typer.Option("--overwrite", **described("Replace --out if it already holds files.", OFF))
]


def _flag_type(annotation: Any) -> Any:
    """The type click parses a field's flag as: ``X | None`` is X, and pydantic already moved
    constraints (PositiveInt's ``> 0``) out of the annotation; pydantic checks them afterwards,
    all at once. Literals stay Literals: typer shows and checks their choices."""
    if get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = (a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _field_option(
    name: str, field: FieldInfo, spelling: str | tuple[str, ...] | None, panel: str | None, source: str | None
) -> inspect.Parameter:
    """One keyword-only parameter, defaulting to None: an unset flag keeps the recipe's value."""
    kind = _flag_type(field.annotation)
    default = field.default
    # what an unset flag means where the model's None does not say it (``{"shown": "cpu"}``)
    shown = field.json_schema_extra.get("shown") if isinstance(field.json_schema_extra, dict) else None
    choices, extra = "", {}
    if kind is bool:
        spelling = spelling or f"--{name.replace('_', '-')}/--no-{name.replace('_', '-')}"
        default = "on" if default else "off"
    if get_origin(kind) is typing.Literal:  # choices in the help: typer's <a|b|c> type column crowds out the flags
        choices = f" ({' | '.join(get_args(kind))})"
        extra["metavar"] = "CHOICE"
    if get_origin(kind) is list:  # one comma-separated value, as people type module lists
        numbers = _flag_type(get_args(kind)[0]) in (float, int)
        kind, extra = str, {"parser": _comma_list, "metavar": "X,..." if numbers else "NAME,..."}
    if isinstance(default, list):  # as it is typed: 0.3,1,3
        default = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in default)
    # The effective default may be the recipe's (--recipe, else the checkpoint's) rather than the model's.
    shown = shown or ("unset" if default is None else default)
    option = typer.Option(
        *((spelling,) if isinstance(spelling, str) else spelling or ("--" + name.replace("_", "-"),)),
        **described(sentence(field.description + choices), f"{shown}, or {source}" if source else str(shown)),
        rich_help_panel=panel,
        **extra,
    )
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[kind | None, option]
    )


def with_model_options(
    model: type[BaseModel],
    panel: str | None = None,
    spellings: dict[str, str | tuple[str, ...]] | None = None,
    source: str | None = "the recipe's",
    sourced: set[str] | None = None,
):
    """Give a command one flag per field of ``model`` in place of its ``**flags`` parameter.

    The model is the single source of each flag's name (``seq_len`` -> ``--seq-len``), type,
    choices, help (the field's description) and shown default; booleans become
    ``--flag/--no-flag`` unless ``spellings`` names them otherwise (a tuple: with a short form). Typer reads a command's
    parameters from its signature, so the generated ones are put there. The command receives
    every field in ``flags``, None where the flag was not given; ``source`` says in the help where
    a flag left out takes its value from (for the fields in ``sourced``; default: every field).
    """

    def decorate(func):
        signature = inspect.signature(func, eval_str=True)
        fixed = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        clash = {p.name for p in fixed} & model.model_fields.keys()
        assert not clash, f"command parameters shadow {model.__name__} fields: {clash}"
        generated = [
            _field_option(
                name, field, (spellings or {}).get(name), panel, source if name in (sourced or {name}) else None
            )
            for name, field in model.model_fields.items()
        ]
        func.__signature__ = signature.replace(parameters=fixed + generated)
        return func

    return decorate


DATA_OPTIONS, EVAL_OPTIONS = ("--data", "-d"), ("--eval-data",)


def extra_text_paths(ctx) -> tuple[list[str], list[str]]:
    """Paths past an option's first value (a shell glob expands ``--eval-data held/*.md`` into many),
    as (training text, held-out text): each belongs to the option it follows on the command line.
    Held-out text read as training text would make every held-out number meaningless."""
    from ._console import state

    data, held = [], []
    pending = list(ctx.args)
    owner = None
    for token in state.argv if pending else ():
        if token.startswith("-"):
            owner = token.split("=", 1)[0]
        elif pending and token == pending[0]:
            if owner in DATA_OPTIONS:
                data.append(pending.pop(0))
            elif owner in EVAL_OPTIONS:
                held.append(pending.pop(0))
    if pending:
        raise DeltafyError(f"unexpected argument {pending[0]!r}; paths of text follow --data or --eval-data")
    return data, held
