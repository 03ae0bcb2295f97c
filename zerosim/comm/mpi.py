"""The mpi4py Communicator: the engine's collectives as MPI buffer calls, one process per rank.

Implements :class:`zerosim.comm.base.Communicator` with mpi4py's buffer-based (upper-case) calls
only: ``Allreduce``, ``Reduce_scatter_block``, ``Allgather``, ``Bcast``, ``Barrier`` (and their
``I``-prefixed nonblocking forms) and ``Comm.Split`` for the hybrid shard / replicate groups. Nothing
is pickled on the data path. Traffic is recorded exactly as the simulator records it (ring
attribution, :func:`zerosim.comm.base.ring_bytes`), so C-ZERO-005 and the communication model mean
the same thing under ``mpiexec`` as in one process.

Arithmetic (what makes a run comparable with the simulator, bit for bit where possible):

- ``sum`` is MPI's ``SUM`` in the buffer's dtype; ``avg`` is that sum divided in place by the group
  size (``out /= n``), the simulator's arithmetic; ``max`` is ``MAX``.
- MPI fixes neither the order nor the grouping of a reduction. Over **two** ranks it is one
  commutative addition (``x0 + x1 == x1 + x0`` in IEEE arithmetic), so results are **bitwise equal**
  to the simulator's rank-order sum. Over more ranks MPICH / Open MPI pick recursive doubling,
  Rabenseifner or ring algorithms by message size (``(x0+x1)+(x2+x3)`` ...) while the simulator sums
  ``((x0+x1)+x2)+x3``: results then agree to a few ulps (``zerosim.mpi.CROSS_BACKEND_RTOL`` / ``_ATOL``).
  ``max``, integer sums, ``all_gather`` and ``broadcast`` are exact at every size.
- ``bfloat16`` (ml_dtypes), ``float16`` and ``bool`` have no portable MPI reduction datatype: they
  are reduced in ``float32`` and rounded back **once**, then ``avg`` divides in the 16-bit dtype like
  the simulator. Over two ranks this equals the simulator's 16-bit addition exactly (one addition,
  one rounding); over more ranks it is *more* accurate than the simulator's per-addition rounding.
  ``all_gather`` and ``broadcast`` move any dtype as raw bits (bf16 as ``uint16``), exactly.

Timeouts (a collective whose peers never arrive must not hang the job):

- ``timeout_mode="abort"`` (default): the data path is MPI's blocking call, untouched; a watchdog
  thread (one per process, waking every 50 ms) notices a collective that outlives ``timeout_s``,
  asks the group's other ranks over a private duplicate of the world communicator what they are
  doing, reports a :class:`CollectiveTimeout` naming the ranks that never arrived (printed once, by
  the lowest rank that did arrive) and aborts the world. MPI cannot cancel a pending collective, so
  ending the job is the only safe outcome. Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
- ``timeout_mode="raise"``: nonblocking calls polled with ``Test`` (yielding the CPU between polls)
  until the deadline, then :class:`CollectiveTimeout` is *raised* in the calling rank; the
  communicator is unusable afterwards and the caller must abort (:mod:`zerosim.mpi.rank` does).
  Slower on oversubscribed machines; ``zerosim bench mpi`` measures both modes.

Test-only fault hook: ``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes world rank ``R`` raise when it
enters its ``K``-th collective (0-based, all groups counted), ``"hang:rank=R:call=K"`` makes it sleep
forever there instead (:mod:`zerosim.comm.fault_plan`, shared with the torch backend). Used by
tests/test_mpi_faults.py; never set it in a real run.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from ..errors import CollectiveError, CollectiveTimeout, ConfigError
from ..mpi import EXIT_RANK_FAILED
from .base import DEFAULT_TIMEOUT_S, REDUCE_OPS, TrafficCounter, TrafficRecord, ring_bytes
from .fault_plan import FaultPlan

try:
    from mpi4py import MPI
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("backend", "mpi", "needs mpi4py and an MPI library: pip install 'zerosim[mpi]'") from e

TIMEOUT_MODES = ("abort", "raise")

_TAG_QUERY = 7001
_TAG_REPLY = 7002
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}
_WATCHDOG_POLL_S = 0.05
# While the main thread is inside a collective the watchdog touches MPI (improbe for peers' queries)
# at most this often: under MPI_THREAD_MULTIPLE every MPI call takes the library's lock, which the
# collective's progress loop wants. Peers' surveys wait at least 0.5 s for answers, so this still answers.
_WATCHDOG_BUSY_POLL_S = 0.25


# ---- dtypes on the wire ------------------------------------------------------------------------

_BITS_BY_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_VIA_FLOAT32 = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_))
_REDUCE_PATH: dict[int, tuple[np.dtype, str]] = {}  # id(dtype) -> (dtype, path): np.dtype hashing is slow


def _reduce_path(dtype: np.dtype) -> str:
    """``native``: MPI reduces this dtype itself; ``float32``: reduce a float32 copy, round back once;
    ``""``: cannot be reduced (still moved exactly by all_gather / broadcast)."""
    hit = _REDUCE_PATH.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    path = ""
    if dtype in _VIA_FLOAT32:
        path = "float32"
    elif dtype.kind in "iuf" and dtype.isnative:
        from mpi4py.util import dtlib

        try:
            dtlib.from_numpy_dtype(dtype)
            path = "native"
        except (TypeError, ValueError, KeyError):
            path = ""
    _REDUCE_PATH[id(dtype)] = (dtype, path)
    return path


class ReducePlan(NamedTuple):
    """How one (dtype, op) reduction runs, worked out once per process (the hot path only looks it up)."""

    dtype: np.dtype
    mpi_op: Any  # MPI.SUM / MPI.MAX
    native: bool  # MPI reduces the dtype itself (else: a float32 copy, rounded back once)
    divide: bool  # "avg": divide the sum by the group size afterwards
    mpi_type: Any  # the MPI datatype on the wire: the dtype's own, or MPI.FLOAT for the float32 copy


# op -> id(dtype) -> plan (two string / int lookups: cheaper than hashing a tuple or a dtype); the
# plan holds its dtype, so an id is never reused while cached; callers check ``plan.dtype is dtype``
_REDUCE_PLANS: dict[str, dict[int, ReducePlan]] = {op: {} for op in _MPI_OPS}
_NO_PLANS: dict[int, ReducePlan] = {}  # what an unknown op looks up (always empty)


def _reduce_plan(dtype: np.dtype, op: str) -> ReducePlan:
    """The :class:`ReducePlan` of reducing ``dtype`` with ``op``, cached; ConfigError for an op or dtype MPI
    cannot reduce. Callers look ``_REDUCE_PLANS`` up first (and check ``plan.dtype is dtype``)."""
    if op not in _MPI_OPS:
        raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
    if op == "avg" and dtype.kind not in "fV":
        raise ConfigError("op", op, f"avg needs a floating dtype, got {dtype}")
    path = _reduce_path(dtype)
    if not path:
        raise ConfigError("dtype", str(dtype), f"cannot be reduced over MPI (op={op}); "
                          "supported: the float / int dtypes MPI knows, float16, bfloat16, bool")
    native = path == "native"
    plan = ReducePlan(dtype, _MPI_OPS[op], native, op == "avg", _wire_type(dtype) if native else MPI.FLOAT)
    _REDUCE_PLANS[op][id(dtype)] = plan
    return plan


_WIRE_TYPES: dict[int, tuple[np.dtype, Any]] = {}  # id(dtype) -> (dtype, MPI datatype): see _wire_type


def _wire_type(dtype: np.dtype) -> Any:
    """The MPI datatype that moves ``dtype`` exactly, cached: the dtype's own (``Datatype.fromcode``, the
    lookup mpi4py does for a plain array) when MPI knows it, else an unsigned integer of the same size
    (raw bits: bf16 as uint16), else bytes. Collectives pass ``(array, datatype)``, which spares mpi4py
    parsing the buffer's format on every call; the bytes on the wire are the same."""
    hit = _WIRE_TYPES.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    if dtype.hasobject:
        raise ConfigError("dtype", str(dtype), "object arrays cannot be sent over MPI")
    wire = MPI.BYTE
    if _reduce_path(dtype) == "native":
        wire = MPI.Datatype.fromcode(dtype.char)
    elif dtype.itemsize in _BITS_BY_SIZE:
        wire = MPI.Datatype.fromcode(_BITS_BY_SIZE[dtype.itemsize].char)
    _WIRE_TYPES[id(dtype)] = (dtype, wire)
    return wire


