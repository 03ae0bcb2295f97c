"""The ``zerosim`` command line.

Each subcommand lives in its own module ``zerosim.cli.<name>`` exposing
``register(subparsers) -> None``; the registered parser's ``func(args) -> int`` runs it.
A ZeroSimError or an OSError anywhere becomes ``error: <message>`` on stderr and exit status 2
(:func:`main`). SIGINT, SIGTERM and SIGHUP end the command and every process it started
(:mod:`zerosim.processes.stop_signals`, :mod:`zerosim.processes.owned_processes`) with one line and exit
status 130, 143 or 129. A command that does not finish (interrupted, or an error) removes the output folders
it made and left empty (:func:`zerosim.files.outputs.remove_unused_output_dirs`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

from ..errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, ZeroSimError
from ..files.outputs import describe_os_error, remove_unused_output_dirs
from ..processes.owned_processes import OWNER_ENV, end_owned, new_owner_token, with_owner_token
from ..processes.stop_signals import StopSignal, stop_signals_handled
from ._parser import OneLineParser
from ._stdout import GuardedStdout, StdoutError, silence_stdout

COMMAND_MODULES = ("plan", "check", "simulate", "mutants", "memory", "comm", "report", "bench", "verify",
                   "checkpoint", "gpu_check", "zoo")
_STOP_GRACE_S = 3.0  # how long a process this command started has to go after SIGTERM, before SIGKILL


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``zerosim`` parser with every command, or only ``command`` when that names one (the command
    a run parses needs no other command's module: importing them all costs a launch about 0.4 s of CPU)."""
    parser = OneLineParser(
        prog="zerosim",
        description="Verify and measure ZeRO-style sharded data-parallel training.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    module = (command or "").replace("-", "_")
    for name in (module,) if module in COMMAND_MODULES else COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Whatever it raises on purpose (a ZeroSimError) or meets in the operating system
    (an OSError: a full disk, a read-only folder, a file where a folder belongs, stdout on /dev/full)
    ends as one line on stderr and exit status 2; a reader that closes stdout early (``| head``)
    ends it quietly with 141; SIGINT, SIGTERM and SIGHUP end it and every process it started with
    130, 143 and 129."""
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words else None)  # ``zerosim -h`` and no command: every command
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    token = new_owner_token()
    held = os.environ.get(OWNER_ENV)
    os.environ.update(with_owner_token(os.environ, token))  # every process this command starts carries it
    real_stdout = sys.stdout
    guarded = GuardedStdout(real_stdout)
    sys.stdout = guarded
    finished = False
    try:
        with stop_signals_handled():
            try:
                code = int(args.func(args) or 0)
                sys.stdout.flush()  # a full or closed stdout fails here, inside the handlers, not at exit
                finished = True
                return code
            except KeyboardInterrupt as e:  # Ctrl-C, or StopSignal (SIGTERM, SIGHUP, SIGINT)
                end_owned(token, _STOP_GRACE_S)  # whatever no launch has ended yet (a plain subprocess)
                with contextlib.suppress(OSError):  # a hung-up terminal may take stderr with it
                    print(e.line if isinstance(e, StopSignal) else "interrupted", file=sys.stderr, flush=True)
                return e.exit_status if isinstance(e, StopSignal) else EXIT_INTERRUPTED
    except ZeroSimError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        silence_stdout()  # the reader of stdout went away (``| head -1``): stop quietly, as shell tools do
        return EXIT_BROKEN_PIPE
    except StdoutError as e:
        silence_stdout()
        print(f"error: cannot write to standard output: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"error: {describe_os_error(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit:
        if guarded.broken_pipe:  # a library (rich) saw the closed pipe and exited by itself
            silence_stdout()
            return EXIT_BROKEN_PIPE
        raise
    finally:
        if not finished:  # interrupted or failed: the output folders it made and left empty go
            remove_unused_output_dirs()
        sys.stdout = real_stdout
        if guarded.broken_pipe:  # whoever caught it, the unwritten rest must not be flushed at exit
            silence_stdout()
        if held is None:
            os.environ.pop(OWNER_ENV, None)
        else:
            os.environ[OWNER_ENV] = held


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
