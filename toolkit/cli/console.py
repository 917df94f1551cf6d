"""The console every table is printed on: the terminal's width on a terminal; off one (a pipe, `| tee`, a CI or
Slurm log) as wide as the content, so no value is cut to fit 80 columns."""

from __future__ import annotations

UNLIMITED = 100_000  # columns: rich sizes each table to its content, this only lifts the cap


def console():
    from rich.console import Console

    terminal = Console()
    return terminal if terminal.is_terminal else Console(width=UNLIMITED, soft_wrap=True)
