"""Where the CLI's lines go: rich's console on stderr (progress, round lines, the data report)
and, for the end-of-run table, on stdout."""

from __future__ import annotations

from rich.console import Console


def make_console(stderr: bool = False) -> Console:
    """Rich's console. Written to a file or a pipe, rich would wrap every line at 80 columns and
    break the tables; there, lines are kept whole."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=100_000, soft_wrap=True)


console = make_console(stderr=True)


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
