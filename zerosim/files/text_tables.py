"""Printing rich tables so that no header or cell is cut: on a pipe, in a file, or on a narrow terminal.

rich lays a table out to the console's width (80 columns when the output is not a terminal) and
shortens a word that does not fit to "unsha…". Here a table is printed at the console's width when
no word is cut at that width (rich wraps between words), and otherwise at the narrowest width at
which none is: a line may then run past an 80-column terminal, but nothing is lost.
"""

from __future__ import annotations

import io
from typing import Any

UNBOUNDED = 100_000  # columns to measure a table against, so the measurement is not clamped
ELLIPSIS = "…"  # what rich puts where it cut a word


def _cuts_a_word(table: Any, console: Any, width: int) -> bool:
    """Whether rich shortens some header or cell of ``table`` with an ellipsis at ``width`` columns."""
    lines = console.render_lines(table, console.options.update_width(width), pad=False)
    return any(ELLIPSIS in segment.text for line in lines for segment in line)


def fitting_width(table: Any, console: Any) -> int:
    """The width to print ``table`` at on ``console``: the console's, or the narrowest wider one at which
    rich cuts no word (found by bisection up to the table's natural width, where nothing is cut)."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(UNBOUNDED), table).maximum
    if natural <= console.width or not _cuts_a_word(table, console, console.width):
        return console.width
    lo, hi = console.width, natural  # cuts at lo, none at hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _cuts_a_word(table, console, mid) else (lo, mid)
    return hi


def print_table(table: Any, console: Any = None) -> None:
    """Print ``table`` on ``console`` (default: stdout) at :func:`fitting_width`."""
    from rich.console import Console

    console = console if console is not None else Console()
    width = fitting_width(table, console)
    if width <= console.width:
        console.print(table)
        return
    Console(
        file=console.file,
        width=width,
        force_terminal=console.is_terminal,
        color_system=console.color_system,
        highlight=False,
    ).print(table)


def table_text(table: Any, width: int = 80) -> str:
    """``table`` as plain text (no colour codes) at ``width`` columns, or wider where a word would be cut."""
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, width=width, force_terminal=False, color_system=None)
    print_table(table, console)
    return buf.getvalue()
