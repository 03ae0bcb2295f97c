"""The per-process MPI watchdog: collective timeouts that end the job, and who reports a failure.

A collective whose peers never arrive must not hang the job. In ``timeout_mode="abort"`` the data
path is MPI's blocking call, untouched; this watchdog thread (one per process, waking every 50 ms)
notices a collective that outlives its timeout, asks the group's other ranks over a private
duplicate of the world communicator what they are doing, reports a :class:`CollectiveTimeout`
naming the ranks that never arrived (printed once, by the lowest rank that did arrive) and aborts
the world: MPI cannot cancel a pending collective, so ending the job is the only safe outcome.
Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

The same private channel lets ranks that fail together agree on one reporter
(:func:`is_failure_reporter`), so an error every rank raises is printed once.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any, Protocol

from ..errors import EXIT_RUN_FAILED, CollectiveTimeout
from .fault_plan import FaultPlan, collective_plan
from .mpi_wire import MPI


class WatchedCommunicator(Protocol):
    """What the watchdog reads of a communicator (:class:`zerosim.comm.mpi.MpiCommunicator` is one):
    its group, the collective it is in and how many it entered, whether it blocks, its timeout.
    A protocol, so this module does not import the communicator that imports it."""

    @property
    def group_name(self) -> str: ...
    @property
    def global_ranks(self) -> tuple[int, ...]: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def _collective(self) -> str: ...
    @property
    def _calls(self) -> int: ...
    @property
    def _blocking(self) -> bool: ...


_TAG_QUERY = 7001
_TAG_REPLY = 7002
WATCHDOG_POLL_S = 0.05
# While the main thread is inside a collective the watchdog touches MPI (improbe for peers' queries)
# at most this often: under MPI_THREAD_MULTIPLE every MPI call takes the library's lock, which the
# collective's progress loop wants. Peers' surveys wait at least 0.5 s for answers, so this still answers.
WATCHDOG_BUSY_POLL_S = 0.25


ABORT_FORWARD_GRACE_S = 0.5


def abort_world(message: str, code: int = EXIT_RUN_FAILED) -> None:
    """Print ``message`` (the caller decides it is the one to print) and abort every rank with ``code``."""
    if message:
        print(message, file=sys.stderr, flush=True)
        # mpiexec forwards a rank's stderr through its proxy; an abort right after the write can take
        # the proxy down before it has forwarded the line, so give the forwarding a moment
        time.sleep(ABORT_FORWARD_GRACE_S)
    MPI.COMM_WORLD.Abort(code)


class Watchdog:
    """Per-process collective bookkeeping: answers peers' "what are you doing?" and fires timeouts.

    The data path only stores the communicator it is in (``current``) on entry and ``None`` on
    exit. The thread wakes every ``poll_s``: it answers queries from other ranks (while this rank is
    inside a collective, only every ``WATCHDOG_BUSY_POLL_S``: it leaves MPI's lock to the collective)
    and, for a communicator in ``abort`` mode, fires when the same call has been pending longer than
    its timeout (a check that does not touch MPI).
    """

    def __init__(self, world: Any, poll_s: float = WATCHDOG_POLL_S, start_thread: bool = True):
        self.diag = world.Dup()  # private channel: never matches the engine's messages
        self.world_rank = world.Get_rank()
        self.world_size = world.Get_size()
        self.groups: dict[str, WatchedCommunicator] = {}  # group name -> this rank's communicator
        self.current: WatchedCommunicator | None = None  # the communicator inside a collective, if any
        self.calls = 0  # collectives entered by this process (counted only while a fault is planned)
        self.failed = False  # this rank raised: answers to peers say so
        self.poll_s = poll_s
        self._seen: tuple[int, int] | None = None
        self._seen_at = 0.0
        self._answered_at = 0.0  # when the thread last looked for peers' queries
        self._fired = False
        self._lock = threading.Lock()  # one answerer at a time (the thread vs a survey in the main thread)
        self._sends: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="zerosim-mpi-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    # -- answering ------------------------------------------------------------------------------
    def state_for(self, group: str) -> tuple[int, tuple[str, str, int] | None, bool]:
        """(collectives entered on ``group``, the collective this rank waits in or None, has it failed)."""
        comm = self.groups.get(group)
        cur = self.current
        where = None if cur is None else (cur.group_name, cur._collective, cur._calls - 1)
        return (0 if comm is None else comm._calls), where, self.failed

    def answer_queries(self) -> None:
        with self._lock:
            status = MPI.Status()
            while True:
                msg = self.diag.improbe(MPI.ANY_SOURCE, _TAG_QUERY, status)
                if msg is None:
                    break
                group = msg.recv()
                self._sends.append(
                    self.diag.isend(self.state_for(group), dest=status.Get_source(), tag=_TAG_REPLY)
                )
            self._sends = [r for r in self._sends if not r.Test()]

    def ask(self, members: tuple[int, ...], group: str, grace_s: float) -> dict[int, tuple[Any, ...]]:
        """Ask every other member its :meth:`state_for` ``group``; the replies that came within ``grace_s``.
        """
        others = [m for m in members if m != self.world_rank]
        sends = [self.diag.isend(group, dest=m, tag=_TAG_QUERY) for m in others]
        replies: dict[int, tuple[Any, ...]] = {}
        status = MPI.Status()
        end = time.monotonic() + grace_s
        while len(replies) < len(others) and time.monotonic() < end:
            self.answer_queries()
            msg = self.diag.improbe(MPI.ANY_SOURCE, _TAG_REPLY, status)
            if msg is None:
                time.sleep(0.005)
                continue
            replies[status.Get_source()] = msg.recv()
        self._sends.extend(sends)
        return replies

    def survey(
        self, group: str, seq: int, members: tuple[int, ...], grace_s: float
    ) -> tuple[list[int], dict[int, str]]:
        """Which members entered call ``seq`` of ``group`` (sorted, this rank included); notes on the others.
        """
        replies = self.ask(members, group, grace_s)
        arrived = [self.world_rank]
        notes: dict[int, str] = {}
        for m in members:
            if m == self.world_rank:
                continue
            if m not in replies:
                notes[m] = "did not answer"
                continue
            entered, where, failed = replies[m]
            if entered > seq:
                arrived.append(m)
            elif failed:
                notes[m] = "failed"
            elif where is None:
                notes[m] = f"not in any collective ({entered} entered on {group})"
            else:
                notes[m] = f"waiting in {where[1]} #{where[2]} on group {where[0]}"
        return sorted(arrived), notes

    def timeout_error(
        self, comm: WatchedCommunicator, seq: int, collective: str
    ) -> tuple[CollectiveTimeout, bool]:
        """Survey the group of a timed-out call; (the error naming who never arrived, this rank reports it).
        """
        arrived, notes = self.survey(
            comm.group_name, seq, comm.global_ranks, min(2.0, max(0.5, comm.timeout_s))
        )
        missing = [m for m in comm.global_ranks if m not in arrived]
        err = CollectiveTimeout(collective, missing, comm.timeout_s, comm.group_name)
        detail = "; ".join(f"rank {m}: {notes[m]}" for m in missing if m in notes)
        if detail:
            err.args = (f"{err} ({detail})",)
        return err, self.world_rank == min(arrived)

    def is_failure_reporter(self, settle_s: float = 0.3, grace_s: float = 1.0) -> bool:
        """This rank failed: is it the lowest failed rank (the one that prints)? Others fail quietly.

        Waits ``settle_s`` first so ranks that fail together (the same error on every rank) all know it.
        """
        self.failed = True
        time.sleep(settle_s)
        replies = self.ask(tuple(range(self.world_size)), "world", grace_s)
        failed = [self.world_rank] + [m for m, (_e, _w, f) in replies.items() if f]
        return self.world_rank == min(failed)

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if MPI.Is_finalized():
                    return
                now = time.monotonic()
                if self.current is None or now - self._answered_at >= WATCHDOG_BUSY_POLL_S:
                    self._answered_at = now
                    self.answer_queries()
                self._check_deadline()
            except Exception as e:  # noqa: BLE001 - a watchdog must never die silently
                print(
                    f"rank {self.world_rank}: zerosim MPI watchdog error: {e!r}", file=sys.stderr, flush=True
                )

    def _check_deadline(self) -> None:
        cur = self.current
        if cur is None or not cur._blocking or self._fired:
            return
        seen = (id(cur), cur._calls)
        now = time.monotonic()
        if seen != self._seen:
            self._seen, self._seen_at = seen, now
            return
        if now - self._seen_at < cur.timeout_s:
            return
        self._fired = True
        err, reporter = self.timeout_error(cur, cur._calls - 1, cur._collective)
        if reporter:
            abort_world(f"rank {self.world_rank} failed: CollectiveTimeout: {err}")
        time.sleep(3.0)  # another member reports and aborts; make sure the job ends regardless
        abort_world("")


_WATCHDOG: Watchdog | None = None
_FAULT: list[FaultPlan | None] = []


def process_watchdog() -> Watchdog:
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = Watchdog(MPI.COMM_WORLD, start_thread=MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
    return _WATCHDOG


def process_fault_plan() -> FaultPlan | None:
    """This process's collective fault plan (raise, hang, kill) from ``$ZEROSIM_FAULT``, or None."""
    if not _FAULT:
        _FAULT.append(collective_plan(FaultPlan.from_env()))
    return _FAULT[0]


def is_failure_reporter() -> bool:
    """This rank has failed: should it print the error? True for the lowest-numbered failed rank only.

    Ranks that fail together (an error every rank raises, a collective that times out on all the
    ranks that arrived) agree over the watchdog's private channel, so the error is printed once.
    """
    if _WATCHDOG is None or MPI.Is_finalized():
        return True
    try:
        return _WATCHDOG.is_failure_reporter()
    except Exception:  # noqa: BLE001 - when in doubt, report
        return True
