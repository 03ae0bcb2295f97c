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
  to the simulator's rank-order sum. Over more ranks MPICH / Open MPI use recursive doubling,
  Rabenseifner or ring algorithms (``(x0+x1)+(x2+x3)`` ...) while the simulator sums
  ``((x0+x1)+x2)+x3``: results agree to a few ulps, within ``CROSS_BACKEND_RTOL`` / ``_ATOL``.
- ``bfloat16`` (ml_dtypes) and ``float16`` have no portable MPI reduction datatype: they are
  reduced in ``float32`` and rounded back **once**, then ``avg`` divides in the 16-bit dtype like the
  simulator. Over two ranks this equals the simulator's 16-bit addition exactly (one addition,
  one rounding); over more ranks it is *more* accurate than the simulator's per-addition rounding.
  ``all_gather`` and ``broadcast`` move any dtype as raw bits (bf16 as ``uint16``), exactly.

Timeouts (a collective whose peers never arrive must not hang the job):

- ``timeout_mode="abort"`` (default): the data path is MPI's blocking call untouched; a watchdog
  thread (one per process) notices a collective that outlives its deadline, asks the group's other
  ranks over a private duplicate of the world communicator what they are doing, reports a
  :class:`CollectiveTimeout` naming the ranks that never arrived (printed once, by the lowest rank
  that did arrive) and aborts the world. MPI cannot cancel a pending collective, so ending the job
  is the only safe outcome. Needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).
- ``timeout_mode="raise"``: nonblocking calls polled with ``Test`` (yielding the CPU between polls)
  until a deadline, then :class:`CollectiveTimeout` is *raised* in the calling rank. The
  communicator is unusable afterwards; the caller must abort. Costs throughput on oversubscribed
  machines (``zerosim bench mpi`` measures both modes).

Test-only fault hook: ``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes world rank ``R`` raise when it
enters its ``K``-th collective (0-based, all groups counted), ``"hang:rank=R:call=K"`` makes it sleep
forever there instead. Used by tests/test_mpi_faults.py; never set it in a real run.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import CollectiveError, CollectiveTimeout, ConfigError
from .base import DEFAULT_TIMEOUT_S, REDUCE_OPS, TrafficCounter, TrafficRecord, ring_bytes

try:
    from mpi4py import MPI
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("backend", "mpi", "needs mpi4py and an MPI library: pip install 'zerosim[mpi]'") from e

TIMEOUT_MODES = ("abort", "raise")
EXIT_RANK_FAILED = 3  # the MPI_Abort error code of a failed or timed-out rank (mpiexec's exit status)
CROSS_BACKEND_RTOL = 1e-5  # fp32 results of >2 ranks vs the simulator's rank-order sum (a few ulps)
CROSS_BACKEND_ATOL = 1e-6

_TAG_QUERY = 7001
_TAG_REPLY = 7002
_MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}


# ---- dtypes on the wire ------------------------------------------------------------------------

_BITS_BY_SIZE = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_VIA_FLOAT32 = {np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_)}
_REDUCE_PATH: dict[np.dtype, str] = {}  # dtype -> "native" | "float32" | "" (cannot be reduced)


def _reduce_path(dtype: np.dtype) -> str:
    """``native``: MPI reduces this dtype itself; ``float32``: reduce a float32 copy, round back once."""
    path = _REDUCE_PATH.get(dtype)
    if path is None:
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
        _REDUCE_PATH[dtype] = path
    return path


def _contiguous(x: Any) -> np.ndarray:
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _wire_view(x: np.ndarray) -> np.ndarray:
    """``x`` as MPI moves it without arithmetic: itself when MPI knows the dtype, else its raw bits."""
    if _reduce_path(x.dtype) == "native":
        return x
    return x.view(_BITS_BY_SIZE.get(x.dtype.itemsize, np.dtype(np.uint8)))


# ---- traffic: the shared TrafficCounter, with O(1) integer bookkeeping on the hot path -------------

