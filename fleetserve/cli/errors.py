"""How subcommands report a user error: one red line on stderr, exit code 2."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

# soft_wrap: paths and numbers in messages stay on one line, whatever the terminal width.
console = Console(stderr=True, soft_wrap=True)


def print_error(message: object) -> None:
    """Prints ``message`` after a red ``error:``, as written: brackets in it (``models[tiny]``) are not markup."""
    console.print(f"[red]error:[/red] {escape(str(message))}")


def fail(message: str) -> typer.Exit:
    """Prints ``message`` as an error; raise what it returns."""
    print_error(message)
    return typer.Exit(2)
