"""The ``zerosim`` command line.

Each subcommand lives in its own module ``zerosim.cli.<name>`` exposing
``register(subparsers) -> None``; the registered parser's ``func(args) -> int`` runs it.
A ZeroSimError anywhere becomes ``error: <message>`` on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, ZeroSimError

COMMAND_MODULES = ("plan", "check", "simulate", "mutants", "memory", "comm", "report", "bench", "verify",
                   "checkpoint", "gpu_check")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zerosim",
        description="Verify and measure ZeRO-style sharded data-parallel training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.func(args) or 0)
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of stdout went away (``| head -1``): stop quietly, as shell tools do, and keep
        # the interpreter's final flush from raising again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
