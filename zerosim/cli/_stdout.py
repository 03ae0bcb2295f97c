"""Standard output as every command sees it: a write that fails is told apart from any other OSError.

:class:`GuardedStdout` wraps ``sys.stdout`` while a command runs. A failed write or flush raises
:class:`StdoutError` (an OSError whose message says it was standard output, e.g. ``> /dev/full``),
and a reader that went away (``| head -1``) is remembered even when a library swallows the
BrokenPipeError and exits by itself (rich raises ``SystemExit(1)``), so the command line can end
either case with its own status (:func:`zerosim.cli.main`).
"""

from __future__ import annotations

import os
import sys
from typing import Any


class StdoutError(OSError):
    """Writing to standard output failed (a full device, an I/O error); not a reader going away."""


class GuardedStdout:
    """A proxy of a text stream whose write errors name standard output (see the module docstring)."""

    def __init__(self, stream: Any):
        self._stream = stream
        self.broken_pipe = False

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            self.broken_pipe = True
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def write(self, text: str) -> int:
        return int(self._guard(self._stream.write, text))

    def writelines(self, lines: Any) -> None:
        self._guard(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def silence_stdout() -> None:
    """Point the stdout descriptor at /dev/null, so the interpreter's final flush of the unwritten
    rest cannot fail again and print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ is not None else 1)
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)
