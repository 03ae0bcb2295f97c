"""The in-process simulator: N ranks in one process, each running the same SPMD program.

Every rank is a thread running ``fn(comm)``. Collectives meet at a *rendezvous* (one per group and
call number). A reduction adds each member's input into one accumulator as soon as every lower
member's is in (``((x0 op x1) op x2) ...``, so a run is bitwise reproducible, and a pending
reduction holds one buffer rather than one per rank); an all-gather is computed once, by the last
member to arrive, and shared read-only. A rank may also *start* a collective and wait for it later
(:class:`PendingCollective`), which the ZeRO-3 engine uses to run a whole micro-batch ahead.

Two schedules keep the same semantics:

- ``serial`` (default): one rank runs at a time. A rank runs until it blocks in a collective that
  is still waiting for peers, then hands the baton to the next runnable rank (cyclic rank order);
  a rank taking a completed collective's result first hands the baton to the group's first rank
  when that one can run, so lower ranks go first. No oversubscription of the BLAS threads,
  deterministic interleaving, instant deadlock detection.
- ``parallel``: all ranks run freely (numpy releases the GIL in its kernels), meeting at barriers.

Failure handling (a distributed run must never hang):

- a rank that raises aborts the world: every waiting peer wakes and stops; :func:`run_spmd` re-raises
  the first real error (a :class:`ZeroSimError` unchanged, anything else as :class:`RankFailed`
  naming the rank);
- a rank that finishes (or blocks elsewhere) while peers wait for it is detected at once as a
  :class:`CollectiveAbandoned` naming the collective, the group and the ranks that never arrived;
- a rank that never comes back (an endless computation) makes its peers raise ``CollectiveTimeout``
  after ``timeout_s`` without progress, naming the missing ranks;
- mismatched calls (all_gather on one rank, all_reduce on another; different shapes) raise
  :class:`CollectiveMismatch` on every member.

Test-only fault hook: ``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes simulated rank ``R`` raise when it
enters its ``K``-th collective (0-based, every group and ``split`` counted, one counter per rank),
``"hang:rank=R:call=K"`` makes its thread sleep forever there instead (its peers' timeout ends the
run): the same descriptions as under ``mpiexec`` and ``torchrun`` (:mod:`zerosim.comm.fault_plan`).
``kill`` needs a process per rank and is refused here (ConfigError).

Traffic is accounted per rank, attributed to the ring algorithm (see :mod:`zerosim.comm.base`).

Why one module of this length: the world, its rendezvous and the communicator that enters it are
one mechanism (a collective is a rendezvous of the group's ranks); splitting them would expose the
world's locking to a second module.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from ..errors import CollectiveError, CollectiveTimeout, ConfigError, ZeroSimError, require_positive_int
from .base import DEFAULT_TIMEOUT_S, REDUCE_OPS, TrafficCounter, dtype_name
from .fault_plan import FAULT_ENV, FaultCounter, FaultPlan, collective_plan

SCHEDULES = ("serial", "parallel")


class CollectiveAbandoned(CollectiveError):
    """Peers wait in a collective that some members can never join (they finished or wait elsewhere)."""

    def __init__(self, collective: str, missing_ranks: list[int], group: str, detail: str = ""):
        self.collective = collective
        self.missing_ranks = list(missing_ranks)
        self.group = group
        super().__init__(
            f"{collective} on group {group} can never complete; ranks that never arrived: "
            f"{self.missing_ranks}{' (' + detail + ')' if detail else ''}"
        )


class CollectiveMismatch(CollectiveError):
    """Members of one group called different collectives (or shapes, dtypes, ops, roots) at the same point."""


class RankFailed(CollectiveError):
    """A rank raised an exception that is not a ZeroSimError; names the rank, chains the original."""

    def __init__(self, rank: int, error: BaseException):
        self.rank = rank
        self.error = error
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}")


class _Aborted(CollectiveError):
    """Internal: another rank failed first; this rank stops quietly."""


# ---- the handful of array operations a collective needs (numpy and torch) -------------------------

def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def _copy(x: Any) -> Any:
    return x.clone() if _is_torch(x) else x.copy()


def _concat(xs: Sequence[Any]) -> Any:
    if _is_torch(xs[0]):
        import torch

        return torch.cat(list(xs))
    import numpy as np

    return np.concatenate(list(xs))


def _combine_into(acc: Any, x: Any, op: str) -> None:
    """``acc = acc op x`` in place (``avg`` adds: the division comes once, at the end)."""
    if op != "max":
        acc += x
    elif _is_torch(acc):
        import torch

        torch.maximum(acc, x, out=acc)
    else:
        import numpy as np

        np.maximum(acc, x, out=acc)


def reduce_in_rank_order(xs: Sequence[Any], op: str) -> Any:
    """((x0 op x1) op x2) ...; ``avg`` is the rank-order sum divided by len(xs). A new array."""
    if op not in REDUCE_OPS:
        raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
    acc = _copy(xs[0])
    for x in xs[1:]:
        _combine_into(acc, x, op)
    if op == "avg":
        acc /= len(xs)
    return acc


def _is_floating(x: Any) -> bool:
    """Whether ``x`` holds floating or complex values (what ``avg`` can divide without truncating)."""
    if _is_torch(x):
        return bool(x.is_floating_point() or x.is_complex())
    return x.dtype.kind in "fcV"  # V: ml_dtypes' bfloat16


def _dtype_name(x: Any) -> str:
    return str(x.dtype).removeprefix("torch.")


def _read_only(x: Any) -> Any:
    """numpy results shared by every rank are made read-only, so a rank cannot corrupt its peers."""
    if not _is_torch(x):
        x.flags.writeable = False
    return x


def _nbytes(x: Any) -> int:
    if _is_torch(x):
        return int(x.numel() * x.element_size())
    return int(x.nbytes)


def _signature(x: Any) -> tuple[type, tuple[int, ...], Any]:
    """(array type, shape, dtype) of a collective's array, compared across the group's members: the
    dtype object itself, cheap to compare (only a mismatch message spells out its name); the type
    first, so dtypes of different array libraries are never compared with each other."""
    return type(x), tuple(x.shape), x.dtype


# ---- world state ----------------------------------------------------------------------------------

@dataclass
class _Group:
    gid: int
    name: str
    global_ranks: tuple[int, ...]


@dataclass
class _Call:
    collective: str
    op: str | None
    array: Any
    root: int | None
    extra: Any = None
    donated: bool = False  # the caller never reads ``array`` again: it may become the accumulator
    signature: Any = None  # (type, shape, dtype) of ``array``, kept after a fold drops the array

    def __post_init__(self) -> None:
        if self.array is not None:
            self.signature = _signature(self.array)

    def matches(self, other: _Call) -> bool:
        return (self.collective, self.op, self.root, self.signature) == (
            other.collective, other.op, other.root, other.signature)


#: the collectives whose members' arrays are folded into one accumulator as they arrive
_FOLDED = ("all_reduce", "reduce_scatter")


@dataclass
class _Rendezvous:
    group: _Group
    seq: int
    calls: dict[int, _Call] = field(default_factory=dict)  # group rank -> call
    results: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    done: bool = False
    acc: Any = None  # reductions: ((x0 op x1) op x2) ... of the members folded so far
    folded: int = 0  # members 0 .. folded-1 are in ``acc`` (their arrays dropped)

    def fold(self) -> None:
        """Reductions: add every member whose predecessors are all in, in rank order, as soon as it
        arrives (the same additions, in the same order, as reducing at the end), and drop its array.
        A member that arrives while it is still hot in cache is added then, and the rendezvous holds
        one accumulator instead of every member's buffer. A call that does not match member 0's stops
        the folding; completing the rendezvous then reports the mismatch."""
        first = self.calls.get(0)
        if first is None or first.collective not in _FOLDED:
            return
        while self.folded in self.calls:
            call = self.calls[self.folded]
            if not call.matches(first):
                return
            x = call.array
            if self.folded == 0:
                self.acc = x if call.donated else _copy(x)
            else:
                _combine_into(self.acc, x, first.op or "sum")
            call.array = None
            self.folded += 1

    @property
    def collective(self) -> str:
        return next(iter(self.calls.values())).collective if self.calls else "?"

    def missing(self) -> list[int]:
        return [g for i, g in enumerate(self.group.global_ranks) if i not in self.calls]


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
        self._groups: list[_Group] = []
        self._next_seq: dict[tuple[int, int], int] = {}  # (gid, global rank) -> next call number
        self._pending: dict[tuple[int, int], _Rendezvous] = {}  # (gid, seq) -> rendezvous
        self._status = ["ready"] * world_size  # ready | blocked | done
        self._n_ready = world_size
        self._waiting_on: dict[int, _Rendezvous] = {}
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
            if not _is_torch(value):
                _read_only(value)
            self._derived[ident] = value
        weakref.finalize(source, self._forget_derived, ident)
        return value

    def _forget_derived(self, ident: tuple[int, Any]) -> None:
        with self._lock:
            self._derived.pop(ident, None)

    # -- groups -------------------------------------------------------------------------------------
    def _new_group(self, name: str, global_ranks: tuple[int, ...]) -> _Group:
        g = _Group(len(self._groups), name, global_ranks)
        self._groups.append(g)
        return g

    def communicator(self, rank: int) -> SimCommunicator:
        """The world communicator of ``rank``."""
        return SimCommunicator(self, self.world_group, rank)

    # -- rank lifecycle (called by run_spmd's threads) ---------------------------------------------
    def _enter(self, rank: int) -> None:
        with self._lock:
            self._wait_for_baton(rank, None)

    def _finish(self, rank: int, error: BaseException | None) -> None:
        with self._lock:
            self._set_status(rank, "done")
            if error is not None and not isinstance(error, _Aborted) and self._failure is None:
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

    def _wait_for_baton(self, rank: int, rv: _Rendezvous | None) -> None:
        """Block (holding the condition) until ``rv`` is done and, in serial mode, ``rank`` holds the baton.
        """
        start = time.monotonic()
        while True:
            if self._failure is not None:
                raise _Aborted(f"rank {self._failure[0]} failed")
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

    def _timeout_error(self, rv: _Rendezvous | None) -> CollectiveTimeout:
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
    def _collective(self, group: _Group, grank: int, call: _Call) -> Any:
        with self._lock:
            rv = self._arrive(group, grank, call)
            return self._await(group.global_ranks[grank], grank, rv)

    def _start(self, group: _Group, grank: int, call: _Call, into: Any = None) -> PendingCollective:
        """Enter a collective without waiting for it: the rank runs on; :meth:`PendingCollective.wait`
        blocks until every member has entered and returns this rank's result (written into ``into``
        when given)."""
        with self._lock:
            rv = self._arrive(group, grank, call)
            return PendingCollective(self, group.global_ranks[grank], grank, rv, into)

    def _wait_started(self, rank: int, grank: int, rv: _Rendezvous) -> Any:
        with self._lock:
            return self._await(rank, grank, rv)

    def _arrive(self, group: _Group, grank: int, call: _Call) -> _Rendezvous:
        """Register ``call`` at its rendezvous (the group's next call of this rank); the last member to
        arrive completes it and makes its waiting members ready. Holds the world lock."""
        rank = group.global_ranks[grank]
        if self._failure is not None:
            raise _Aborted(f"rank {self._failure[0]} failed")
        key = (group.gid, rank)
        seq = self._next_seq.get(key, 0)
        self._next_seq[key] = seq + 1
        rv = self._pending.get((group.gid, seq))
        if rv is None:
            rv = self._pending[(group.gid, seq)] = _Rendezvous(group, seq)
        rv.calls[grank] = call
        rv.fold()
        self._last_call[rank] = (call.collective, group.name)
        self._progress()
        if len(rv.calls) == len(group.global_ranks):
            del self._pending[(group.gid, seq)]
            try:
                rv.results = self._complete(rv)
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

    def _await(self, rank: int, grank: int, rv: _Rendezvous) -> Any:
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

    def _yield_to_first(self, rank: int, group: _Group) -> None:
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

    def _complete_split(self, parent: _Group, seq: int, tokens: list[Any]) -> dict[int, Any]:
        """One new group per color, members ordered by (key, parent rank); each member gets its group."""
        by_color: dict[int, list[tuple[Any, int, str | None]]] = {}
        for grank, (color, key, name) in enumerate(tokens):
            if color is not None:
                by_color.setdefault(color, []).append((key, grank, name))
        table: dict[int, _Group] = {}
        for color, members in sorted(by_color.items()):
            members.sort(key=lambda m: (m[0], m[1]))
            names = {m[2] for m in members}
            if len(names) > 1:
                raise CollectiveMismatch(
                    f"split of group {parent.name}: members of color {color} disagree on "
                    f"the group name: {sorted(str(n) for n in names)}"
                )

            name = names.pop() or f"{parent.name}/split{seq}:{color}"
            table[color] = self._new_group(name, tuple(parent.global_ranks[m[1]] for m in members))
        return {grank: (None if tok[0] is None else table[tok[0]]) for grank, tok in enumerate(tokens)}

    def _complete(self, rv: _Rendezvous) -> dict[int, Any]:
        calls = [rv.calls[i] for i in range(len(rv.group.global_ranks))]
        first = calls[0]
        for i, c in enumerate(calls):
            if (c.collective, c.op, c.root) != (first.collective, first.op, first.root):
                raise CollectiveMismatch(
                    f"group {rv.group.name} call #{rv.seq}: rank {rv.group.global_ranks[0]} called "
                    f"{first.collective}(op={first.op}, root={first.root}) but rank "
                    f"{rv.group.global_ranks[i]} "
                    f"called {c.collective}(op={c.op}, root={c.root})"
                )
        kind = first.collective
        n = len(calls)
        if kind == "barrier":
            return {i: None for i in range(n)}
        if kind == "split":
            return self._complete_split(rv.group, rv.seq, [c.extra for c in calls])
        sigs = [c.signature for c in calls]
        if any(s != sigs[0] for s in sigs):
            detail = ", ".join(f"rank {rv.group.global_ranks[i]}: {(tuple(int(d) for d in s[1]), str(s[2]))}"
                               for i, s in enumerate(sigs))
            raise CollectiveMismatch(
                f"{kind} on group {rv.group.name} call #{rv.seq}: shapes/dtypes differ ({detail})"
            )
        if kind in _FOLDED:
            # every member matched, so every member was folded into ``acc`` in rank order as it arrived
            assert rv.folded == n, (rv.folded, n)
            total = rv.acc
            if first.op == "avg":
                total /= n
        if kind == "all_reduce":
            return {i: (total if i == n - 1 else _copy(total)) for i in range(n)}
        if kind == "reduce_scatter":
            length = sigs[0][1][0] if sigs[0][1] else 0
            chunk = length // n
            # the whole buffer reduced in rank order once (element by element the same arithmetic as
            # reducing each chunk apart), then rank j gets its own chunk of it: n adds of the buffer,
            # not n * n slices
            return {j: total[j * chunk:(j + 1) * chunk] for j in range(n)}
        xs = [call.array for call in calls]
        if kind == "all_gather":
            out = _concat(xs)
            if _is_torch(out):
                return {i: (out if i == n - 1 else _copy(out)) for i in range(n)}
            _read_only(out)
            return {i: out for i in range(n)}
        if kind == "broadcast":
            src = xs[first.root or 0]
            return {i: (xs[i] if i == first.root else _copy(src)) for i in range(n)}
        raise CollectiveError(f"unknown collective {kind!r}")


class PendingCollective:
    """A collective a simulated rank has entered without waiting (``all_reduce_start``,
    ``all_gather_start``, ``reduce_scatter_start``). Until :meth:`wait` returns, the caller leaves
    the input array alone."""

    def __init__(self, world: SimulatedWorld, rank: int, grank: int, rv: _Rendezvous, into: Any = None):
        self._world, self._rank, self._grank, self._rv, self._into = world, rank, grank, rv, into
        self._result: Any = None
        self._waited = False

    def wait(self) -> Any:
        """This rank's result (blocks until every member of the group has entered the collective)."""
        if not self._waited:
            result = self._world._wait_started(self._rank, self._grank, self._rv)
            if self._into is not None:  # an all-reduce lands in its input, as torch's all_reduce_start
                if _is_torch(self._into):
                    self._into.copy_(result)
                else:
                    self._into[...] = result
                result = self._into
            self._result, self._waited = result, True
        return self._result


class SimCommunicator:
    """One rank's view of one group of a :class:`SimulatedWorld` (implements ``Communicator``).

    Beyond the protocol it can *start* an all-reduce, an all-gather or a reduce-scatter and wait for
    it later (``shares_results``: an all-gather's result is one read-only array every member shares,
    so a rank that starts many of them ahead costs the process one copy, not one per rank). The
    engine uses that to let each rank run its whole micro-batch before the next rank runs its own."""

    shares_results = True

    def __init__(self, world: SimulatedWorld, group: _Group, global_rank: int):
        self._world = world
        self._group = group
        self.global_rank = global_rank
        self.rank = group.global_ranks.index(global_rank)
        self.world_size = len(group.global_ranks)
        self.group_name = group.name
        self.global_ranks = group.global_ranks
        self.traffic = world.traffic[global_rank]
        self.backend = "sim"
        self._fault = world.faults[global_rank]

    def __repr__(self) -> str:
        return f"SimCommunicator(group={self.group_name!r}, rank={self.rank}/{self.world_size})"

    def shared(self, key: Any, factory: Callable[[], Any]) -> Any:
        """See :meth:`SimulatedWorld.shared` (a simulator-only convenience; the engine falls back without it).
        """
        return self._world.shared(key, factory)

    def derived(self, source: Any, key: Any, factory: Callable[[], Any]) -> Any:
        """See :meth:`SimulatedWorld.derived`: a value computed once from a result all ranks share, when
        ``source`` is such a result (a read-only numpy array); otherwise ``factory()`` for this rank."""
        if _is_torch(source) or getattr(source, "flags", None) is None or source.flags.writeable:
            return factory()
        return self._world.derived(source, key, factory)

    # -- helpers ----------------------------------------------------------------------------------
    def _check_1d(self, collective: str, x: Any) -> None:
        if len(x.shape) != 1:
            raise CollectiveError(
                f"{collective} on group {self.group_name}: rank {self.global_rank} passed a "
                f"{len(x.shape)}-D array; flat 1-D buffers only"
            )

    def _check_op(self, op: str, x: Any) -> None:
        if op not in REDUCE_OPS:
            raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
        if op == "avg" and not _is_floating(x):
            raise ConfigError("op", op, f"avg needs a floating dtype, got {_dtype_name(x)}")

    def _run(
        self, collective: str, x: Any, op: str | None = None, root: int | None = None, extra: Any = None,
        *, donated: bool = False, wait: bool = True, into: Any = None,
    ) -> Any:
        if self._fault.plan is not None:
            self._fault.tick(collective, self.group_name)
        call = _Call(collective, op, x, root, extra, donated)
        if wait:
            return self._world._collective(self._group, self.rank, call)
        return self._world._start(self._group, self.rank, call, into)

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        self._check_op(op, x)
        self.traffic.record(self.group_name, "all_reduce", _nbytes(x), self.world_size, dtype=dtype_name(x))
        return self._run("all_reduce", x, op)

    def all_reduce_start(self, x: Any, op: str = "sum") -> PendingCollective:
        """:meth:`all_reduce` without waiting, reducing ``x`` in place as torch's ``all_reduce_start``
        does: ``wait()`` writes the result into ``x`` and returns it."""
        self._check_op(op, x)
        self.traffic.record(self.group_name, "all_reduce", _nbytes(x), self.world_size, dtype=dtype_name(x))
        return self._run("all_reduce", x, op, wait=False, into=x)

    def reduce_scatter(self, x: Any, op: str = "sum", *, donate: bool = False) -> Any:
        """A donated ``x`` of group rank 0 becomes the accumulator the others are added into (and
        every member's result is a view of it); other inputs are never written."""
        return self._reduce_scatter(x, op, donate, wait=True)

    def reduce_scatter_start(self, x: Any, op: str = "sum", *, donate: bool = False) -> PendingCollective:
        """:meth:`reduce_scatter` without waiting: ``x`` is added into the accumulator as soon as
        the lower ranks' inputs are in (so a donated buffer is free by then); ``wait()`` returns the chunk."""
        return self._reduce_scatter(x, op, donate, wait=False)

    def _reduce_scatter(self, x: Any, op: str, donate: bool, *, wait: bool) -> Any:
        self._check_op(op, x)
        self._check_1d("reduce_scatter", x)
        if x.shape[0] % self.world_size:
            raise CollectiveError(f"reduce_scatter on group {self.group_name}: length {x.shape[0]} on rank "
                                  f"{self.global_rank} is not divisible by the group size {self.world_size}")
        self.traffic.record(self.group_name, "reduce_scatter", _nbytes(x), self.world_size,
                            dtype=dtype_name(x))
        return self._run("reduce_scatter", x, op, donated=donate, wait=wait)

    def all_gather(self, x: Any) -> Any:
        return self._all_gather(x, wait=True)

    def all_gather_start(self, x: Any) -> PendingCollective:
        """:meth:`all_gather` without waiting; ``wait()`` returns the shared result."""
        return self._all_gather(x, wait=False)

    def _all_gather(self, x: Any, *, wait: bool) -> Any:
        self._check_1d("all_gather", x)
        self.traffic.record(self.group_name, "all_gather", _nbytes(x) * self.world_size, self.world_size,
                            dtype=dtype_name(x))
        return self._run("all_gather", x, wait=wait)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError(
                "root", root, f"must be a rank of group {self.group_name} (size {self.world_size})"
            )
        self.traffic.record(
            self.group_name, "broadcast", _nbytes(x), self.world_size, is_root=self.rank == root,
            dtype=dtype_name(x),
        )
        return self._run("broadcast", x, root=root)

    def barrier(self) -> None:
        self.traffic.record(self.group_name, "barrier", 0, self.world_size)
        self._run("barrier", None)

    @overload
    def split(self, color: int, key: int | None = None, name: str | None = None) -> SimCommunicator: ...
    @overload
    def split(self, color: None, key: int | None = None, name: str | None = None) -> None: ...

    def split(
        self, color: int | None, key: int | None = None, name: str | None = None
    ) -> SimCommunicator | None:
        """``MPI_Comm_split``: ranks with the same color form a group, ordered by (key, rank).

        ``color=None`` opts out (returns None). ``name`` names the new group for traffic accounting
        (members of one color must agree on it); the default is ``<parent>/split<k>:<color>``.
        """
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ConfigError("color", color, "must be a non-negative integer or None")
        token = (color, self.rank if key is None else key, name)
        group = self._run("split", None, extra=token)
        return None if group is None else SimCommunicator(self._world, group, self.global_rank)



# ---- the launcher -------------------------------------------------------------------------------------

def run_spmd(world_size: int, fn: Callable[[SimCommunicator], Any], timeout_s: float = DEFAULT_TIMEOUT_S,
             schedule: str = "serial", world: SimulatedWorld | None = None) -> list[Any]:
    """Run ``fn(comm)`` on every rank of a fresh simulated world; return the per-rank results in rank order.

    The first real failure is re-raised: a ZeroSimError as it is (with a note naming the rank), any
    other exception as :class:`RankFailed` naming the rank (chained to the original). Never hangs:
    collectives time out after ``timeout_s`` without progress, and threads are daemons.
    """
    world = world or SimulatedWorld(world_size, timeout_s, schedule)
    if world.world_size != world_size:
        raise ConfigError("world_size", world_size, f"does not match the given world ({world.world_size})")
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        err: BaseException | None = None
        try:
            world._enter(rank)
            results[rank] = fn(world.communicator(rank))
        except BaseException as e:  # noqa: BLE001 - every failure is reported by the launcher
            err = e
            errors[rank] = e
        finally:
            world._finish(rank, err)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"sim-rank-{r}", daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.05)
            if world.failure is not None:
                break
        if world.failure is not None:
            break
    if world.failure is not None:
        # give the other ranks a moment to notice the abort; a rank stuck in computation stays a daemon
        deadline = time.monotonic() + min(world.timeout_s, 5.0)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        rank, err = world.failure
        if isinstance(err, ZeroSimError):
            if hasattr(err, "add_note"):
                err.add_note(f"(raised on simulated rank {rank} of {world_size})")
            raise err
        raise RankFailed(rank, err) from err
    return results
