"""The in-process simulator: N ranks in one process, each running the same SPMD program.

Every rank is a thread running ``fn(comm)``. Collectives meet at a *rendezvous* (one per group and
call number). A reduction adds each member's input into one accumulator as soon as every lower
member's is in (``((x0 op x1) op x2) ...``, so a run is bitwise reproducible, and a pending
reduction holds one buffer rather than one per rank); an all-gather is computed once, by the last
member to arrive, and shared read-only. A rank may also *start* a collective and wait for it later
(:class:`~zerosim.comm.sim_world.PendingCollective`), which the ZeRO-3 engine uses to run a whole
micro-batch ahead.

Two schedules keep the same semantics: ``serial`` (default: one rank runs at a time, so the
interleaving is deterministic and a deadlock is found at once) and ``parallel`` (every rank runs
freely); :mod:`zerosim.comm.sim_world` says how each hands the ranks on.

Failure handling (a distributed run must never hang):

- a rank that raises aborts the world: every waiting peer wakes and stops; :func:`run_spmd` re-raises
  the first real error (a :class:`ZeroSimError` unchanged, anything else as :class:`RankFailed`
  naming the rank);
- a rank that finishes (or blocks elsewhere) while peers wait for it is detected at once as a
  :class:`~zerosim.comm.rendezvous.CollectiveAbandoned` naming the collective, the group and the
  ranks that never arrived;
- a rank that never comes back (an endless computation) makes its peers raise ``CollectiveTimeout``
  after ``timeout_s`` without progress, naming the missing ranks;
- mismatched calls (all_gather on one rank, all_reduce on another; different shapes) raise
  :class:`~zerosim.comm.rendezvous.CollectiveMismatch` on every member.

Test-only fault hook: ``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes simulated rank ``R`` raise when it
enters its ``K``-th collective (0-based, every group and ``split`` counted, one counter per rank),
``"hang:rank=R:call=K"`` makes its thread sleep forever there instead (its peers' timeout ends the
run): the same descriptions as under ``mpiexec`` and ``torchrun`` (:mod:`zerosim.comm.fault_plan`).
``kill`` needs a process per rank and is refused here (ConfigError).

Traffic is accounted per rank, attributed to the ring algorithm (see :mod:`zerosim.comm.base`).

The parts: :mod:`zerosim.comm.sim_world` (the world, its schedules and waiting),
:mod:`zerosim.comm.rendezvous` (one collective's meeting, folding and completion) and
:mod:`zerosim.comm.collective_arrays` (the array operations they need, numpy or torch); this module is
a rank's communicator and the launcher.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, overload

from ..errors import CollectiveError, ConfigError, ZeroSimError
from .base import DEFAULT_TIMEOUT_S, REDUCE_OPS, dtype_name
from .collective_arrays import combine_into, copy_array, is_floating, is_torch, nbytes
from .rendezvous import Call, Group
from .sim_world import SCHEDULES, PendingCollective, SimulatedWorld

__all__ = ["SCHEDULES", "RankFailed", "SimCommunicator", "reduce_in_rank_order", "run_spmd"]


class RankFailed(CollectiveError):
    """A rank raised an exception that is not a ZeroSimError; names the rank, chains the original."""

    def __init__(self, rank: int, error: BaseException):
        self.rank = rank
        self.error = error
        super().__init__(f"rank {rank} failed: {type(error).__name__}: {error}")


def reduce_in_rank_order(xs: Sequence[Any], op: str) -> Any:
    """((x0 op x1) op x2) ...; ``avg`` is the rank-order sum divided by len(xs). A new array."""
    if op not in REDUCE_OPS:
        raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
    acc = copy_array(xs[0])
    for x in xs[1:]:
        combine_into(acc, x, op)
    if op == "avg":
        acc /= len(xs)
    return acc


class SimCommunicator:
    """One rank's view of one group of a :class:`SimulatedWorld` (implements ``Communicator``).

    Beyond the protocol it can *start* an all-reduce, an all-gather or a reduce-scatter and wait for
    it later (``shares_results``: an all-gather's result is one read-only array every member shares,
    so a rank that starts many of them ahead costs the process one copy, not one per rank). The
    engine uses that to let each rank run its whole micro-batch before the next rank runs its own."""

    shares_results = True

    def __init__(self, world: SimulatedWorld, group: Group, global_rank: int):
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
        if is_torch(source) or getattr(source, "flags", None) is None or source.flags.writeable:
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
        if op == "avg" and not is_floating(x):
            raise ConfigError("op", op, f"avg needs a floating dtype, got {dtype_name(x)}")

    def _run(
        self, collective: str, x: Any, op: str | None = None, root: int | None = None, extra: Any = None,
        *, donated: bool = False, wait: bool = True, into: Any = None,
    ) -> Any:
        if self._fault.plan is not None:
            self._fault.tick(collective, self.group_name)
        call = Call(collective, op, x, root, extra, donated)
        if wait:
            return self._world._collective(self._group, self.rank, call)
        return self._world._start(self._group, self.rank, call, into)

    # -- collectives --------------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        self._check_op(op, x)
        self.traffic.record(self.group_name, "all_reduce", nbytes(x), self.world_size, dtype=dtype_name(x))
        return self._run("all_reduce", x, op)

    def all_reduce_start(self, x: Any, op: str = "sum") -> PendingCollective:
        """:meth:`all_reduce` without waiting, reducing ``x`` in place as torch's ``all_reduce_start``
        does: ``wait()`` writes the result into ``x`` and returns it."""
        self._check_op(op, x)
        self.traffic.record(self.group_name, "all_reduce", nbytes(x), self.world_size, dtype=dtype_name(x))
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
        self.traffic.record(self.group_name, "reduce_scatter", nbytes(x), self.world_size,
                            dtype=dtype_name(x))
        return self._run("reduce_scatter", x, op, donated=donate, wait=wait)

    def all_gather(self, x: Any) -> Any:
        return self._all_gather(x, wait=True)

    def all_gather_start(self, x: Any) -> PendingCollective:
        """:meth:`all_gather` without waiting; ``wait()`` returns the shared result."""
        return self._all_gather(x, wait=False)

    def _all_gather(self, x: Any, *, wait: bool) -> Any:
        self._check_1d("all_gather", x)
        self.traffic.record(self.group_name, "all_gather", nbytes(x) * self.world_size, self.world_size,
                            dtype=dtype_name(x))
        return self._run("all_gather", x, wait=wait)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError(
                "root", root, f"must be a rank of group {self.group_name} (size {self.world_size})"
            )
        self.traffic.record(
            self.group_name, "broadcast", nbytes(x), self.world_size, is_root=self.rank == root,
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
            results[rank] = fn(SimCommunicator(world, world.world_group, rank))
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
