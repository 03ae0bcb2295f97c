"""SIGINT, SIGTERM and SIGHUP stop a ``zerosim`` command the same way Ctrl-C always did.

While a command runs (:func:`stop_signals_handled`), each of the three signals raises
:class:`StopSignal` in the main thread, a :class:`KeyboardInterrupt`, so every launch's clean-up
(:mod:`zerosim.processes.launching`: its process group and every process holding its owner token end before
the exception leaves it) runs for ``kill -TERM``, ``timeout N zerosim ...`` and a closed terminal
exactly as for Ctrl-C. The first signal is the one that counts: further ones are ignored until the
command has returned, so a second Ctrl-C cannot cut the clean-up short. The command then prints one
line and exits with the shell's status for that signal, 128 + its number: 130 (SIGINT), 143
(SIGTERM), 129 (SIGHUP). A signal this process inherited as ignored (``nohup``, a background job of a
non-interactive shell) stays ignored. Pure standard library.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignal(KeyboardInterrupt):
    """The command was asked to stop by ``signum``; ``exit_status`` is 128 + ``signum``."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(signal.Signals(self.signum).name)

    @property
    def exit_status(self) -> int:
        return 128 + self.signum

    @property
    def line(self) -> str:
        """The one line the command prints: ``interrupted`` for Ctrl-C, else ``terminated by SIGTERM``."""
        if self.signum == signal.SIGINT:
            return "interrupted"
        return f"terminated by {signal.Signals(self.signum).name}"


@contextlib.contextmanager
def stop_signals_handled() -> Iterator[None]:
    """Within the block, SIGINT / SIGTERM / SIGHUP raise :class:`StopSignal` once (see the module
    docstring); the previous handlers come back afterwards. Outside the main thread: no change."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        raise StopSignal(signum)

    previous: dict[signal.Signals, Any] = {}
    for sig in STOP_SIGNALS:
        current = signal.getsignal(sig)
        if current == signal.SIG_IGN:
            continue
        previous[sig] = current
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
