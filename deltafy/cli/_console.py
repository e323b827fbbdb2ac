from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

from rich.console import Console
from rich.markup import escape

# soft_wrap: a line that names a path stays one line (a pipe or a narrow terminal would break it at its spaces).
console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)
state = SimpleNamespace(debug=False)


@contextmanager
def spinner_status(on: Console) -> Iterator[Callable[[str], None]]:
    """A spinner whose messages are shown as written: they name the user's paths and models,
    which rich would otherwise read as markup ("runs/a[/]b" is a markup error, "[draft]" a tag)."""
    with on.status("") as spinner:
        yield lambda message: spinner.update(escape(message) + " …")
