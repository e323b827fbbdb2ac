"""The ``deltafy`` app: one module per command, all of them thin layers over the library."""

from __future__ import annotations

import sys

import click
import typer
from rich.markup import escape

from .. import interrupts
from ..errors import MORE_MEMORY, DeltafyError, Interrupted, first_line, out_of_memory
from ._console import console, err_console, state
from ._options import OFF, described
from .bench import bench_command
from .cache import cache_app
from .convert import convert_command
from .eval import eval_command
from .inspect import inspect_command
from .push import push_command
from .recipes import recipes_command
from .train import train_command

app = typer.Typer(
    name="deltafy",
    help="Turn a pretrained Hugging Face decoder into a Deep Delta Learning model, train it, ship it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def versions() -> str:
    """deltafy's version and those of what it runs on, in one line: what a bug report needs."""
    import importlib.metadata
    import platform

    import torch

    from .. import __version__

    def installed(name: str) -> str:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            return f"{name} not installed"

    # torch's own string names its build (2.15.0+cu132), which a CUDA wheel's package metadata does not
    runs_on = [f"deltafy {__version__}", f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    return " · ".join([*runs_on, *map(installed, ("transformers", "peft", "safetensors", "accelerate", "triton"))])


def _show_version(value: bool) -> None:
    if value:
        console.print(versions(), highlight=False, markup=False)
        raise typer.Exit()


@app.callback()
def _global(
    debug: bool = typer.Option(False, "--debug", **described("Show full tracebacks on errors.", OFF)),
    version: bool = typer.Option(
        False,
        "--version",
        callback=_show_version,
        is_eager=True,
        **described("Show the versions of deltafy, Python and the libraries it runs on, and exit.", OFF),
    ),
) -> None:
    state.debug = debug


try:  # recent typer vendors its own click: its usage errors are not the click package's classes
    from typer._click.exceptions import ClickException as _TyperClickException
except ImportError:  # older typer raises click's own
    _TyperClickException = click.ClickException
_CLICK_ERRORS = (click.ClickException, _TyperClickException)
_EXITS = (click.exceptions.Exit, typer.Exit)
_ABORTS = (KeyboardInterrupt, click.exceptions.Abort, typer.Abort)

app.command("convert", no_args_is_help=True)(convert_command)
_MANY = {"allow_extra_args": True}  # extra paths after --data
app.command("train", no_args_is_help=True, context_settings=_MANY)(train_command)
app.command("eval", no_args_is_help=True, context_settings=_MANY)(eval_command)
app.command("inspect", no_args_is_help=True)(inspect_command)
app.command("recipes")(recipes_command)
app.command("push", no_args_is_help=True)(push_command)
app.command("bench", no_args_is_help=True, context_settings=_MANY)(bench_command)
app.add_typer(cache_app, name="cache")


def run(args: list[str]) -> None:
    """The command line ``args``, with every failure turned into one line on stderr and an exit code.

    Exit codes: 1 for an error (``error: ...`` for a DeltafyError, which says what to do, or
    ``internal error ...`` for a bug in deltafy), 2 for a usage error (click's), 130 / 143 when
    interrupted by SIGINT / SIGTERM (deltafy.cli.main says so). With ``--debug`` errors propagate
    instead: Python prints the whole traceback, including the exception a DeltafyError was raised from.
    """
    try:
        # standalone_mode=False: typer returns the code of a typer.Exit (and 130 for an interrupt it
        # caught) instead of exiting; a code that is not 0 must still reach the shell.
        code = app(args=args, prog_name="deltafy", standalone_mode=False)
    except DeltafyError as err:
        if _by_the_interrupt(err):
            raise KeyboardInterrupt from err
        if state.debug:
            raise
        # escape(): a message's own brackets ("[attn, mlp]") are text, not rich markup to drop.
        err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        sys.exit(interrupts.exit_code(err.signum) if isinstance(err, Interrupted) else 1)
    except _EXITS as err:
        sys.exit(err.exit_code)
    except _CLICK_ERRORS as err:
        err.show()
        sys.exit(err.exit_code)
    except _ABORTS:
        raise KeyboardInterrupt from None  # deltafy.cli.main reports it
    except Exception as err:
        if _by_the_interrupt(err):
            raise KeyboardInterrupt from err
        if (line := _out_of_memory(err, args)) is not None and not state.debug:
            err_console.print(f"[bold red]error:[/] {escape(line)}", highlight=False, soft_wrap=True)
            sys.exit(1)
        # Every failure deltafy expects (bad input, missing files, offline Hub, unsupported model)
        # is a DeltafyError above. Anything else is a bug in deltafy: say so rather than pass it off
        # as the user's mistake, and ask for the report that lets us fix it.
        if state.debug:
            raise
        err_console.print(
            f"[bold red]internal error[/] (a bug in deltafy): {escape(first_line(err, with_type=True))}; please "
            f"report it on the deltafy issue tracker with the command you ran, the output of rerunning it "
            f"with --debug and that of deltafy --version",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(1)
    if code == 130:  # typer turned a KeyboardInterrupt into this code
        raise KeyboardInterrupt
    if isinstance(code, int) and code:
        sys.exit(code)


# What lowers each command's peak memory; a GPU's runs out long before a 7B's weights are the problem.
_LESS_MEMORY = {
    "train": "lower --batch-size (raise --grad-accum to keep the tokens per step) or --seq-len, add "
    "--gradient-checkpointing, or shard the model over several GPUs (torchrun ... --fsdp)",
    "eval": "lower --batch-size or --seq-len, or evaluate on another --device",
    "bench": "lower --batch-size or --seq-len",
    "convert": "convert with --streaming (a decoder layer at a time) on the CPU (no --device)",
}


def _out_of_memory(err: Exception, args: list[str]) -> str | None:
    """The one line for an allocation the machine refused, with what lowers the command's memory; else None."""
    if (line := out_of_memory(err)) is None:
        return None
    command = next((arg for arg in args if not arg.startswith("-")), "")
    return f"{line}: {_LESS_MEMORY.get(command, MORE_MEMORY)}"


def _by_the_interrupt(err: Exception) -> bool:
    """Whether ``err`` is what a Ctrl-C or SIGTERM became on its way up: a library that catches every
    exception turns the KeyboardInterrupt into one of its own (transformers' lazy imports raise
    "Could not import module 'LlamaConfig'"). deltafy's own reports of an interrupt are Interrupted."""
    return interrupts.received is not None and not isinstance(err, Interrupted)


__all__ = ["app", "run", "console"]
