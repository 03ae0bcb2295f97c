"""The mpi4py Communicator: the engine's collectives as MPI buffer calls, one process per rank.

Implements :class:`zerosim.comm.base.Communicator` with mpi4py's buffer-based (upper-case) calls
only: ``Allreduce``, ``Reduce_scatter_block``, ``Allgather``, ``Bcast``, ``Barrier`` (and their
``I``-prefixed nonblocking forms) and ``Comm.Split`` for the hybrid shard / replicate groups. Nothing
is pickled on the data path. Traffic is recorded exactly as the simulator records it (ring
attribution, :func:`zerosim.comm.base.ring_bytes`; :mod:`zerosim.comm.mpi_traffic`), so C-ZERO-005 and
the communication model mean the same thing under ``mpiexec`` as in one process. Datatypes and
reduction plans on the wire: :mod:`zerosim.comm.mpi_wire`.

Arithmetic (what makes a run comparable with the simulator, bit for bit where possible):

- ``sum`` is MPI's ``SUM`` in the buffer's dtype; ``avg`` is that sum divided in place by the group
  size (``out /= n``), the simulator's arithmetic; ``max`` is ``MAX``.
- MPI fixes neither the order nor the grouping of a reduction. Over **two** ranks it is one
  commutative addition (``x0 + x1 == x1 + x0`` in IEEE arithmetic), so results are **bitwise equal**
  to the simulator's rank-order sum. Over more ranks MPICH / Open MPI pick recursive doubling,
  Rabenseifner or ring algorithms by message size (``(x0+x1)+(x2+x3)`` ...) while the simulator sums
  ``((x0+x1)+x2)+x3``: results then agree within the summation bound of
  :func:`zerosim.checks.agreement.reordered_sum_bound`.
  ``max``, integer sums, ``all_gather`` and ``broadcast`` are exact at every size.
- ``bfloat16`` (ml_dtypes), ``float16`` and ``bool`` have no portable MPI reduction datatype: they
  are reduced in ``float32`` and rounded back **once**, then ``avg`` divides in the 16-bit dtype like
  the simulator. Over two ranks this equals the simulator's 16-bit addition exactly (one addition,
  one rounding); over more ranks it is *more* accurate than the simulator's per-addition rounding.
  ``all_gather`` and ``broadcast`` move any dtype as raw bits (bf16 as ``uint16``), exactly.

Timeouts (a collective whose peers never arrive must not hang the job):

- ``timeout_mode="abort"`` (default): the data path is MPI's blocking call, untouched; the process's
  watchdog (:mod:`zerosim.comm.mpi_watchdog`) names the ranks that never arrived and aborts the world.
- ``timeout_mode="raise"``: nonblocking calls polled with ``Test`` (yielding the CPU between polls)
  until the deadline, then :class:`CollectiveTimeout` is *raised* in the calling rank; the
  communicator is unusable afterwards and the caller must abort (:mod:`zerosim.mpi.rank` does).
  Slower on oversubscribed machines; ``zerosim bench mpi`` measures both modes.

Test-only fault hook: ``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes world rank ``R`` raise when it
enters its ``K``-th collective (0-based, all groups counted), ``"hang:rank=R:call=K"`` makes it sleep
forever there instead, ``"kill:rank=R:call=K"`` makes its process SIGKILL itself there
(:mod:`zerosim.comm.fault_plan`, shared with the simulator and the torch backend). Used by
tests/test_mpi_faults.py and tests/test_process_faults.py; never set it in a real run.

Why one module of this length: each collective's hot path is written out (type checks, cached
reduce plans, integer traffic tallies) so that a call costs what MPI costs.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from typing import Any, overload

import numpy as np

from ..errors import CollectiveError, ConfigError
from .base import DEFAULT_TIMEOUT_S, TrafficCounter, dtype_label
from .mpi_traffic import DeferredTrafficCounter
from .mpi_watchdog import process_fault_plan, process_watchdog
from .mpi_wire import (
    MPI,
    NDARRAY,
    NO_PLANS,
    REDUCE_PLANS,
    WIRE_TYPES,
    ReducePlan,
    contiguous,
    reduce_plan,
    wire_type,
)

TIMEOUT_MODES = ("abort", "raise")


class MpiCommunicator:
    """One rank's view of one MPI communicator (implements ``Communicator``; see the module docstring).

    ``out=`` (keyword, optional, MPI only) receives the result in a caller-owned, C-contiguous
    array of the result's shape and dtype instead of a fresh one, like a raw ``Allreduce(x, out)``.
    """

    backend = "mpi"

    def __init__(self, comm: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, timeout_mode: str = "abort",
                 group_name: str = "world", traffic: TrafficCounter | None = None,
                 _global_ranks: tuple[int, ...] | None = None):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")
        if timeout_mode not in TIMEOUT_MODES:
            raise ConfigError("timeout_mode", timeout_mode, f"known: {', '.join(TIMEOUT_MODES)}")
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self._wd = process_watchdog()
        self._fault = process_fault_plan()
        self.rank = self._comm.Get_rank()
        self.world_size = self._comm.Get_size()
        self.global_rank = MPI.COMM_WORLD.Get_rank()
        self.group_name = group_name
        self.timeout_s = float(timeout_s)
        # without MPI_THREAD_MULTIPLE there is no watchdog thread: poll instead
        self.timeout_mode = timeout_mode if self._wd.threaded else "raise"
        self._blocking = self.timeout_mode == "abort"
        if _global_ranks is None:
            ranks = np.empty(self.world_size, dtype=np.int64)
            self._comm.Allgather(np.array([self.global_rank], dtype=np.int64), ranks)
            _global_ranks = tuple(int(r) for r in ranks)
        self.global_ranks = _global_ranks
        self.traffic = traffic if traffic is not None else DeferredTrafficCounter()
        # (nbytes, dtype) -> calls tallies of this group in the shared counter (None: a plain counter)
        self._tallies: dict[tuple[str, bool], defaultdict[tuple[int, Any], int]] | None = None
        if isinstance(self.traffic, DeferredTrafficCounter):
            self._tallies = {(c, root): self.traffic.tally(group_name, c, self.world_size, root)
                             for c in ("all_reduce", "reduce_scatter", "all_gather", "barrier", "broadcast")
                             for root in (False, True) if root is False or c == "broadcast"}
        # the data-path collectives' tallies, one attribute lookup away (None: record() instead)
        self._tally_all_reduce = None if self._tallies is None else self._tallies[("all_reduce", False)]
        self._tally_reduce_scatter = (
            None if self._tallies is None else self._tallies[("reduce_scatter", False)]
        )
        self._tally_all_gather = None if self._tallies is None else self._tallies[("all_gather", False)]
        self._calls = 0  # collectives entered on this group (names default split groups like the simulator)
        self._collective = ""
        self._wd.groups.setdefault(group_name, self)

    def __repr__(self) -> str:
        return f"MpiCommunicator(group={self.group_name!r}, rank={self.rank}/{self.world_size})"

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py.MPI.Comm``."""
        return self._comm

    # -- bookkeeping shared by every collective ------------------------------------------------------
    def _begin(self, collective: str, nbytes: int, is_root: bool = False, dtype: Any = None) -> None:
        """Entering a collective: traffic, the fault hook (tests), the call count, the watchdog's ``current``.
        """
        if self._tallies is None:
            self.traffic.record(self.group_name, collective, nbytes, self.world_size, is_root,
                                dtype=dtype_label(dtype))
        else:
            self._tallies[(collective, is_root)][(nbytes, dtype)] += 1
        if self._fault is not None:
            self._fault_hook(collective)
        self._collective = collective
        self._calls += 1
        self._wd.current = self

    def _fault_hook(self, collective: str) -> None:
        """Test only (``ZEROSIM_FAULT``): count this process's collectives, misbehave at the planned one."""
        assert self._fault is not None
        if self._fault.rank == self.global_rank and self._fault.call == self._wd.calls:
            self._fault.fire(collective, self.group_name)
        self._wd.calls += 1

    def _wait(self, request: Any) -> None:
        """Raise mode: poll ``request`` until done or the deadline, yielding the CPU between polls."""
        if request.Test():
            return
        test, yield_cpu, now = request.Test, os.sched_yield, time.monotonic
        deadline = now() + self.timeout_s
        while not test():
            yield_cpu()
            if now() > deadline:
                raise self._wd.timeout_error(self, self._calls - 1, self._collective)[0]

    def _mpi_error(self, e: Exception) -> CollectiveError:
        text = e.Get_error_string() if hasattr(e, "Get_error_string") else str(e)
        return CollectiveError(f"{self._collective} on group {self.group_name}: MPI error on rank "
                               f"{self.global_rank}: {text}")

    def _output(self, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype=dtype)
        if type(out) is not np.ndarray or out.shape != shape or out.dtype != dtype or not out.flags.carray:
            raise ConfigError(
                "out",
                f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', ()))}",
                f"must be a writeable, aligned, C-contiguous {dtype} array of shape {list(shape)}",
            )
        return out

    def _finish_reduce(self, acc: np.ndarray, result: np.ndarray, plan: ReducePlan) -> np.ndarray:
        if acc is not result:  # float32 accumulator -> the 16-bit dtype, rounded once
            result[...] = acc.astype(result.dtype)
        if plan.divide:
            result /= self.world_size  # the simulator's arithmetic: the sum, then divide in place
        return result

    # -- collectives --------------------------------------------------------------------------------
    # all_reduce / reduce_scatter / all_gather are the engine's data path. Each is written out in full
    # (no helper calls on the common path): the (op, dtype) decisions come from per-process caches,
    # ``out`` is accepted after a few attribute checks (anything unusual goes through ``_output``'s
    # full validation), and the bookkeeping is a tally increment, a call count and the watchdog's
    # ``current``. That keeps a call within a microsecond or so of Python on top of the raw MPI call,
    # which ``zerosim bench mpi`` measures.

    def all_reduce(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        if type(x) is not NDARRAY or not x.flags.c_contiguous:
            x = contiguous(x)
        dtype = x.dtype
        plan = REDUCE_PLANS.get(op, NO_PLANS).get(id(dtype))
        if plan is None or plan.dtype is not dtype:
            plan = reduce_plan(dtype, op)
        if out is None:
            result = np.empty(x.shape, dtype)
        elif type(out) is NDARRAY and out.dtype is dtype and out.shape == x.shape and out.flags.carray:
            result = out
        else:
            result = self._output(out, x.shape, dtype)
        acc = result if plan.native else np.empty(x.shape, np.float32)  # where MPI reduces into
        send = (x if plan.native else x.astype(np.float32), plan.mpi_type)
        tally = self._tally_all_reduce
        if tally is None:
            self.traffic.record(self.group_name, "all_reduce", x.nbytes, self.world_size,
                                dtype=dtype_label(x.dtype))
        else:
            tally[(x.nbytes, x.dtype)] += 1
        if self._fault is not None:
            self._fault_hook("all_reduce")
        self._collective = "all_reduce"
        self._calls += 1
        wd = self._wd
        wd.current = self
        try:
            if self._blocking:
                self._comm.Allreduce(send, (acc, plan.mpi_type), plan.mpi_op)
            else:
                self._wait(self._comm.Iallreduce(send, (acc, plan.mpi_type), plan.mpi_op))
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            wd.current = None
        return self._finish_reduce(acc, result, plan) if plan.divide or acc is not result else result

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None,
                       donate: bool = False) -> np.ndarray:
        """``donate`` is accepted and ignored: MPI_Reduce_scatter never writes to its send buffer."""
        if type(x) is not NDARRAY or not x.flags.c_contiguous:
            x = contiguous(x)
        n = self.world_size
        if x.ndim != 1 or x.size % n:
            self._check_flat("reduce_scatter", x, divisible=True)
        dtype = x.dtype
        plan = REDUCE_PLANS.get(op, NO_PLANS).get(id(dtype))
        if plan is None or plan.dtype is not dtype:
            plan = reduce_plan(dtype, op)
        count = x.size // n
        if out is None:
            result = np.empty(count, dtype)
        elif (
            type(out) is NDARRAY
            and out.dtype is dtype
            and out.ndim == 1
            and out.size == count
            and out.flags.carray
        ):
            result = out
        else:
            result = self._output(out, (count,), dtype)
        acc = result if plan.native else np.empty(count, np.float32)  # where MPI reduces into
        send = (x if plan.native else x.astype(np.float32), plan.mpi_type)
        tally = self._tally_reduce_scatter
        if tally is None:
            self.traffic.record(self.group_name, "reduce_scatter", x.nbytes, n, dtype=dtype_label(x.dtype))
        else:
            tally[(x.nbytes, x.dtype)] += 1
        if self._fault is not None:
            self._fault_hook("reduce_scatter")
        self._collective = "reduce_scatter"
        self._calls += 1
        wd = self._wd
        wd.current = self
        try:
            if self._blocking:
                self._comm.Reduce_scatter_block(send, (acc, plan.mpi_type), plan.mpi_op)
            else:
                self._wait(self._comm.Ireduce_scatter_block(send, (acc, plan.mpi_type), plan.mpi_op))
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            wd.current = None
        return self._finish_reduce(acc, result, plan) if plan.divide or acc is not result else result

    def all_gather(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        if type(x) is not NDARRAY or not x.flags.c_contiguous:
            x = contiguous(x)
        if x.ndim != 1:
            self._check_flat("all_gather", x)
        dtype = x.dtype
        total = x.size * self.world_size
        if out is None:
            result = np.empty(total, dtype)
        elif (
            type(out) is NDARRAY
            and out.dtype is dtype
            and out.ndim == 1
            and out.size == total
            and out.flags.carray
        ):
            result = out
        else:
            result = self._output(out, (total,), dtype)
        wire = WIRE_TYPES.get(id(dtype))
        wire = wire[1] if wire is not None and wire[0] is dtype else wire_type(dtype)
        tally = self._tally_all_gather
        if tally is None:
            self.traffic.record(self.group_name, "all_gather", result.nbytes, self.world_size,
                                dtype=dtype_label(x.dtype))
        else:
            tally[(result.nbytes, x.dtype)] += 1
        if self._fault is not None:
            self._fault_hook("all_gather")
        self._collective = "all_gather"
        self._calls += 1
        wd = self._wd
        wd.current = self
        try:
            if self._blocking:
                self._comm.Allgather((x, wire), (result, wire))
            else:
                self._wait(self._comm.Iallgather((x, wire), (result, wire)))
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            wd.current = None
        return result

    def broadcast(self, x: np.ndarray, root: int = 0, *, out: np.ndarray | None = None) -> np.ndarray:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError(
                "root", root, f"must be a rank of group {self.group_name} (size {self.world_size})"
            )
        if type(x) is not np.ndarray or not x.flags.c_contiguous:
            x = contiguous(x)
        result = self._output(out, x.shape, x.dtype)
        if self.rank == root and result is not x:
            result[...] = x
        buf = (result, wire_type(x.dtype))
        self._begin("broadcast", x.nbytes, self.rank == root, x.dtype)
        try:
            if self._blocking:
                self._comm.Bcast(buf, root)
            else:
                self._wait(self._comm.Ibcast(buf, root))
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            self._wd.current = None
        return result

    def barrier(self) -> None:
        self._begin("barrier", 0)
        try:
            if self._blocking:
                self._comm.Barrier()
            else:
                self._wait(self._comm.Ibarrier())
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            self._wd.current = None

    def _check_flat(self, collective: str, x: np.ndarray, divisible: bool = False) -> None:
        if x.ndim != 1:
            raise CollectiveError(
                f"{collective} on group {self.group_name}: rank {self.global_rank} passed a "
                f"{x.ndim}-D array; flat 1-D buffers only"
            )
        if divisible and x.shape[0] % self.world_size:
            raise CollectiveError(f"{collective} on group {self.group_name}: length {x.shape[0]} on rank "
                                  f"{self.global_rank} is not divisible by the group size {self.world_size}")

    @overload
    def split(self, color: int, key: int | None = None, name: str | None = None) -> MpiCommunicator: ...
    @overload
    def split(self, color: None, key: int | None = None, name: str | None = None) -> None: ...

    def split(
        self, color: int | None, key: int | None = None, name: str | None = None
    ) -> MpiCommunicator | None:
        """``MPI_Comm_split``: ranks with the same color form a group, ordered by (key, rank).

        ``color=None`` opts out (returns None). ``name`` names the new group for traffic accounting
        (members of one color must agree on it); the default is ``<parent>/split<k>:<color>`` with
        ``k`` this group's collective count, as in the simulator. The new communicator records into
        this one's ``traffic`` counter and shares the timeout settings.
        """
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ConfigError("color", color, "must be a non-negative integer or None")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise ConfigError("key", key, "must be an integer or None")
        default_name = f"{self.group_name}/split{self._calls}:{color}"
        if self._fault is not None:
            self._fault_hook("split")
        self._collective = "split"  # no traffic, like the simulator; counts as a call on this group
        self._calls += 1
        self._wd.current = self
        try:
            if not self._blocking:  # everyone arrives first, so the blocking Split cannot hang
                self._wait(self._comm.Ibarrier())
            sub = self._comm.Split(
                MPI.UNDEFINED if color is None else color, self.rank if key is None else key
            )
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            self._wd.current = None
        if sub == MPI.COMM_NULL:
            return None
        group_name = default_name if name is None else name
        names = sub.allgather(group_name)  # set-up time agreement check, not the data path
        if len(set(names)) > 1:
            raise CollectiveError(
                f"split of group {self.group_name}: members of color {color} disagree on the "
                f"group name: {sorted(set(names))}"
            )
        ranks = np.empty(sub.Get_size(), dtype=np.int64)
        sub.Allgather(np.array([self.global_rank], dtype=np.int64), ranks)
        return MpiCommunicator(
            sub,
            timeout_s=self.timeout_s,
            timeout_mode=self.timeout_mode,
            group_name=group_name,
            traffic=self.traffic,
            _global_ranks=tuple(int(r) for r in ranks),
        )
