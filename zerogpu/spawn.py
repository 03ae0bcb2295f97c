"""Starting the ranks of one single-node torch.distributed job directly, as ``torchrun --standalone`` would.

:class:`RankSpawn` is a :class:`zerosim.processes.launching.Launch`: it starts ``python -u ARGV`` once per
rank, each rank in a session of its own with the environment torchrun gives its workers (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``,
``ROLE_RANK``, ``ROLE_WORLD_SIZE``, ``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING``; ``OMP_NUM_THREADS`` stays the caller's), so a rank program runs
unchanged under it and under an external ``torchrun``. There is no agent process: the launching
process itself plays the agent's two parts, which saves one interpreter that imports torch per launch.

* **The job's store.** A ``TCPStore`` on ``127.0.0.1`` port 0: the kernel picks a free port, which
  is listening before its number is handed to the ranks (``MASTER_PORT``). The ranks connect as
  clients (``TORCHELASTIC_USE_AGENT_STORE=True``, what torchrun sets for its agent's store), so no
  rank binds a port and two launches started at the same moment cannot pick the same one. When the
  ranks are forks, the forking process holds the store (:mod:`zerogpu.rank_zygote`) and reports its
  port, and this process imports no torch at all; otherwise this process opens it before any rank
  starts.
* **Watching the ranks.** Every 0.1 s (torchrun's monitor interval) each rank's exit is noted in the
  order seen. When one exits non-zero, or is killed by a signal, the others are stopped (SIGTERM, a
  grace period, SIGKILL), as torchrun's agent does; a rank that exits 0 leaves the others running.
  :attr:`RankSpawn.exits` then says exactly how each rank ended and which ones this launcher stopped
  (:class:`RankExits`); when one failed, the same is written as a few lines at the end of the
  launch's standard error (:meth:`RankExits.summary`), where torchrun printed its failure summary.

Stopping, timeouts and signals are :mod:`zerosim.processes.launching`'s (each rank also carries the launch's
owner token and, on Linux, SIGTERM on this process's death), so nothing outlives the launch.
Serves the "distributed runs never hang; a failing rank ends the run non-zero naming it" rule.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO, Any

from zerogpu.fork_server import ServedZygote, request_zygote, server_address
from zerosim.processes.launching import death_line, signal_description, start_owned
from zerosim.processes.owned_processes import end_owned, with_owner_token

from .rank_zygote import STORE_HOST, STORE_TIMEOUT_S

MONITOR_S = 0.1  #: how often the ranks are looked at (torchrun's default ``--monitor-interval``)
SUMMARY_HEADING = "the ranks ended (first failure first):"


@dataclass
class RankExits:
    """How each rank of a launch ended: ``order`` holds ``(rank, status)`` as the exits were seen
    (status negative: killed by that signal); ``stopped`` the ranks this launcher ended itself after
    another rank failed, or at the end of the launch."""

    order: list[tuple[int, int]] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)

    def status(self) -> dict[int, int]:
        return dict(self.order)

    def summary(self) -> str:
        """How each rank ended, one line each, the first failure first (the launch's own report)."""
        first = self.first_failure()
        order = sorted(self.order, key=lambda rc: (rc != first, self.order.index(rc)))
        lines = [SUMMARY_HEADING]
        for rank, code in order:
            how = f"killed by {signal_description(-code)}" if code < 0 else f"exited with status {code}"
            stopped = " (stopped by the launcher)" if rank in self.stopped else ""
            lines.append(f"  rank {rank}: {how}{stopped}")
        return "\n".join(lines) + "\n"

    def first_failure(self) -> tuple[int, int] | None:
        """The first rank seen ending non-zero on its own, with its status; None when there is none."""
        return next(((r, c) for r, c in self.order if c != 0 and r not in self.stopped), None)


def diagnose_rank_death(exits: RankExits, said_why: bool = False) -> str | None:
    """``rank R failed: killed by signal S (NAME)`` for a rank that died without a word.

    The first failure when it was a signal; else another rank that a signal killed before this
    launcher stopped it (the first failure being a peer that noticed it); else, when no rank
    ``said_why``, the first failure's exit status; else None."""
    first = exits.first_failure()
    if first is not None and first[1] < 0:
        return death_line(first[0], -first[1], None)
    killed = [(r, c) for r, c in exits.order if c < 0 and r not in exits.stopped]
    if killed:
        return death_line(killed[0][0], -killed[0][1], None)
    if first is not None and not said_why:
        return death_line(first[0], None, first[1])
    return None


RANK_START_ENV = "ZEROGPU_RANK_START"  #: ``exec``: every rank an interpreter of its own (no forks)


def forking_available() -> bool:
    """Whether ranks can be forks of one warm process here: Linux (``fork``, ``prctl``), unless
    ``$ZEROGPU_RANK_START`` is ``exec``."""
    return sys.platform.startswith("linux") and os.environ.get(RANK_START_ENV, "") != "exec"


class TorchUnavailable(Exception):
    """torch.distributed cannot be imported where the ranks start; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _ZygoteReport:
    """What :mod:`zerogpu.rank_zygote` says on its report pipe: the store's port (or why torch is
    unavailable), each rank's pid, then its status."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd: int | None = fd
        self.port: int | None = None
        self.unavailable: str | None = None
        self.pids: dict[int, int] = {}
        self.exits: list[tuple[int, int]] = []
        self._partial = b""

    def read(self, until_closed: bool = False) -> None:
        """Take in every whole line written so far (``until_closed``: up to the end, within 5 s)."""
        give_up = time.monotonic() + 5.0
        while self.fd is not None:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                if not until_closed or time.monotonic() > give_up:
                    return
                time.sleep(0.01)
                continue
            if not chunk:
                self.close()
            self._partial += chunk
            *lines, self._partial = self._partial.split(b"\n")
            for line in lines:
                what, _, rest = line.decode().partition(" ")
                if what == "port":
                    self.port = int(rest)
                    continue
                if what == "unavailable":
                    self.unavailable = rest
                    continue
                rank, value = rest.split()
                if what == "fork":
                    self.pids[int(rank)] = int(value)
                elif int(rank) not in dict(self.exits):
                    self.exits.append((int(rank), int(value)))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def rank_environment(rank: int, world: int, port: int | None, env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what torchrun ``--standalone --nproc-per-node world`` sets for worker ``rank``
    (without ``MASTER_PORT`` when ``port`` is None: the forking process sets it)."""
    ranked = {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": STORE_HOST,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if port is None:
        del ranked["MASTER_PORT"]
    return ranked


class RankSpawn:
    """``world`` ranks of ``python -u *argv`` on this node (see the module docstring).

    On Linux the ranks are forks of one process per launch that imported torch once
    (:mod:`zerogpu.rank_zygote`), itself forked by a warm server when ``$ZEROGPU_FORK_SERVER`` in the
    launch's environment names one that accepts the launch (:mod:`zerogpu.fork_server`); elsewhere,
    with another ``python``, or with ``$ZEROGPU_RANK_START`` set to ``exec``, each rank is an
    interpreter of its own. A rank program sees no difference."""

    def __init__(self, world: int, argv: Sequence[str], python: str | None = None):
        self.world = world
        self.command = [python or sys.executable, "-u", *argv]
        self.procs: list[subprocess.Popen] = []
        self.exits = RankExits()
        self.store: Any = None
        self.stderr: IO[bytes] | None = None
        self._kill_at: float | None = None  # when the ranks stopped after a failure get SIGKILL
        self.grace_s = 5.0
        self.forked = forking_available() and self.command[0] == sys.executable
        self._zygote: subprocess.Popen | ServedZygote | None = None
        self._zygote_report: _ZygoteReport | None = None

    @property
    def port(self) -> int:
        """The job's store's port; with forked ranks, waits (within the store's timeout) until the
        forking process reports it. Raises :class:`TorchUnavailable`, or RuntimeError when the
        forking process ended without opening it."""
        if not self.forked:
            return int(self.store.port)
        assert self._zygote_report is not None and self._zygote is not None
        report = self._zygote_report
        give_up = time.monotonic() + STORE_TIMEOUT_S
        while report.port is None:
            ended = self._zygote.poll() is not None
            report.read(until_closed=ended)
            if report.unavailable is not None:
                raise TorchUnavailable(report.unavailable)
            if report.port is None and (ended or time.monotonic() > give_up):
                raise RuntimeError("the ranks' forking process ended without opening the job's store")
            time.sleep(0.01)
        return report.port

    def start(self, env: dict[str, str], token: str, stdout: IO[bytes] | None,
              stderr: IO[bytes] | None) -> None:
        self.stderr = stderr
        if self.forked:
            read_fd, write_fd = os.pipe()
            zygote = [self.command[0], "-u", "-m", "zerogpu.rank_zygote", str(write_fd), str(self.world),
                      "--", *self.command[2:]]
            zygote_env = rank_environment(0, self.world, None, env)  # the zygote opens the store
            try:
                self._zygote = self._served_zygote(zygote[5:], with_owner_token(zygote_env, token), stdout,
                                                   stderr, write_fd)
                if self._zygote is None:
                    self._zygote = start_owned(zygote, zygote_env, token, stdout=stdout, stderr=stderr,
                                               pass_fds=(write_fd,))
            finally:
                os.close(write_fd)
            self._zygote_report = _ZygoteReport(read_fd)
            return
        from torch.distributed import TCPStore

        self.store = TCPStore(STORE_HOST, 0, world_size=self.world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STORE_TIMEOUT_S))
        for rank in range(self.world):
            self.procs.append(start_owned(self.command, rank_environment(rank, self.world, self.port, env),
                                          token, stdout=stdout, stderr=stderr))

    @staticmethod
    def _served_zygote(zygote_args: Sequence[str], env: dict[str, str], stdout: IO[bytes] | None,
                       stderr: IO[bytes] | None, report_fd: int) -> ServedZygote | None:
        """The zygote forked by the server ``env`` names (:mod:`zerogpu.fork_server`), or None when
        there is none or it refused (then the zygote is started as an interpreter of its own)."""
        address = server_address(env)
        if address is None:
            return None
        out = 1 if stdout is None else stdout.fileno()
        err = 2 if stderr is None else stderr.fileno()
        return request_zygote(address, zygote_args, env, (0, out, err, report_fd))

    def _running(self) -> dict[int, int]:
        """rank -> pid of every rank started and not yet seen ending (its session has that id)."""
        ended = {r for r, _ in self.exits.order}
        if not self.forked:
            return {r: p.pid for r, p in enumerate(self.procs) if r not in ended and p.poll() is None}
        assert self._zygote_report is not None
        return {r: pid for r, pid in self._zygote_report.pids.items() if r not in ended}

    def _new_exits(self) -> list[tuple[int, int]]:
        """The ranks that ended since the last look, with their status."""
        seen = {r for r, _ in self.exits.order}
        if not self.forked:
            codes = [(r, p.poll()) for r, p in enumerate(self.procs) if r not in seen]
            return [(r, code) for r, code in codes if code is not None]
        assert self._zygote_report is not None and self._zygote is not None
        zygote_code = self._zygote.poll()
        self._zygote_report.read()
        if self._zygote_report.unavailable is not None:
            return []  # no rank was started (wait() says why)
        new = [(r, c) for r, c in self._zygote_report.exits if r not in seen]
        if zygote_code is not None:
            self._zygote_report.read(until_closed=True)
            if self._zygote_report.unavailable is not None:
                return []
            new = [(r, c) for r, c in self._zygote_report.exits if r not in seen]
            told = seen | {r for r, _ in new}
            # ranks the zygote never forked, or whose end it could not report (it was killed): how it ended
            lost = zygote_code if zygote_code != 0 else -signal.SIGTERM
            new += [(r, lost) for r in range(self.world) if r not in told]
        return sorted(new)  # those seen in one look in rank order, as the exec'd ranks are polled

    def _look(self) -> None:
        """Note the ranks that ended since the last look; stop the rest once one has failed."""
        self.exits.order.extend(self._new_exits())
        if self._kill_at is None and any(c != 0 for _, c in self.exits.order):
            self._signal_running(signal.SIGTERM)
            self._kill_at = time.monotonic() + self.grace_s
        elif self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._signal_running(signal.SIGKILL)

    def _signal_running(self, sig: int, *, zygote_too: bool = False) -> None:
        """Send ``sig`` to the process group of every rank still running, and count it as stopped. The
        forking process gets SIGTERM too (it forks no more and passes it on); SIGKILL only
        ``zygote_too`` (at the end of the launch: it may then not report how the ranks ended)."""
        for rank, pid in self._running().items():
            self.exits.stopped.add(rank)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
        if self._zygote is not None and self._zygote.poll() is None and (sig != signal.SIGKILL or zygote_too):
            if len(self._running()) < self.world - len(self.exits.order):  # ranks not forked yet: stopped
                self.exits.stopped.update(set(range(self.world)) - {r for r, _ in self.exits.order})
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._zygote.pid, sig)

    def _all_ended(self) -> bool:
        if self.forked:
            return self._zygote is None or self._zygote.poll() is not None
        return all(p.poll() is not None for p in self.procs)

    def wait(self, timeout_s: float) -> int | None:
        """0 once every rank exited 0, 1 once every rank ended and one did not; None while one runs.
        Raises :class:`TorchUnavailable` when the forking process reports that no rank can start."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._look()
            if self._zygote_report is not None and self._zygote_report.unavailable is not None:
                raise TorchUnavailable(self._zygote_report.unavailable)
            if len(self.exits.order) == self.world:
                return 0 if all(c == 0 for _, c in self.exits.order) else 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            time.sleep(min(MONITOR_S, remaining))

    def end(self, token: str, grace_s: float) -> None:
        """SIGTERM every rank still running (its process group) and every process holding ``token``,
        SIGKILL after ``grace_s``; returns once none is left and every rank is reaped."""

        def groups(sig: int) -> None:
            self._signal_running(sig, zygote_too=True)

        groups(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self._all_ended():
            time.sleep(0.02)
        groups(signal.SIGKILL)
        end_owned(token, grace_s, also=groups)
        for proc in [*self.procs, *([self._zygote] if self._zygote is not None else [])]:
            proc.wait()
        self._look()
        if self._zygote_report is not None:
            self._zygote_report.close()
        self.store = None  # the store's server closes with its last reference
        if any(c != 0 for _, c in self.exits.order):
            self._report()

    def _report(self) -> None:
        """Write :meth:`RankExits.summary` after whatever the ranks wrote to the launch's stderr."""
        text = self.exits.summary().encode()
        with contextlib.suppress(OSError, ValueError):
            if self.stderr is None:
                sys.stderr.flush()
                os.write(sys.stderr.fileno(), text)
            else:
                self.stderr.write(text)
                self.stderr.flush()
