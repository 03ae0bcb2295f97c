"""The world of the in-process simulator: N ranks as threads of one process, their groups, the
rendezvous they meet at (:mod:`zerosim.comm.rendezvous`) and the schedule that runs them.

Two schedules keep the same semantics:

- ``serial`` (default): one rank runs at a time. A rank runs until it blocks in a collective that
  is still waiting for peers, then hands the baton to the next runnable rank (cyclic rank order);
  a rank taking a completed collective's result first hands the baton to the group's first rank
  when that one can run, so lower ranks go first. No oversubscription of the BLAS threads,
  deterministic interleaving, instant deadlock detection.
- ``parallel``: all ranks run freely (numpy releases the GIL in its kernels), meeting at barriers.

One lock guards the world; each rank sleeps on its own wake-up token. A rank that finishes or waits
elsewhere while peers wait for it fails their collective at once (:class:`CollectiveAbandoned`); a
rank that never comes back makes them time out after ``timeout_s`` without progress. A rank may also
*start* a collective and wait for it later (:class:`PendingCollective`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import CollectiveError, CollectiveTimeout, ConfigError, require_positive_int
from .base import DEFAULT_TIMEOUT_S, TrafficCounter
from .collective_arrays import is_torch, read_only
from .fault_plan import FAULT_ENV, FaultCounter, FaultPlan, collective_plan
from .rendezvous import Call, CollectiveAbandoned, Group, Rendezvous

#: the simulator's schedules (see the module docstring)
SCHEDULES = ("serial", "parallel")


class Aborted(CollectiveError):
    """Internal: another rank failed first; this rank stops quietly."""


class SimulatedWorld:
    """Shared state of ``world_size`` simulated ranks: groups, rendezvous, per-rank traffic counters."""

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, schedule: str = "serial"):
        require_positive_int("world_size", world_size)
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")
        if schedule not in SCHEDULES:
            raise ConfigError("schedule", schedule, f"known: {', '.join(SCHEDULES)}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.schedule = schedule
        self.traffic = [TrafficCounter() for _ in range(world_size)]
        # One lock guards the world's state. Each rank sleeps, with that lock let go, on its own wake-up
        # token: a lock held while no wake-up is pending, released (under the world lock) by whoever
        # changes what that rank waits for (the next baton holder, a completed collective's members).
        # A woken rank re-checks the state under the world lock, so a stale token costs one extra look.
        self._lock = threading.Lock()
        self._tokens = [threading.Lock() for _ in range(world_size)]
        for token in self._tokens:
            token.acquire()
        self._groups: list[Group] = []
        self._next_seq: dict[tuple[int, int], int] = {}  # (gid, global rank) -> next call number
        self._pending: dict[tuple[int, int], Rendezvous] = {}  # (gid, seq) -> rendezvous
        self._status = ["ready"] * world_size  # ready | blocked | done
        self._n_ready = world_size
        self._waiting_on: dict[int, Rendezvous] = {}
        self._holder: int | None = 0 if schedule == "serial" else None
        self._last_progress = time.monotonic()
        self._last_call: dict[int, tuple[str, str]] = {}  # global rank -> (collective, group) it last entered
        self._failure: tuple[int, BaseException] | None = None
        self._shared: dict[Any, list[Any]] = {}
        self._derived: dict[tuple[int, Any], Any] = {}
        self.world_group = self._new_group("world", tuple(range(world_size)))
        self.faults = self._fault_counters()

    def _fault_counters(self) -> list[FaultCounter]:
        """One ``$ZEROSIM_FAULT`` collective counter per simulated rank (see the module docstring)."""
        plan = collective_plan(FaultPlan.from_env())
        if plan is not None and plan.kind == "kill":
            raise ConfigError(FAULT_ENV, plan.text, "kill needs one process per rank: use --backend mpi or "
                              "torch (the simulator's ranks are threads of this process)")
        return [FaultCounter(plan, r) for r in range(self.world_size)]

    def shared(self, key: Any, factory: Callable[[], Any]) -> Any:
        """A read-only value every rank of this world needs (the seed's initial parameters): built once
        by the first rank that asks, handed to each rank, and dropped when the last rank has taken it.
        Only the simulator has this (its ranks share a process); other backends build per rank."""
        with self._lock:
            entry = self._shared.get(key)
            if entry is None:
                entry = self._shared[key] = [factory(), 0]
            entry[1] += 1
            value = entry[0]
            if entry[1] >= self.world_size:
                del self._shared[key]
            return value

    def derived(self, source: Any, key: Any, factory: Callable[[], Any]) -> Any:
        """A read-only value computed from ``source``, a result every rank of a group shares (the
        all-gathered buffer, see :meth:`_complete`): the first rank that asks builds it, the others get
        the same array while ``source`` lives. Ranks stay separate in what they *hold*: each still
        accounts its own copy; only the identical arithmetic is done once."""
        ident = (id(source), key)
        with self._lock:
            if ident in self._derived:
                return self._derived[ident]
            value = factory()
            if not is_torch(value):
                read_only(value)
            self._derived[ident] = value
        weakref.finalize(source, self._forget_derived, ident)
        return value

    def _forget_derived(self, ident: tuple[int, Any]) -> None:
        with self._lock:
            self._derived.pop(ident, None)

    # -- groups -------------------------------------------------------------------------------------
    def _new_group(self, name: str, global_ranks: tuple[int, ...]) -> Group:
        g = Group(len(self._groups), name, global_ranks)
        self._groups.append(g)
        return g

    # -- rank lifecycle (called by run_spmd's threads) ---------------------------------------------
    def _enter(self, rank: int) -> None:
        with self._lock:
            self._wait_for_baton(rank, None)

    def _finish(self, rank: int, error: BaseException | None) -> None:
        with self._lock:
            self._set_status(rank, "done")
            if error is not None and not isinstance(error, Aborted) and self._failure is None:
                self._failure = (rank, error)
                self._wake_all()  # every waiting rank stops
            self._progress()
            if self._failure is None:
                self._pass_baton(rank)
                self._detect_deadlock()

    @property
    def failure(self) -> tuple[int, BaseException] | None:
        return self._failure

    # -- scheduling -------------------------------------------------------------------------------
    def _set_status(self, rank: int, status: str) -> None:
        self._n_ready += (status == "ready") - (self._status[rank] == "ready")
        self._status[rank] = status

    def _wake(self, ranks: Sequence[int]) -> None:
        tokens = self._tokens
        for r in ranks:
            token = tokens[r]
            if token.locked():  # no wake-up pending yet (the world lock orders every waker)
                token.release()

    def _wake_all(self) -> None:
        self._wake(range(self.world_size))

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def _pass_baton(self, rank: int) -> None:
        if self.schedule != "serial" or self._holder != rank:
            return
        n = self.world_size
        for i in range(1, n + 1):
            r = (rank + i) % n
            if self._status[r] == "ready":
                self._holder = r
                self._progress()
                self._wake((r,))
                return
        self._holder = None

    def _detect_deadlock(self) -> None:
        """Every rank is blocked or done and nothing can complete: fail the blocked collectives."""
        if self._n_ready:
            return
        blocked = [r for r, s in enumerate(self._status) if s == "blocked"]
        if not blocked:
            return
        for rv in {id(v): v for v in self._waiting_on.values()}.values():
            if rv.done:
                continue
            missing = rv.missing()
            detail = ", ".join(
                f"rank {m} {'finished' if self._status[m] == 'done' else 'waits in another collective'}"
                for m in missing
            )
            rv.error = CollectiveAbandoned(rv.collective, missing, rv.group.name, detail)
            rv.done = True
        self._wake_all()

    def _wait_for_baton(self, rank: int, rv: Rendezvous | None) -> None:
        """Block (holding the condition) until ``rv`` is done and, in serial mode, ``rank`` holds the baton.
        """
        start = time.monotonic()
        while True:
            if self._failure is not None:
                raise Aborted(f"rank {self._failure[0]} failed")
            ready = rv is None or rv.done
            if ready and (self.schedule != "serial" or self._holder == rank):
                return
            if ready and self.schedule == "serial" and self._holder is None:
                self._holder = rank
                return
            since = self._last_progress if self.schedule == "serial" else start
            remaining = self.timeout_s - (time.monotonic() - since)
            if remaining <= 0:
                raise self._timeout_error(rv)
            self._lock.release()
            try:
                self._tokens[rank].acquire(timeout=remaining)
            finally:
                self._lock.acquire()

    def _timeout_error(self, rv: Rendezvous | None) -> CollectiveTimeout:
        """Name the collective that could not complete and the ranks that never arrived at it."""
        if rv is None or rv.done:
            pending = [p for p in self._pending.values() if not p.done]
            rv = min(pending, key=lambda p: (p.group.gid, p.seq)) if pending else None
        if rv is not None:
            return CollectiveTimeout(rv.collective, rv.missing(), self.timeout_s, rv.group.name)
        # Serial schedule, nobody waits in a collective: the rank holding the baton never came back to
        # its next collective (an endless computation between two collectives).
        stuck = [self._holder] if self._holder is not None else []
        last = self._last_call.get(self._holder) if self._holder is not None else None
        if last is None:
            return CollectiveTimeout("first collective", stuck, self.timeout_s, "world")
        return CollectiveTimeout(f"next collective after {last[0]}", stuck, self.timeout_s, last[1])

    # -- the collective core --------------------------------------------------------------------------
    def _collective(self, group: Group, grank: int, call: Call) -> Any:
        with self._lock:
            rv = self._arrive(group, grank, call)
            return self._await(group.global_ranks[grank], grank, rv)

    def _start(self, group: Group, grank: int, call: Call, into: Any = None) -> PendingCollective:
        """Enter a collective without waiting for it: the rank runs on; :meth:`PendingCollective.wait`
        blocks until every member has entered and returns this rank's result (written into ``into``
        when given)."""
        with self._lock:
            rv = self._arrive(group, grank, call)
            return PendingCollective(self, group.global_ranks[grank], grank, rv, into)

    def _wait_started(self, rank: int, grank: int, rv: Rendezvous) -> Any:
        with self._lock:
            return self._await(rank, grank, rv)

    def _arrive(self, group: Group, grank: int, call: Call) -> Rendezvous:
        """Register ``call`` at its rendezvous (the group's next call of this rank); the last member to
        arrive completes it and makes its waiting members ready. Holds the world lock."""
        rank = group.global_ranks[grank]
        if self._failure is not None:
            raise Aborted(f"rank {self._failure[0]} failed")
        key = (group.gid, rank)
        seq = self._next_seq.get(key, 0)
        self._next_seq[key] = seq + 1
        rv = self._pending.get((group.gid, seq))
        if rv is None:
            rv = self._pending[(group.gid, seq)] = Rendezvous(group, seq)
        rv.calls[grank] = call
        rv.fold()
        self._last_call[rank] = (call.collective, group.name)
        self._progress()
        if len(rv.calls) == len(group.global_ranks):
            del self._pending[(group.gid, seq)]
            try:
                rv.results = rv.complete(self._new_group)
            except BaseException as e:  # reported to every member, not just the last to arrive
                rv.error = e
            rv.acc = None
            rv.done = True
            for g in group.global_ranks:
                if self._status[g] == "blocked" and self._waiting_on.get(g) is rv:
                    self._set_status(g, "ready")
                    del self._waiting_on[g]
            if self.schedule != "serial" or self._holder is None:
                self._wake(group.global_ranks)
        return rv

    def _await(self, rank: int, grank: int, rv: Rendezvous) -> Any:
        """Block until ``rv`` is complete (and, serial schedule, this rank holds the baton again);
        return this rank's result or raise the collective's error. Holds the world lock."""
        if not rv.done:
            self._set_status(rank, "blocked")
            self._waiting_on[rank] = rv
            self._pass_baton(rank)
            self._detect_deadlock()
            try:
                self._wait_for_baton(rank, rv)
            finally:
                if self._waiting_on.get(rank) is rv:
                    del self._waiting_on[rank]
                if self._status[rank] == "blocked":
                    self._set_status(rank, "ready")
        self._yield_to_first(rank, rv.group)
        if rv.error is not None:
            raise rv.error
        return rv.results.pop(grank)

    def _yield_to_first(self, rank: int, group: Group) -> None:
        """Serial schedule: a rank taking a completed collective's result hands the baton to the
        group's first rank when that one is ready, and waits for it to come back. The lower ranks then
        run first: they are the ones a reduction folds first, so a rank that started reductions ahead
        is added while its buffers are fresh instead of being held until rank 0 arrives."""
        first = group.global_ranks[0]
        if (self.schedule != "serial" or self._holder != rank or first == rank
                or self._status[first] != "ready"):
            return
        self._holder = first
        self._progress()
        self._wake((first,))
        self._wait_for_baton(rank, None)


class PendingCollective:
    """A collective a simulated rank has entered without waiting (``all_reduce_start``,
    ``all_gather_start``, ``reduce_scatter_start``). Until :meth:`wait` returns, the caller leaves
    the input array alone."""

    def __init__(self, world: SimulatedWorld, rank: int, grank: int, rv: Rendezvous, into: Any = None):
        self._world, self._rank, self._grank, self._rv, self._into = world, rank, grank, rv, into
        self._result: Any = None
        self._waited = False

    def wait(self) -> Any:
        """This rank's result (blocks until every member of the group has entered the collective)."""
        if not self._waited:
            result = self._world._wait_started(self._rank, self._grank, self._rv)
            if self._into is not None:  # an all-reduce lands in its input, as torch's all_reduce_start
                if is_torch(self._into):
                    self._into.copy_(result)
                else:
                    self._into[...] = result
                result = self._into
            self._result, self._waited = result, True
        return self._result
