from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from rich.console import Console
from rich.markup import escape

# soft_wrap: a line that names a path stays one line (a pipe or a narrow terminal would break it at its spaces).
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)
# argv: the command line main() was given; kept: what an interrupt leaves as it was, said by the
# command that is running (default: "nothing was written")
state = SimpleNamespace(debug=False, argv=[], kept=None)


@contextmanager
def spinner_status(on: Console) -> Iterator[Callable[[str], None]]:
    """A spinner whose messages are shown as written: they name the user's paths and models,
    which rich would otherwise read as markup ("runs/a[/]b" is a markup error, "[draft]" a tag)."""
    if not on.is_terminal:  # a pipe or a log: nothing to animate, and rich's live display would leave an empty line
        yield lambda message: None
        return
    with on.status("") as spinner:
        yield lambda message: spinner.update(escape(message) + " …")


@contextmanager
def activity(on: Console) -> Iterator[tuple[Callable[[str], None], Callable[[str, int, int], None]]]:
    """A spinner line for what a long job is doing, plus a bar for each step that counts its
    progress (bytes written, layers checked): ``progress(what, advance, total)``."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeRemainingColumn

    if not on.is_terminal:  # as spinner_status
        yield (lambda message: None), (lambda what, advance, total: None)
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=on,
        transient=True,
    ) as bars:
        spinner = bars.add_task("", total=None)
        tasks: dict[str, int] = {}

        def status(message: str) -> None:
            bars.update(spinner, description=escape(message) + " …")

        def progress(what: str, advance: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = bars.add_task(escape(what), total=total)
            bars.update(tasks[what], advance=advance)

        yield status, progress
