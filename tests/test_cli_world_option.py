"""``--world`` and ``--world-size`` mean the same in every subcommand: each parser that takes one takes
the other, into the same value."""

from __future__ import annotations

import argparse

from zerosim.cli import build_parser


def _parsers(parser: argparse.ArgumentParser, path: str = "zerosim"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_world_and_world_size_are_one_option_everywhere() -> None:
    checked = []
    for path, parser in _parsers(build_parser()):
        by_flag = {flag: action for action in parser._actions for flag in action.option_strings}
        present = [f for f in ("--world", "--world-size") if f in by_flag]
        if not present:
            continue
        assert present == ["--world", "--world-size"], f"{path} takes {present} but not both"
        assert by_flag["--world"] is by_flag["--world-size"], f"{path}: --world and --world-size differ"
        checked.append(path)
    expected = {"zerosim verify", "zerosim plan", "zerosim memory", "zerosim bench peers"}
    assert expected <= set(checked), checked


def test_both_spellings_parse_to_the_same_value() -> None:
    parser = build_parser()
    for command in (["plan"], ["verify", "ddp"], ["checkpoint", "reshard", "a", "b", "--strategy", "zero1"]):
        one = parser.parse_args([*command, "--world", "3"])
        two = parser.parse_args([*command, "--world-size", "3"])
        assert vars(one) == vars(two), command