class DeferredTrafficCounter(TrafficCounter):
    """A :class:`TrafficCounter` whose ``record`` costs a dict increment instead of Fraction arithmetic.

    Calls are tallied by ``(group, collective, nbytes, n, is_root)`` and folded into ``records``
    (exact Fractions, :func:`ring_bytes`) the moment anything reads ``records``: every public method
    of the base class goes through it, so totals, ``merge`` and ``to_json`` are identical to the
    simulator's. Serves C-ZERO-005 without costing the data path (Fraction adds take microseconds).
    """

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str, int, int, bool], int] = {}
        super().__init__()

    @property  # type: ignore[override]
    def records(self) -> dict[tuple[str, str], TrafficRecord]:
        if self._pending:
            self._flush()
        return self._records

    @records.setter
    def records(self, value: dict[tuple[str, str], TrafficRecord]) -> None:
        self._records = value

    def record(self, group: str, collective: str, nbytes: int, n: int, is_root: bool = False) -> None:
        key = (group, collective, nbytes, n, is_root)
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1

    def _flush(self) -> None:
        pending, self._pending = self._pending, {}
        for (group, collective, nbytes, n, is_root), calls in pending.items():
            sent, received = ring_bytes(collective, nbytes, n, is_root)
            r = self._records.setdefault((group, collective), TrafficRecord())
            r.calls += calls
            r.bytes_sent += sent * calls
            r.bytes_received += received * calls
            r.payload_bytes += nbytes * calls

    def reset(self) -> None:
        self._pending.clear()
        self._records.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (and copies) as a plain :class:`TrafficCounter`: other processes need no MPI to read it."""
        return TrafficCounter, (dict(self.records),)


# ---- the test-only fault hook ----------------------------------------------------------------

@dataclass(frozen=True)
class FaultPlan:
    """``ZEROSIM_FAULT=kind:rank=R:call=K`` (test only): misbehave on world rank R at its K-th collective."""

    kind: str  # "raise" | "hang"
    rank: int
    call: int

    @classmethod
    def from_env(cls, text: str | None = None) -> FaultPlan | None:
        text = os.environ.get("ZEROSIM_FAULT", "") if text is None else text
        if not text:
            return None
        kind, *fields = text.split(":")
        values: dict[str, int] = {"rank": 0, "call": 0}
        try:
            for f in fields:
                k, _, v = f.partition("=")
                if k not in values:
                    raise ValueError(k)
                values[k] = int(v)
        except ValueError:
            raise ConfigError("ZEROSIM_FAULT", text, "expected raise|hang:rank=R:call=K") from None
        if kind not in ("raise", "hang"):
            raise ConfigError("ZEROSIM_FAULT", text, "kind must be 'raise' or 'hang'")
        return cls(kind, values["rank"], values["call"])

    def fire(self, collective: str, group: str) -> None:
        where = f"{collective} on group {group} (collective #{self.call} of rank {self.rank})"
        if self.kind == "raise":
            raise RuntimeError(f"injected fault ZEROSIM_FAULT={self.kind}:rank={self.rank}:call={self.call} "
                               f"before {where}")
        while True:  # "hang": never arrive; the peers' timeout must end the job
            time.sleep(3600)


# ---- the per-process watchdog and the "who never arrived" survey -----------------------------------

def abort_world(message: str, code: int = EXIT_RANK_FAILED) -> None:
    """Print ``message`` (once, by the caller) and abort every rank of MPI_COMM_WORLD with ``code``."""
    if message:
        print(message, file=sys.stderr, flush=True)
    MPI.COMM_WORLD.Abort(code)


_Pending = tuple[str, str, int, float, float, tuple[int, ...], bool]


class _Watchdog:
    """Per-process collective bookkeeping: what this rank is doing, answers to peers, deadlines.

    ``current`` is written by the data path once on entry and once on exit of every collective
    (two attribute stores); the thread wakes every ``poll_s`` seconds to answer peers' questions
    and, in ``abort`` mode, to fire the timeout.
    """

    def __init__(self, world: Any, poll_s: float = 0.05, start_thread: bool = True):
        self.diag = world.Dup()  # private channel: never matches the engine's messages
        self.world_rank = world.Get_rank()
        self.entered: dict[str, int] = {}  # group name -> collectives entered on it
        # (group, collective, seq, deadline, timeout_s, members' world ranks, abort on timeout) or None
        self.current: _Pending | None = None
        self.calls = 0  # collectives entered by this process, all groups (the fault hook's counter)
        self.failed = False  # this rank raised: answers to peers say so
        self.poll_s = poll_s
        self._fired = False
        self._lock = threading.Lock()  # one answerer at a time (thread vs a raise-mode survey)
        self._sends: list[Any] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(target=self._run, name="zerosim-mpi-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)

    # -- answering ------------------------------------------------------------------------------
    def state_for(self, group: str) -> tuple[int, tuple[str, str, int] | None, bool]:
        """(collectives entered on ``group``, the collective this rank waits in or None, has it failed)."""
        cur = self.current
        return self.entered.get(group, 0), (None if cur is None else (cur[0], cur[1], cur[2])), self.failed

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
            entered, cur, failed = replies[m]
            if entered > seq:
                arrived.append(m)
            elif failed:
                notes[m] = "failed"
            elif cur is None:
                notes[m] = f"not in any collective ({entered} entered on {group})"
            else:
                notes[m] = f"waiting in {cur[1]} #{cur[2]} on group {cur[0]}"
        return sorted(arrived), notes

    def is_failure_reporter(self, world_size: int, settle_s: float = 0.3, grace_s: float = 1.0) -> bool:
        """This rank failed: is it the lowest failed rank (the one that prints)? Others fail quietly.

        Waits ``settle_s`` first so ranks that fail together (the same error on every rank) all know it.
        """
        self.failed = True
        time.sleep(settle_s)
        replies = self.ask(tuple(range(world_size)), "world", grace_s)
        failed = [self.world_rank] + [m for m, (_e, _c, f) in replies.items() if f]
        return self.world_rank == min(failed)

    def timeout_error(self, cur: _Pending) -> tuple[CollectiveTimeout, bool, str]:
        """Survey the group of the timed-out collective ``cur``; (error, this rank reports it, notes)."""
        group, collective, seq, _deadline, timeout_s, members, _abort = cur
        arrived, notes = self.survey(group, seq, members, grace_s=min(2.0, max(0.5, timeout_s)))
        missing = [m for m in members if m not in arrived]
        err = CollectiveTimeout(collective, missing, timeout_s, group)
        detail = "; ".join(f"rank {m}: {notes[m]}" for m in missing if m in notes)
        return err, self.world_rank == min(arrived), detail

    # -- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                if MPI.Is_finalized():
                    return
                self.answer_queries()
                cur = self.current
                if cur is not None and cur[6] and not self._fired and time.monotonic() > cur[3]:
                    self._fired = True
                    self._fire(cur)
            except Exception as e:  # noqa: BLE001 - a watchdog must never die silently
                print(f"rank {self.world_rank}: zerosim MPI watchdog error: {e!r}", file=sys.stderr, flush=True)

    def _fire(self, cur: _Pending) -> None:
        err, reporter, detail = self.timeout_error(cur)
        if reporter:
            abort_world(f"rank {self.world_rank} failed: CollectiveTimeout: {err}" + (f" ({detail})" if detail else ""))
        # Another member reports; give it time to abort the world, then make sure the job ends.
        time.sleep(3.0)
        abort_world("")


_WATCHDOG: _Watchdog | None = None


def is_failure_reporter() -> bool:
    """This rank has failed: should it print the error? True for the lowest-numbered failed rank only.

    Ranks that fail together (an error every rank raises, a collective that times out on all the
    ranks that arrived) agree over the watchdog's private channel, so the error is printed once.
    """
    if _WATCHDOG is None or MPI.Is_finalized():
        return True
    try:
        return _WATCHDOG.is_failure_reporter(MPI.COMM_WORLD.Get_size())
    except Exception:  # noqa: BLE001 - when in doubt, report
        return True
_FAULT: list[FaultPlan | None] = []


def _process_fault_plan() -> FaultPlan | None:
    if not _FAULT:
        _FAULT.append(FaultPlan.from_env())
    return _FAULT[0]


def _process_watchdog() -> _Watchdog:
    global _WATCHDOG
    if _WATCHDOG is None:
        threaded = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        _WATCHDOG = _Watchdog(MPI.COMM_WORLD, start_thread=threaded)
    return _WATCHDOG


# ---- the communicator ----------------------------------------------------------------------------

class MpiCommunicator:
    """One rank's view of one MPI communicator (implements ``Communicator``; see the module docstring).

    ``out=`` (keyword, optional, MPI-only) lets a caller that owns a suitably sized, C-contiguous
    output buffer receive the result there instead of a fresh array, like a raw ``Allreduce(x, out)``.
    """

    backend = "mpi"

    def __init__(self, comm: Any = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, timeout_mode: str = "abort",
                 group_name: str = "world", traffic: TrafficCounter | None = None,
                 _global_ranks: tuple[int, ...] | None = None, _watchdog: _Watchdog | None = None,
                 _fault: FaultPlan | None = None):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")
        if timeout_mode not in TIMEOUT_MODES:
            raise ConfigError("timeout_mode", timeout_mode, f"known: {', '.join(TIMEOUT_MODES)}")
        self._comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self._comm.Get_rank()
        self.world_size = self._comm.Get_size()
        self.group_name = group_name
        self.timeout_s = float(timeout_s)
        self._wd = _watchdog or _process_watchdog()
        if timeout_mode == "abort" and self._wd._thread is None:
            timeout_mode = "raise"  # no THREAD_MULTIPLE: no watchdog thread, so poll instead
        self.timeout_mode = timeout_mode
        self._blocking = timeout_mode == "abort"
        self.global_rank = MPI.COMM_WORLD.Get_rank()
        if _global_ranks is None:
            ranks = np.empty(self.world_size, dtype=np.int64)
            self._comm.Allgather(np.array([self.global_rank], dtype=np.int64), ranks)
            _global_ranks = tuple(int(r) for r in ranks)
        self.global_ranks = _global_ranks
        self.traffic = traffic if traffic is not None else DeferredTrafficCounter()
        self._fault = _fault if _watchdog is not None else _process_fault_plan()
        self._calls = 0  # collectives on this group (names default split groups like the simulator)

    def __repr__(self) -> str:
        return f"MpiCommunicator(group={self.group_name!r}, rank={self.rank}/{self.world_size})"

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py.MPI.Comm``."""
        return self._comm

    # -- the timed-call machinery ------------------------------------------------------------------
    def _enter(self, collective: str) -> int:
        wd = self._wd
        if self._fault is not None and self._fault.rank == self.global_rank and self._fault.call == wd.calls:
            self._fault.fire(collective, self.group_name)
        wd.calls += 1
        seq = wd.entered.get(self.group_name, 0)
        wd.entered[self.group_name] = seq + 1
        self._calls += 1
        now = time.monotonic()
        wd.current = (self.group_name, collective, seq, now + self.timeout_s, self.timeout_s, self.global_ranks,
                      self._blocking)
        return seq

    def _wait(self, request: Any) -> None:
        """Raise mode: poll ``request`` until done or the deadline, yielding the CPU between polls."""
        if request.Test():
            return
        cur = self._wd.current
        deadline = cur[3] if cur is not None else time.monotonic() + self.timeout_s
        test, yield_cpu, now = request.Test, os.sched_yield, time.monotonic
        while not test():
            yield_cpu()
            if now() > deadline:
                err, _reporter, detail = self._wd.timeout_error(cur)
                if detail:
                    err.args = (f"{err} ({detail})",)
                raise err

    def _mpi_error(self, collective: str, e: Exception) -> CollectiveError:
        text = e.Get_error_string() if hasattr(e, "Get_error_string") else str(e)
        return CollectiveError(f"{collective} on group {self.group_name}: MPI error on rank {self.global_rank}: {text}")

    def _check_op(self, op: str) -> None:
        if op not in REDUCE_OPS:
            raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")

    def _check_1d(self, collective: str, x: np.ndarray) -> None:
        if x.ndim != 1:
            raise CollectiveError(f"{collective} on group {self.group_name}: rank {self.global_rank} passed a "
                                  f"{x.ndim}-D array; flat 1-D buffers only")

    def _output(self, out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype=dtype)
        if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
            raise ConfigError("out", f"{out.dtype}{list(out.shape)}",
                              f"must be a writeable C-contiguous {dtype} array of shape {list(shape)}")
        return out

    # -- collectives --------------------------------------------------------------------------------
    def _reduce_buffers(self, x: np.ndarray, op: str, out_shape: tuple[int, ...],
                        out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(send, receive, result) buffers of a reduction; the float32 detour for 16-bit floats and bool."""
        if op not in _MPI_OPS:
            self._check_op(op)
        path = _reduce_path(x.dtype)
        if not path:
            raise ConfigError("dtype", str(x.dtype), f"cannot be reduced over MPI (op={op}); "
                              "supported: float/int dtypes MPI knows, float16, bfloat16, bool")
        if op == "avg" and x.dtype.kind not in "fV":
            raise ConfigError("op", op, f"avg needs a floating dtype, got {x.dtype}")
        result = self._output(out, out_shape, x.dtype)
        if path == "native":
            return x, result, result
        return x.astype(np.float32), np.empty(out_shape, np.float32), result

    def _finish_reduce(self, recv: np.ndarray, result: np.ndarray, op: str) -> np.ndarray:
        if recv is not result:  # float32 accumulator -> the 16-bit dtype, rounded once
            result[...] = recv.astype(result.dtype)
        if op == "avg":
            result /= self.world_size  # the simulator's arithmetic: the sum, then divide in place
        return result

    def all_reduce(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        x = _contiguous(x)
        send, recv, result = self._reduce_buffers(x, op, x.shape, out)
        self.traffic.record(self.group_name, "all_reduce", x.nbytes, self.world_size)
        self._enter("all_reduce")
        try:
            if self._blocking:
                self._comm.Allreduce(send, recv, _MPI_OPS[op])
            else:
                self._wait(self._comm.Iallreduce(send, recv, _MPI_OPS[op]))
        except MPI.Exception as e:
            raise self._mpi_error("all_reduce", e) from e
        finally:
            self._wd.current = None
        return self._finish_reduce(recv, result, op)

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
        x = _contiguous(x)
        self._check_1d("reduce_scatter", x)
        n = self.world_size
        if x.shape[0] % n:
            raise CollectiveError(f"reduce_scatter on group {self.group_name}: length {x.shape[0]} on rank "
                                  f"{self.global_rank} is not divisible by the group size {n}")
        send, recv, result = self._reduce_buffers(x, op, (x.shape[0] // n,), out)
        self.traffic.record(self.group_name, "reduce_scatter", x.nbytes, n)
        self._enter("reduce_scatter")
        try:
            if self._blocking:
                self._comm.Reduce_scatter_block(send, recv, _MPI_OPS[op])
            else:
                self._wait(self._comm.Ireduce_scatter_block(send, recv, _MPI_OPS[op]))
        except MPI.Exception as e:
            raise self._mpi_error("reduce_scatter", e) from e
        finally:
            self._wd.current = None
        return self._finish_reduce(recv, result, op)

    def all_gather(self, x: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        x = _contiguous(x)
        self._check_1d("all_gather", x)
        n = self.world_size
        result = self._output(out, (x.shape[0] * n,), x.dtype)
        self.traffic.record(self.group_name, "all_gather", x.nbytes * n, n)
        self._enter("all_gather")
        try:
            if self._blocking:
                self._comm.Allgather(_wire_view(x), _wire_view(result))
            else:
                self._wait(self._comm.Iallgather(_wire_view(x), _wire_view(result)))
        except MPI.Exception as e:
            raise self._mpi_error("all_gather", e) from e
        finally:
            self._wd.current = None
        return result

    def broadcast(self, x: np.ndarray, root: int = 0, *, out: np.ndarray | None = None) -> np.ndarray:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError("root", root, f"must be a rank of group {self.group_name} (size {self.world_size})")
        x = _contiguous(x)
        result = self._output(out, x.shape, x.dtype)
        if self.rank == root and result is not x:
            result[...] = x
        self.traffic.record(self.group_name, "broadcast", x.nbytes, self.world_size, is_root=self.rank == root)
        self._enter("broadcast")
        try:
            if self._blocking:
                self._comm.Bcast(_wire_view(result), root)
            else:
                self._wait(self._comm.Ibcast(_wire_view(result), root))
        except MPI.Exception as e:
            raise self._mpi_error("broadcast", e) from e
        finally:
            self._wd.current = None
        return result

    def barrier(self) -> None:
        self.traffic.record(self.group_name, "barrier", 0, self.world_size)
        self._enter("barrier")
        try:
            if self._blocking:
                self._comm.Barrier()
            else:
                self._wait(self._comm.Ibarrier())
        except MPI.Exception as e:
            raise self._mpi_error("barrier", e) from e
        finally:
            self._wd.current = None

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
        seq_name = self._calls
        self._enter("split")
        try:
            if not self._blocking:  # everyone arrives first, so the blocking Split cannot hang
                self._wait(self._comm.Ibarrier())
            sub = self._comm.Split(MPI.UNDEFINED if color is None else color, self.rank if key is None else key)
        except MPI.Exception as e:
            raise self._mpi_error("split", e) from e
        finally:
            self._wd.current = None
        if sub == MPI.COMM_NULL:
            return None
        group_name = name if name is not None else f"{self.group_name}/split{seq_name}:{color}"
        names = sub.allgather(group_name)  # setup-time agreement check, not the data path
        if len(set(names)) > 1:
            raise CollectiveError(f"split of group {self.group_name}: members of color {color} disagree on the "
                                  f"group name: {sorted(set(names))}")
        ranks = np.empty(sub.Get_size(), dtype=np.int64)
        sub.Allgather(np.array([self.global_rank], dtype=np.int64), ranks)
        return MpiCommunicator(sub, timeout_s=self.timeout_s, timeout_mode=self.timeout_mode,
                               group_name=group_name, traffic=self.traffic,
                               _global_ranks=tuple(int(r) for r in ranks), _watchdog=self._wd, _fault=self._fault)