_ndarray = np.ndarray  # the hot path's type check, one global lookup


def _contiguous(x: Any) -> np.ndarray:
    """A C-contiguous ndarray of ``x`` (0-d stays 0-d; ``np.ascontiguousarray`` would make it 1-d)."""
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


# ---- traffic: the shared TrafficCounter, with O(1) integer bookkeeping on the hot path -------------

class DeferredTrafficCounter(TrafficCounter):
    """A :class:`TrafficCounter` whose hot path is one integer increment instead of Fraction arithmetic.

    Communicators get a *tally* per (group, collective, group size, is-root): a dict ``nbytes ->
    calls`` they increment. Tallies are folded into ``records`` (exact Fractions, :func:`ring_bytes`)
    the moment anything reads ``records``; every public method of the base class goes through it, so
    totals, ``merge`` and ``to_json`` are identical to the simulator's. Serves C-ZERO-005 without
    costing the data path (one Fraction add takes microseconds; a 64 KiB all-gather takes ~15).
    """

    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str, int, bool], defaultdict[int, int]] = {}
        super().__init__()

    def tally(self, group: str, collective: str, n: int, is_root: bool = False) -> defaultdict[int, int]:
        """The ``nbytes -> calls`` dict for these keys (shared by every caller asking for the same keys):
        a ``defaultdict(int)``, so recording a call is ``tally[nbytes] += 1``."""
        tally = self._tallies.get((group, collective, n, is_root))
        if tally is None:
            tally = self._tallies[(group, collective, n, is_root)] = defaultdict(int)
        return tally

    @property  # type: ignore[override]
    def records(self) -> dict[tuple[str, str], TrafficRecord]:
        if any(self._tallies.values()):
            self._flush()
        return self._records

    @records.setter
    def records(self, value: dict[tuple[str, str], TrafficRecord]) -> None:
        self._records = value

    def record(self, group: str, collective: str, nbytes: int, n: int, is_root: bool = False) -> None:
        self.tally(group, collective, n, is_root)[nbytes] += 1

    def _flush(self) -> None:
        for (group, collective, n, is_root), tally in self._tallies.items():
            items = list(tally.items())
            tally.clear()  # in place: communicators hold these dicts
            for nbytes, calls in items:
                sent, received = ring_bytes(collective, nbytes, n, is_root)
                r = self._records.setdefault((group, collective), TrafficRecord())
                r.calls += calls
                r.bytes_sent += sent * calls
                r.bytes_received += received * calls
                r.payload_bytes += nbytes * calls

    def reset(self) -> None:
        for tally in self._tallies.values():
            tally.clear()
        self._records.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (and copies) as a plain :class:`TrafficCounter`: other processes need no MPI to read it."""
        return TrafficCounter, (dict(self.records),)


# ---- the per-process watchdog and the "who never arrived" survey -----------------------------------

def abort_world(message: str, code: int = EXIT_RANK_FAILED) -> None:
    """Print ``message`` (the caller decides it is the one to print) and abort every rank with ``code``."""
    if message:
        print(message, file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(code)


class _Watchdog:
    """Per-process collective bookkeeping: answers peers' "what are you doing?" and fires timeouts.

    The data path only stores the communicator it is in (``current``) on entry and ``None`` on
    exit. The thread wakes every ``poll_s``: it answers queries from other ranks (while this rank is
    inside a collective, only every ``_WATCHDOG_BUSY_POLL_S``: it leaves MPI's lock to the collective)
    and, for a communicator in ``abort`` mode, fires when the same call has been pending longer than
    its timeout (a check that does not touch MPI).
    """

    def __init__(self, world: Any, poll_s: float = _WATCHDOG_POLL_S, start_thread: bool = True):
        self.diag = world.Dup()  # private channel: never matches the engine's messages
        self.world_rank = world.Get_rank()
        self.world_size = world.Get_size()
        self.groups: dict[str, MpiCommunicator] = {}  # group name -> this rank's communicator
        self.current: MpiCommunicator | None = None  # the communicator inside a collective, if any
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
                self._sends.append(self.diag.isend(self.state_for(group), dest=status.Get_source(), tag=_TAG_REPLY))
            self._sends = [r for r in self._sends if not r.Test()]

    def ask(self, members: tuple[int, ...], group: str, grace_s: float) -> dict[int, tuple[Any, ...]]:
        """Ask every other member its :meth:`state_for` ``group``; the replies that came within ``grace_s``."""
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

    def survey(self, group: str, seq: int, members: tuple[int, ...], grace_s: float) -> tuple[list[int], dict[int, str]]:
        """Which members entered call ``seq`` of ``group`` (sorted, this rank included); notes on the others."""
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

    def timeout_error(self, comm: MpiCommunicator, seq: int, collective: str) -> tuple[CollectiveTimeout, bool]:
        """Survey the group of a timed-out call; (the error naming who never arrived, this rank reports it)."""
        arrived, notes = self.survey(comm.group_name, seq, comm.global_ranks, min(2.0, max(0.5, comm.timeout_s)))
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
                if self.current is None or now - self._answered_at >= _WATCHDOG_BUSY_POLL_S:
                    self._answered_at = now
                    self.answer_queries()
                self._check_deadline()
            except Exception as e:  # noqa: BLE001 - a watchdog must never die silently
                print(f"rank {self.world_rank}: zerosim MPI watchdog error: {e!r}", file=sys.stderr, flush=True)

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


_WATCHDOG: _Watchdog | None = None
_FAULT: list[FaultPlan | None] = []


def _process_watchdog() -> _Watchdog:
    global _WATCHDOG
    if _WATCHDOG is None:
        _WATCHDOG = _Watchdog(MPI.COMM_WORLD, start_thread=MPI.Query_thread() >= MPI.THREAD_MULTIPLE)
    return _WATCHDOG


def _process_fault_plan() -> FaultPlan | None:
    if not _FAULT:
        _FAULT.append(FaultPlan.from_env())
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


# ---- the communicator ----------------------------------------------------------------------------

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
        self._wd = _process_watchdog()
        self._fault = _process_fault_plan()
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
        # nbytes -> calls tallies of this group in the shared counter (None: a plain counter, record())
        self._tallies: dict[tuple[str, bool], defaultdict[int, int]] | None = None
        if isinstance(self.traffic, DeferredTrafficCounter):
            self._tallies = {(c, root): self.traffic.tally(group_name, c, self.world_size, root)
                             for c in ("all_reduce", "reduce_scatter", "all_gather", "barrier", "broadcast")
                             for root in (False, True) if root is False or c == "broadcast"}
        # the data-path collectives' tallies, one attribute lookup away (None: record() instead)
        self._tally_all_reduce = None if self._tallies is None else self._tallies[("all_reduce", False)]
        self._tally_reduce_scatter = None if self._tallies is None else self._tallies[("reduce_scatter", False)]
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
    def _begin(self, collective: str, nbytes: int, is_root: bool = False) -> None:
        """Entering a collective: traffic, the fault hook (tests), the call count, the watchdog's ``current``."""
        if self._tallies is None:
            self.traffic.record(self.group_name, collective, nbytes, self.world_size, is_root)
        else:
            self._tallies[(collective, is_root)][nbytes] += 1
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
            raise ConfigError("out", f"{getattr(out, 'dtype', type(out).__name__)}{list(getattr(out, 'shape', ()))}",
                              f"must be a writeable, aligned, C-contiguous {dtype} array of shape {list(shape)}")
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
        if type(x) is not _ndarray or not x.flags.c_contiguous:
            x = _contiguous(x)
        dtype = x.dtype
        plan = _REDUCE_PLANS.get(op, _NO_PLANS).get(id(dtype))
        if plan is None or plan.dtype is not dtype:
            plan = _reduce_plan(dtype, op)
        if out is None:
            result = np.empty(x.shape, dtype)
        elif type(out) is _ndarray and out.dtype is dtype and out.shape == x.shape and out.flags.carray:
            result = out
        else:
            result = self._output(out, x.shape, dtype)
        acc = result if plan.native else np.empty(x.shape, np.float32)  # where MPI reduces into
        send = (x if plan.native else x.astype(np.float32), plan.mpi_type)
        tally = self._tally_all_reduce
        if tally is None:
            self.traffic.record(self.group_name, "all_reduce", x.nbytes, self.world_size)
        else:
            tally[x.nbytes] += 1
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

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        if type(x) is not _ndarray or not x.flags.c_contiguous:
            x = _contiguous(x)
        n = self.world_size
        if x.ndim != 1 or x.size % n:
            self._check_flat("reduce_scatter", x, divisible=True)
        dtype = x.dtype
        plan = _REDUCE_PLANS.get(op, _NO_PLANS).get(id(dtype))
        if plan is None or plan.dtype is not dtype:
            plan = _reduce_plan(dtype, op)
        count = x.size // n
        if out is None:
            result = np.empty(count, dtype)
        elif type(out) is _ndarray and out.dtype is dtype and out.ndim == 1 and out.size == count and out.flags.carray:
            result = out
        else:
            result = self._output(out, (count,), dtype)
        acc = result if plan.native else np.empty(count, np.float32)  # where MPI reduces into
        send = (x if plan.native else x.astype(np.float32), plan.mpi_type)
        tally = self._tally_reduce_scatter
        if tally is None:
            self.traffic.record(self.group_name, "reduce_scatter", x.nbytes, n)
        else:
            tally[x.nbytes] += 1
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
        if type(x) is not _ndarray or not x.flags.c_contiguous:
            x = _contiguous(x)
        if x.ndim != 1:
            self._check_flat("all_gather", x)
        dtype = x.dtype
        total = x.size * self.world_size
        if out is None:
            result = np.empty(total, dtype)
        elif type(out) is _ndarray and out.dtype is dtype and out.ndim == 1 and out.size == total and out.flags.carray:
            result = out
        else:
            result = self._output(out, (total,), dtype)
        wire = _WIRE_TYPES.get(id(dtype))
        wire = wire[1] if wire is not None and wire[0] is dtype else _wire_type(dtype)
        tally = self._tally_all_gather
        if tally is None:
            self.traffic.record(self.group_name, "all_gather", result.nbytes, self.world_size)
        else:
            tally[result.nbytes] += 1
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
            raise ConfigError("root", root, f"must be a rank of group {self.group_name} (size {self.world_size})")
        if type(x) is not np.ndarray or not x.flags.c_contiguous:
            x = _contiguous(x)
        result = self._output(out, x.shape, x.dtype)
        if self.rank == root and result is not x:
            result[...] = x
        buf = (result, _wire_type(x.dtype))
        self._begin("broadcast", x.nbytes, self.rank == root)
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
            raise CollectiveError(f"{collective} on group {self.group_name}: rank {self.global_rank} passed a "
                                  f"{x.ndim}-D array; flat 1-D buffers only")
        if divisible and x.shape[0] % self.world_size:
            raise CollectiveError(f"{collective} on group {self.group_name}: length {x.shape[0]} on rank "
                                  f"{self.global_rank} is not divisible by the group size {self.world_size}")

    def split(self, color: int | None, key: int | None = None, name: str | None = None) -> MpiCommunicator | None:
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
            sub = self._comm.Split(MPI.UNDEFINED if color is None else color, self.rank if key is None else key)
        except MPI.Exception as e:
            raise self._mpi_error(e) from e
        finally:
            self._wd.current = None
        if sub == MPI.COMM_NULL:
            return None
        group_name = default_name if name is None else name
        names = sub.allgather(group_name)  # set-up time agreement check, not the data path
        if len(set(names)) > 1:
            raise CollectiveError(f"split of group {self.group_name}: members of color {color} disagree on the "
                                  f"group name: {sorted(set(names))}")
        ranks = np.empty(sub.Get_size(), dtype=np.int64)
        sub.Allgather(np.array([self.global_rank], dtype=np.int64), ranks)
        return MpiCommunicator(sub, timeout_s=self.timeout_s, timeout_mode=self.timeout_mode, group_name=group_name,
                               traffic=self.traffic, _global_ranks=tuple(int(r) for r in ranks))
