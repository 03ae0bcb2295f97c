"""The ``zerosim`` argument parser: argparse's own errors in the one-line form of every other bad input.

A value a command refuses is reported as ``error: invalid FIELD=VALUE: reason`` (a
:class:`zerosim.errors.ConfigError`) with exit status 2. argparse finds some bad input before a command
sees it (an unknown option, a missing value, a choice outside the list, a number that does not parse,
a missing required argument); :class:`OneLineParser` words those the same way, one line on stderr, exit
status 2, with no usage block. Every parser ``add_subparsers`` makes below it is one too, so every
subcommand reports alike.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any, NoReturn

from ..errors import EXIT_BAD_INPUT

_ARGUMENT = re.compile(r"^argument (?P<names>[^:]+): (?P<rest>.*)$", re.DOTALL)
_CHOICE = re.compile(r"^invalid choice: (?P<value>'.*?') \(choose from (?P<choices>.*)\)$", re.DOTALL)
_TYPE = re.compile(r"^invalid (?P<type>\w+) value: (?P<value>'.*')$", re.DOTALL)
_TYPE_WORDS = {"int": "must be an integer", "float": "must be a number"}
_REQUIRED = re.compile(r"^the following arguments are required: (?P<names>.*)$")
_ONE_OF = re.compile(r"^one of the arguments (?P<names>.*) is required$")
_UNRECOGNIZED = re.compile(r"^unrecognized arguments: (?P<words>.*)$")
_AMBIGUOUS = re.compile(r"^ambiguous option: (?P<option>\S+) could match (?P<matches>.*)$")
_NOT_ALLOWED = re.compile(r"^not allowed with argument (?P<other>.*)$")


def field_name(names: str) -> str:
    """The field an option fills, as ConfigError names it: ``--reduce-dtype`` -> ``reduce_dtype``,
    ``--world/--world-size`` -> ``world``, a positional ``PATH`` -> ``path``."""
    first = names.split("/")[0].strip()
    return first.lstrip("-").replace("-", "_").lower()


def one_line(message: str, command: str) -> str:
    """argparse's ``message`` about ``command`` (``zerosim simulate``) in the one-line form."""
    match = _ARGUMENT.match(message)
    if match:
        names, rest = match["names"], match["rest"]
        field = field_name(names)
        if m := _CHOICE.match(rest):
            choices = ", ".join(c.strip().strip("'") for c in m["choices"].split(","))
            return f"invalid {field}={m['value']}: must be one of {choices}"
        if m := _TYPE.match(rest):
            return f"invalid {field}={m['value']}: {_TYPE_WORDS.get(m['type'], 'must be a ' + m['type'])}"
        if m := _NOT_ALLOWED.match(rest):
            return f"invalid {field}: {names} cannot be given with {m['other']} (give one of them)"
        if rest.startswith("expected"):  # a value missing after the option
            return f"invalid {field}: {names.split('/')[0]} {rest} ({command} --help)"
        return f"invalid {field}: {rest}"
    if m := _REQUIRED.match(message):
        fields = ", ".join(field_name(n) for n in m["names"].split(", "))
        return f"invalid {fields}: {command} needs {m['names']} ({command} --help)"
    if m := _ONE_OF.match(message):
        return f"invalid {field_name(m['names'].split()[0])}: {command} needs one of {m['names']}"
    if m := _UNRECOGNIZED.match(message):
        words = m["words"].split()
        kind = "option" if words[0].startswith("-") else "argument"
        listed = f"{words[0]!r}" + (f" (and {len(words) - 1} more)" if len(words) > 1 else "")
        return f"invalid {kind}={listed}: {command} takes no such {kind} ({command} --help lists them)"
    if m := _AMBIGUOUS.match(message):
        return f"invalid option={m['option']!r}: could be {m['matches']}; spell it out"
    return f"{command}: {message}"


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``error: invalid FIELD=VALUE: reason``, exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {one_line(message, self.prog)}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, but words left over are blamed on the subcommand that was given them."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            print(f"error: {one_line('unrecognized arguments: ' + ' '.join(extras), _command(self, parsed))}",
                  file=sys.stderr)
            raise SystemExit(EXIT_BAD_INPUT)
        return parsed


def _command(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> str:
    """``zerosim check partition``: the program and the subcommand words ``parsed`` chose."""
    words = [parser.prog]
    for dest in ("command", "check_target", "bench", "checkpoint_command"):
        value = getattr(parsed, dest, None)
        if isinstance(value, str):
            words.append(value)
    return " ".join(words)
