"""How subcommands report a user error: one red line on stderr, exit code 2."""

from __future__ import annotations

import typer
from rich.console import Console

# soft_wrap: paths and numbers in messages stay on one line, whatever the terminal width.
console = Console(stderr=True, soft_wrap=True)


def fail(message: str) -> typer.Exit:
    """Prints ``message`` as an error; raise what it returns."""
    console.print(f"[red]error:[/red] {message}")
    return typer.Exit(2)
