"""The ranks of one launch as forks of one process that imported torch once.

``python -u -m zerogpu.rank_zygote REPORT_FD WORLD -- ARGV...`` is what :class:`zerogpu.spawn.RankSpawn`
starts on Linux instead of ``WORLD`` interpreters of ``python -u ARGV``: it imports
``torch.distributed`` (and, for ``-m zerosim.X`` / ``-m zerogpu.X`` programs, that program's package
and the modules the package lists in ``RANK_IMPORTS``), then forks one rank per ``RANK`` and runs
``ARGV`` in each exactly as ``python -u ARGV`` would
(``-m`` module, ``-c`` code or a script; ``sys.argv``, ``sys.path[0]``, uncaught exceptions, exit
statuses, atexit handlers and non-daemon threads as the interpreter treats them). Every rank pays
for the imports once per launch instead of once per rank, which is most of a rank's start.

What a rank keeps from being started on its own:

* its own session (``setsid``), so the launcher's ``killpg`` stops it and whatever it started;
* SIGTERM when this process dies (``prctl(PR_SET_PDEATHSIG)``), and this process gets SIGTERM when
  the launcher dies, so a launcher killed by SIGKILL still takes every rank with it;
* the launch's environment as it was at exec time (``/proc/<pid>/environ``, where the launch's owner
  token is found) plus the rank's own variables (``RANK``, ``LOCAL_RANK``, ``ROLE_RANK``) in
  ``os.environ``;
* the launch's standard output and error (inherited), default signal handlers, and a process that
  runs no thread of this one (only the main thread forks; torch starts no thread pool at import).

The job's store is this process's too (so the launcher imports no torch): before the first fork it
binds and listens on a socket on ``127.0.0.1`` port 0 (a plain socket, no thread), reports its port
and gives it to every rank (``MASTER_PORT``); once every rank is forked, it opens the master
``TCPStore`` on that socket (``master_listen_fd``). A rank that connects earlier waits in the listen
backlog until the store serves (its client's timeout applies), and two launches cannot pick the same
port. The store's threads start only after the last fork, with SIGTERM and SIGINT blocked, so every
fork happens in a process of one thread and a stop signal still reaches this process's main thread.

This process reports on ``REPORT_FD``, one line each: ``port PORT`` first (or ``unavailable REASON``
when torch.distributed cannot be imported or is not built, and no rank is forked), ``fork RANK PID``
once the rank is in its own session, and ``exit RANK STATUS`` when it has reaped it (STATUS as
:attr:`subprocess.Popen.returncode`: negative when a signal killed the rank). SIGTERM here is passed
on to every rank's session; this process leaves once every rank is reaped. Serves the "a failing rank
ends the run naming it; nothing outlives the launch" rule together with :mod:`zerogpu.spawn`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import os
import runpy
import signal
import socket
import sys
import types
from collections.abc import Sequence
from datetime import timedelta
from typing import IO, NoReturn

_PR_SET_PDEATHSIG = 1
STORE_HOST = "127.0.0.1"
STORE_TIMEOUT_S = 300.0  #: how long the job's store waits on a request (torch's default)
#: Packages whose rank programs may be imported before the fork: their import has no side effect.
PRELOADABLE = ("zerosim", "zerogpu")


#: The attribute of a program's package that lists the modules every rank of ``-m PACKAGE`` imports
#: whatever its arguments (a tuple of module names; each imported without side effects).
RANK_IMPORTS = "RANK_IMPORTS"
#: The attribute of a program's package naming a function of the program's arguments that returns the
#: modules every rank of this launch imports beyond ``RANK_IMPORTS`` (a tuple of module names, each
#: imported without side effects; an empty tuple when the arguments name none).
LAUNCH_IMPORTS = "launch_imports"


def torch_distributed_unavailable() -> str | None:
    """Why no torch.distributed job can run here (torch not installed, or built without
    torch.distributed), or None; imports torch.distributed."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        from zerosim.errors import install_hint

        return f"torch is not installed ({e}); {install_hint('torch')}"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None


def preload(argv: Sequence[str]) -> str | None:
    """Import what every rank of ``argv`` imports first: torch.distributed and, for ``-m`` programs of
    :data:`PRELOADABLE` packages, the program's package (its ``__main__`` runs in each rank), the
    modules its :data:`RANK_IMPORTS` names and those its :data:`LAUNCH_IMPORTS` function names for the
    program's arguments. A module that fails to import here is left to the ranks,
    which import it again and report the error as they would have. Returns
    :func:`torch_distributed_unavailable`'s reason (then nothing else is imported)."""
    reason = torch_distributed_unavailable()
    if reason:
        return reason
    if len(argv) >= 2 and argv[0] == "-m" and argv[1].split(".")[0] in PRELOADABLE:
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(argv[1])
            is_package = spec is not None and spec.submodule_search_locations is not None
            package = argv[1] if is_package else argv[1].rpartition(".")[0]
            if package:
                module = importlib.import_module(package)
                for name in (*getattr(module, RANK_IMPORTS, ()), *_launch_imports(module, argv[2:])):
                    with contextlib.suppress(Exception):
                        importlib.import_module(name)
    return None


