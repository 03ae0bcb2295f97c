"""The command line of hand-started ranks (``zerosim.cli.ranks``): what a rank entry point given options
becomes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerosim.cli.ranks import COMMANDS, main
from zerosim.errors import EXIT_BAD_INPUT

ROOT = Path(__file__).resolve().parents[1]
#: the rank entry points, each of which hands its options to a command of zerosim.cli.ranks
ENTRY_POINTS = ("zerogpu/__main__.py", "zerosim/mpi/__main__.py", "zerosim/verify/__main__.py",
                "zerosim/bench/peers_rank.py")


def handed_over(path: Path) -> set[str]:
    """The commands a source names to ``rank_run_path`` / ``hand_to_command_line`` (a literal, or
    ``"zerogpu-" + command`` for each rank command the module's dispatch names)."""
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else ""
        if name == "rank_run_path" and len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
            found.add(node.args[1].value)
        elif name == "hand_to_command_line":
            arg = node.args[0]
            if isinstance(arg, ast.Constant):
                found.add(arg.value)
            else:  # "zerogpu-" + the commands the dispatch compares against
                found.update(f"zerogpu-{c}" for c in ("selftest-comm", "equivalence", "report"))
    return found


def test_every_entry_point_hands_its_options_to_a_command_that_exists() -> None:
    named = set().union(*(handed_over(ROOT / p) for p in ENTRY_POINTS))
    assert named == set(COMMANDS), (named, set(COMMANDS))


def test_an_unknown_command_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["no-such-rank"])
    assert stop.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("error: invalid command='no-such-rank': not a rank command")
    assert err.count("\n") == 1
