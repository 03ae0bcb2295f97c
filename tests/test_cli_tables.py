"""Tables printed to a pipe or an 80-column terminal keep every header and cell word whole."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.table import Table

from zerosim.cli import main
from zerosim.files.text_tables import fitting_width, print_table, table_text

HEADERS = ("ranks", "sim step (s, median)", "unsharded step (s, median)", "ratio median", "ratio min",
           "target", "process peak (MB)", "sum of rank peaks (MB)", "peak / sum")


def wide_table() -> Table:
    table = Table(title="nine right-aligned columns")
    for col in HEADERS:
        table.add_column(col, justify="right")
    table.add_row("8", "0.123", "0.111", "1.14", "1.10", "<= 1.5", "123.4", "100.1", "1.20")
    return table


def words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z]+", text))


def test_rich_alone_cuts_headers_at_80_columns_and_the_helper_does_not() -> None:
    plain = io.StringIO()
    Console(file=plain, width=80, color_system=None).print(wide_table())
    assert "…" in plain.getvalue()  # the failure the helper exists for: "unsha…"
    text = table_text(wide_table(), width=80)
    assert "…" not in text
    assert {w for h in HEADERS for w in words(h)} <= words(text)


def test_a_table_that_fits_keeps_the_console_width() -> None:
    table = Table()
    table.add_column("a")
    table.add_row("1")
    console = Console(file=io.StringIO(), width=80)
    assert fitting_width(table, console) == 80
    print_table(table, console)
    assert max(len(line) for line in console.file.getvalue().splitlines()) <= 80


def test_simulate_on_a_pipe_cuts_no_word(capsys) -> None:
    assert main(["simulate", "--steps", "1", "--world-size", "2"]) == 0
    out = capsys.readouterr().out  # captured: not a terminal, 80 columns
    assert "…" not in out
    assert "ground truth" in out and "C-ZERO-005" in out