def _launch_imports(package: types.ModuleType, args: Sequence[str]) -> tuple[str, ...]:
    """What ``package``'s :data:`LAUNCH_IMPORTS` function names for ``args`` (nothing when it has none
    or it fails: the ranks then import those modules themselves)."""
    names = getattr(package, LAUNCH_IMPORTS, None)
    if not callable(names):
        return ()
    try:
        return tuple(str(name) for name in names(list(args)))
    except Exception:
        return ()


def store_listener() -> socket.socket:
    """A socket listening on :data:`STORE_HOST`, on a port the kernel picked (no thread starts)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((STORE_HOST, 0))
    listener.listen(socket.SOMAXCONN)
    return listener


def open_store(listener: socket.socket, world: int) -> object:
    """The job's master ``TCPStore``, serving on ``listener`` (which must stay open while it serves).
    Its threads start with SIGTERM and SIGINT blocked, so those signals reach the main thread."""
    from torch.distributed import TCPStore

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        return TCPStore(STORE_HOST, listener.getsockname()[1], world_size=world, is_master=True,
                        wait_for_workers=False, timeout=timedelta(seconds=STORE_TIMEOUT_S),
                        master_listen_fd=listener.fileno())
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals)


def _die_with_parent(parent: int) -> None:
    """SIGTERM for this process when ``parent`` dies (Linux ``prctl``; nothing elsewhere)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def run_program(argv: Sequence[str]) -> None:
    """Run ``argv`` as ``python -u ARGV`` runs it in this process (``-m MODULE``, ``-c CODE`` or a
    script path, then its arguments); its exceptions and ``SystemExit`` propagate to the caller."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # run_module puts the module's path in sys.argv[0]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _fork_rank(rank: int, argv: Sequence[str], report: IO[str], listener: socket.socket) -> int:
    """Fork rank ``rank``; in the child run ``argv`` and never return; in this process return the
    child's pid once it is in a session of its own. The child keeps neither ``report`` nor the store's
    ``listener``."""
    ready_r, ready_w = os.pipe()
    parent = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # no handler of this process in the child
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        report.close()
        listener.close()
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _die_with_parent(parent)
        os.close(ready_w)  # this rank is in its own session: the launcher may signal it
        for name in ("RANK", "LOCAL_RANK", "ROLE_RANK"):
            os.environ[name] = str(rank)
        run_program(argv)
        raise SystemExit(0)  # the program returned: leave the way the interpreter leaves
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.close(ready_w)
    while os.read(ready_r, 1):
        pass
    os.close(ready_r)
    return pid


class _Ranks:
    """The forked ranks (pid -> rank); SIGTERM is passed on to their sessions and forks no more."""

    def __init__(self, report: IO[str]) -> None:
        self.by_pid: dict[int, int] = {}
        self.stopping = False
        self.report = report
        self.store: object = None  # the job's store, served until this process leaves

    def pass_on(self, signum: int, frame: object) -> None:
        if not self.by_pid:  # told to stop before any rank was forked (a fork in flight dies with us)
            os._exit(0)
        self.stopping = True
        for pid in list(self.by_pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signum)

    def say(self, line: str) -> None:
        with contextlib.suppress(OSError):  # a launcher that is gone reads nothing
            self.report.write(line + "\n")


def serve(report_fd: int, world: int, argv: Sequence[str]) -> NoReturn:
    """Fork ``world`` ranks of ``argv``, report each (see the module docstring), reap them, exit 0."""
    ranks = _Ranks(os.fdopen(report_fd, "w", buffering=1))
    signal.signal(signal.SIGTERM, ranks.pass_on)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    reason = preload(argv)
    if reason:
        ranks.say(f"unavailable {reason}")
        os._exit(2)
    listener = store_listener()
    port = listener.getsockname()[1]
    ranks.say(f"port {port}")
    os.environ["MASTER_PORT"] = str(port)
    for rank in range(world):
        if ranks.stopping:
            break
        pid = _fork_rank(rank, argv, ranks.report, listener)  # the child never returns from here
        ranks.by_pid[pid] = rank
        ranks.say(f"fork {rank} {pid}")
        if ranks.stopping:  # SIGTERM came while this rank was being forked
            ranks.pass_on(signal.SIGTERM, None)
    if not ranks.stopping:
        try:
            ranks.store = open_store(listener, world)  # the first thread of this process starts here
        except Exception as e:  # the ranks could not meet: stop them rather than let them wait
            print(f"the job's store could not be opened on port {port}: {e}", file=sys.stderr, flush=True)
            ranks.pass_on(signal.SIGTERM, None)
    while ranks.by_pid:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in ranks.by_pid:
            rank = ranks.by_pid.pop(pid)
            ranks.say(f"exit {rank} {os.waitstatus_to_exitcode(status)}")
    with contextlib.suppress(OSError):
        ranks.report.close()
    os._exit(0)  # the store served until every rank was reaped; leaving does not wait on its threads


def main(args: Sequence[str]) -> NoReturn:
    report_fd, world, separator, *argv = args
    if separator != "--" or not argv:
        raise SystemExit("usage: python -m zerogpu.rank_zygote REPORT_FD WORLD -- ARGV...")
    serve(int(report_fd), int(world), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
