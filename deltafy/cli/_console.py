from types import SimpleNamespace

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)
state = SimpleNamespace(debug=False)
