"""The torch.distributed Communicator: the engine's collectives on NCCL (GPU) or gloo (CPU).

One process per rank.

Implements :class:`zerosim.comm.base.Communicator` with ``torch.distributed``: ``all_reduce``,
``reduce_scatter_single`` (``reduce_scatter_tensor``), ``all_gather_single``
(``all_gather_into_tensor``), ``broadcast``, ``barrier`` and ``new_group`` for the hybrid shard /
replicate groups. Traffic is recorded exactly as the simulator and the MPI backend record it (ring
attribution, :func:`zerosim.comm.base.ring_bytes`), so C-ZERO-005 and the communication model mean
the same thing under ``torchrun`` as in one process.

Arithmetic (what makes a run comparable with the simulator, bit for bit where possible):

- ``sum`` is ``ReduceOp.SUM`` in the tensor's dtype; ``avg`` is that sum divided in place by the
  group size (``out /= n``), the simulator's arithmetic (gloo has no ``AVG`` in older releases,
  and NCCL's ``AVG`` divides before summing, which rounds differently); ``max`` is ``ReduceOp.MAX``.
- Over **two** ranks a sum is one commutative addition, so results are **bitwise equal** to the
  simulator's rank-order sum. Over more ranks gloo (ring / halving-doubling) and NCCL (ring / tree,
  chunked) group the additions differently: results agree within the reordering bound
  ``|got - want| <= n * eps * sum_k |x_k|`` (what ``selftest-comm`` checks; the engine-level
  tolerance is C-ZERO-002's).
  ``max``, integer sums, ``all_gather`` and ``broadcast`` are exact at every size.

How a reduce-scatter and an all-gather travel (``reduce_scatter=`` and ``all_gather=``, ``"auto"``
by default). On NCCL ``auto`` is the backend's own collective. On gloo it is a decomposition into
point-to-root collectives, because gloo's own ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` are several times slower than the same bytes moved otherwise (2 ranks,
50M float32 elements, 2-core CPU: reduce-scatter 0.43 s against 0.20 s as reduces, all-gather
0.34 s against 0.10 s as broadcasts; at 4 ranks 0.78 s against 0.33 s and 0.57 s against 0.20 s):

- ``"reduce"``: one ``reduce`` per chunk to the rank that owns it, all started before any is
  waited for. Each rank receives ``(n-1)/n * S``, the reduce-scatter's volume. gloo uses a
  non-root's buffer as scratch space, so each chunk is reduced in a copy, unless the caller
  donates its input (``donate=True``).
- ``"broadcast"``: one ``broadcast`` per chunk from the rank that owns it, all started together.
  Each rank receives ``(n-1)/n * S``, the all-gather's volume; the values are copies, exact.
- ``"all_reduce"`` (reduce-scatter only): the full buffer is all-reduced and this rank's chunk
  sliced out. Same values (the same sum per element), about twice the bytes (``2 (n-1)/n * S``);
  :attr:`TorchCommunicator.fallbacks` counts such calls so a report can say so. ``"auto"`` falls
  back to it where the backend refuses its own reduce-scatter.
- ``"native"``: the backend's own collective, whatever it costs.

Every path records the traffic of **the collective the engine asked for** (ring model), because
C-ZERO-005 checks the engine's schedule, not the transport; over two ranks every path adds the same
two values and is bitwise equal to the others.

Timeouts (a collective whose peers never arrive must not hang the job):

- ``init_process_group(timeout=timeout_s)``: gloo applies it to every operation of the group
  (its own I/O timeout); NCCL's watchdog applies it to every collective.
- Every collective is issued with ``async_op=True`` and waited with ``work.wait(timeout)``. On
  gloo that raises after ``timeout_s``; on NCCL it raises only with ``TORCH_NCCL_BLOCKING_WAIT=1``
  (which :func:`init_distributed` sets unless the caller chose otherwise); otherwise NCCL's
  watchdog aborts the process after the process-group timeout and torchrun ends the job.
- On a timeout the rank reads its peers' progress from the job's store
  (:mod:`zerogpu.progress`) and raises :class:`~zerosim.errors.CollectiveTimeout` naming the ranks
  that never arrived. A peer that died makes gloo fail at once ("connection closed by peer"): that
  raises :class:`~zerosim.errors.CollectiveError` naming the failed peers. Either way the process
  group is unusable afterwards; the caller must end the job (:mod:`zerogpu.rank` does).

``split(color, key, name)``: the members agree on the split with one small all-gather of
``(color, key, global rank, name hash)``; then for a split of the world **every** rank creates
**every** new group with ``new_group`` in color order (torch requires all processes to enter
``new_group`` in the same order), members ordered by ``(key, rank)``. A split of a sub-group uses
``new_group(use_local_synchronization=True)``: only that group's members take part (torch names
such groups by their ranks and the count of groups each process registered before; members whose
counts differ are aligned first, see :meth:`TorchCommunicator._align_group_names`).

Test-only fault hook: ``ZEROSIM_FAULT`` (see :mod:`zerosim.comm.fault_plan`).

Why one module of this length: process-group set-up and the communicator share the process-wide
job state (store, group naming, progress board) that every collective and every ``split`` reads.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import time
from datetime import timedelta
from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist

from zerosim.comm.base import DEFAULT_TIMEOUT_S, REDUCE_OPS, TrafficCounter
from zerosim.comm.fault_plan import FaultCounter, FaultPlan
from zerosim.errors import CollectiveError, CollectiveTimeout, ConfigError
from zerosim.xp import torch_namespace

from .progress import ProgressBoard

REDUCE_SCATTER_MODES = ("auto", "native", "reduce", "all_reduce")
ALL_GATHER_MODES = ("auto", "native", "broadcast")
DIST_BACKENDS = ("auto", "gloo", "nccl")
# all_gather_into on gloo: views at least this long are broadcast into directly; shorter ones of a
# rank share one staging buffer (a broadcast costs a round trip whatever its size)
DIRECT_GATHER_MIN = 65_536

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
def _all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed's single-tensor all-gather, looked up per call (so a wrapper installed later,
    such as ``zerosim verify``'s traffic counter, sees the call)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed's single-tensor reduce-scatter, looked up per call (as the all-gather is)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)
_NEW_GROUP_PARAMS = set(inspect.signature(dist.new_group).parameters)


# ---- process-wide state shared by every communicator of this process ------------------------------

class _Job:
    """What the communicators of one process share: progress board, fault counter, control group."""

    def __init__(self, timeout_s: float):
        self.world = dist.group.WORLD
        self.world_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        store = _default_store()
        self.board = ProgressBoard(store, self.world_rank)
        self.fault = FaultCounter(FaultPlan.from_env(), self.world_rank)
        self.native_reduce_scatter: bool | None = None  # None: not tried yet
        # object collectives (control path, not traffic-accounted) run on CPU tensors: gloo
        self.control_group: Any = (dist.group.WORLD if "gloo" in self.backend
                                   else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))


_JOB: _Job | None = None


def _job(timeout_s: float) -> _Job:
    global _JOB
    if _JOB is None or _JOB.world is not dist.group.WORLD:  # a new default process group: start afresh
        if _JOB is not None:
            _JOB.board.stop()
        _JOB = _Job(timeout_s)
    return _JOB


def current_job() -> _Job | None:
    """The process's shared communicator state, if a communicator exists (used by the failure policy)."""
    return _JOB


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store, no survey (errors still raise, without names)
        return None


def _pg_count() -> int:
    """How many process groups this process registered (torch names local-sync groups by it)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return len(_world.pg_names)
    except Exception:  # noqa: BLE001
        return -1


def _name_hash(name: str | None) -> int:
    if name is None:
        return -1
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


# ---- set-up -----------------------------------------------------------------------------------------

def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``; validates the rest."""
    if device in (None, "", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", device, "expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ConfigError("device", device, "expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine (torch "
                          f"{torch.__version__}); use --device cpu (gloo)")
    index = dev.index
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    if index >= torch.cuda.device_count():
        raise ConfigError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def resolve_backend(backend: str, device: str) -> str:
    """``auto`` -> nccl for CUDA, gloo for CPU; NCCL cannot move CPU tensors."""
    if backend not in DIST_BACKENDS:
        raise ConfigError("dist_backend", backend, f"known: {', '.join(DIST_BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not device.startswith("cuda"):
        raise ConfigError("dist_backend", backend, "NCCL moves CUDA tensors only; use gloo with --device cpu")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError("dist_backend", backend, "this torch build has no NCCL")
    return backend


def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                     reduce_scatter: str = "auto", all_gather: str = "auto") -> TorchCommunicator:
    """``init_process_group`` from torchrun's environment (``env://``) and the world communicator.

    ``timeout_s`` bounds the rendezvous and every collective (see the module docstring). On NCCL,
    sets ``TORCH_NCCL_BLOCKING_WAIT=1`` (unless already set) so a timed-out collective raises in
    the rank instead of the watchdog killing the process without a diagnostic.
    """
    _check_timeout(timeout_s)
    device = resolve_device(device)
    backend = resolve_backend(backend, device)
    if not dist.is_available():
        raise ConfigError("backend", "torch", "this torch build has no torch.distributed")
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        torch.cuda.set_device(torch.device(device))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=float(timeout_s)))
    return TorchCommunicator(device=device, timeout_s=timeout_s, reduce_scatter=reduce_scatter,
                             all_gather=all_gather)


def _check_timeout(timeout_s: Any) -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")


# ---- the communicator -----------------------------------------------------------------------------

class TorchCommunicator:
    """One rank's view of one torch.distributed process group (implements ``Communicator``).

    Arrays are torch tensors on :attr:`device` (results likewise); numpy arrays are accepted too and
    answered with numpy arrays (bfloat16 as ``ml_dtypes``), for tests and tools.
    """

    backend = "torch"

    def __init__(
        self,
        group: Any = None,
        device: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        group_name: str = "world",
        traffic: TrafficCounter | None = None,
        reduce_scatter: str = "auto",
        all_gather: str = "auto",
        _global_ranks: tuple[int, ...] | None = None,
        _fallbacks: dict[str, int] | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed", "uninitialized",
                              "call zerogpu.comm.init_distributed() (or init_process_group) first")
        _check_timeout(timeout_s)
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ConfigError("reduce_scatter", reduce_scatter, f"known: {', '.join(REDUCE_SCATTER_MODES)}")
        if all_gather not in ALL_GATHER_MODES:
            raise ConfigError("all_gather", all_gather, f"known: {', '.join(ALL_GATHER_MODES)}")
        self._job = _job(float(timeout_s))
        self._pg = dist.group.WORLD if group is None else group
        if device is None:
            device = "cuda" if "nccl" in self._job.backend else "cpu"
        self._ns = torch_namespace(device)
        self.device = self._ns.device
        self._torch_device = torch.device(self.device)
        self.rank = dist.get_rank(self._pg)
        self.world_size = dist.get_world_size(self._pg)
        self.global_rank = self._job.world_rank
        self.global_ranks = (
            _global_ranks if _global_ranks is not None else tuple(dist.get_process_group_ranks(self._pg))
        )
        self.group_name = group_name
        self.timeout_s = float(timeout_s)
        self._timeout = timedelta(seconds=self.timeout_s)
        self.reduce_scatter_mode = reduce_scatter
        self.all_gather_mode = all_gather
        # gloo moves this group's tensors (no NCCL, or CPU tensors beside it): decompose by default
        self._on_gloo = not ("nccl" in self._job.backend and self.device.startswith("cuda"))
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.fallbacks = (
            _fallbacks if _fallbacks is not None else {}
        )  # collective -> calls done by a fallback
        self._board_key = self._job.board.board_key(group_name, self.global_ranks)
        self._calls = 0  # collectives entered on this group (names default split groups like the simulator)
        self._is_world = group is None or group is dist.group.WORLD

    def __repr__(self) -> str:
        return (f"TorchCommunicator(group={self.group_name!r}, rank={self.rank}/{self.world_size}, "
                f"device={self.device!r})")

    @property
    def process_group(self) -> Any:
        """The underlying ``torch.distributed`` process group."""
        return self._pg

    # -- arrays in, arrays out ------------------------------------------------------------------------
    def _tensor(self, x: Any) -> tuple[torch.Tensor, bool]:
        """(``x`` as a contiguous tensor on this communicator's device, whether it came as numpy)."""
        if isinstance(x, torch.Tensor):
            if x.device != self._torch_device and not (x.device.type == self._torch_device.type == "cuda"
                                                       and self._torch_device.index is None):
                raise ConfigError(
                    "device", str(x.device), f"group {self.group_name} moves tensors on {self.device}"
                )
            return (x if x.is_contiguous() else x.contiguous()), False
        if isinstance(x, (np.ndarray, np.generic, int, float)):
            a = np.asarray(x)  # (reshaped: np.ascontiguousarray turns a 0-d array into a 1-d one)
            return self._ns.from_numpy(a, copy=True).reshape(a.shape), True
        raise ConfigError("array", type(x).__name__, "expected a torch tensor or a numpy array")

    def _out(self, t: torch.Tensor, as_numpy: bool) -> Any:
        return self._ns.to_numpy(t) if as_numpy else t

    def _check_op(self, op: str, t: torch.Tensor) -> None:
        if op not in REDUCE_OPS:
            raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
        if op == "avg" and not (t.is_floating_point() or t.is_complex()):
            raise ConfigError(
                "op", op, f"avg needs a floating dtype, got {str(t.dtype).removeprefix('torch.')}"
            )

    def _check_flat(self, collective: str, t: torch.Tensor, divisible: bool = False) -> None:
        if t.dim() != 1:
            raise CollectiveError(
                f"{collective} on group {self.group_name}: rank {self.global_rank} passed a "
                f"{t.dim()}-D array; flat 1-D buffers only"
            )
        if divisible and t.shape[0] % self.world_size:
            raise CollectiveError(f"{collective} on group {self.group_name}: length {t.shape[0]} on rank "
                                  f"{self.global_rank} is not divisible by the group size {self.world_size}")

    # -- the one place a collective is issued ----------------------------------------------------
    def _enter(self, collective: str) -> int:
        """Fault hook (tests), call count, progress board; returns this call's index on the group."""
        self._job.fault.tick(collective, self.group_name)
        call = self._calls
        self._calls += 1
        self._job.board.enter(self._board_key, collective, call)
        return call

    def _issue(self, collective: str, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Run ``fn(*args, group=..., async_op=True)`` and wait at most ``timeout_s`` for it."""
        call = self._enter(collective)
        try:
            work = fn(*args, group=self._pg, async_op=True, **kwargs)
            if work is not None:
                work.wait(timeout=self._timeout)
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            if _unsupported(e):  # refused before anything moved (the same on every rank): not a call
                self._calls -= 1
                raise UnsupportedCollective(f"{collective} on group {self.group_name}: {e}") from e
            raise self._error(collective, call, e) from e
        finally:
            self._job.board.leave()

    def _issue_each(self, collective: str, calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]) -> None:
        """One collective made of several backend calls: start every ``fn(*args, group=...,
        async_op=True, **kwargs)`` of ``calls``, then wait for all of them within one ``timeout_s``."""
        call = self._enter(collective)
        try:
            works = [fn(*args, group=self._pg, async_op=True, **kwargs) for fn, args, kwargs in calls]
            deadline = time.monotonic() + self.timeout_s
            for work in works:
                if work is not None:
                    work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            raise self._error(collective, call, e) from e
        finally:
            self._job.board.leave()

    def _error(self, collective: str, call: int, e: Exception) -> CollectiveError:
        """A backend error as CollectiveTimeout (the peers that never arrived) or CollectiveError."""
        if isinstance(e, CollectiveError):
            return e
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        missing, notes = self._job.board.survey(self._board_key, call, self.global_ranks)
        detail = "; ".join(f"rank {m}: {notes[m]}" for m in missing if m in notes)
        timed_out = "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()
        if timed_out:
            err = CollectiveTimeout(collective, missing, self.timeout_s, self.group_name)
            err.args = (f"{err} ({detail})" if detail else str(err),)
            return err
        failed = [m for m in missing if notes.get(m) == "failed"]
        who = f"; failed peers: {failed}" if failed else (f"; peers: {detail}" if detail else "")
        return CollectiveError(f"{collective} on group {self.group_name}: {self._job.backend} error on rank "
                               f"{self.global_rank}: {text}{who}")

    # -- collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        t, as_numpy = self._tensor(x)
        self._check_op(op, t)
        out = t.clone()
        self.traffic.record(self.group_name, "all_reduce", _nbytes(t), self.world_size)
        if self.world_size > 1:
            self._issue("all_reduce", dist.all_reduce, out, op=_OPS[op])
        else:
            self._enter("all_reduce")
            self._job.board.leave()
        if op == "avg":
            out /= self.world_size  # the simulator's arithmetic: the sum, then divide in place
        return self._out(out, as_numpy)

    def all_reduce_start(self, x: torch.Tensor, op: str = "sum") -> PendingAllReduce:
        """Start an all-reduce of ``x`` **in place** and return at once; :meth:`PendingAllReduce.wait`
        finishes it (``avg``: the sum, then divided in place, as :meth:`all_reduce`). The arithmetic is
        :meth:`all_reduce`'s; what differs is that the caller goes on computing while the backend
        moves the bytes (gradient reduction overlapped with backward). ``x`` must be a contiguous
        tensor on this communicator's device and must not be touched until ``wait`` returns.
        Collectives of one group still complete in the order they were started."""
        t, as_numpy = self._tensor(x)
        if as_numpy or t is not x:
            raise ConfigError("array", type(x).__name__,
                              "all_reduce_start reduces in place: a contiguous tensor on the group's device")
        self._check_op(op, t)
        self.traffic.record(self.group_name, "all_reduce", _nbytes(t), self.world_size)
        call = self._enter("all_reduce")
        work = None
        try:
            if self.world_size > 1:
                work = dist.all_reduce(t, op=_OPS[op], group=self._pg, async_op=True)
        except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
            raise self._error("all_reduce", call, e) from e
        finally:
            self._job.board.leave()
        return PendingAllReduce(self, t, op, work, call)

    def reduce_scatter(self, x: Any, op: str = "sum", *, donate: bool = False) -> Any:
        """``donate=True``: ``x`` is scratch space (gloo's reduces and the all-reduce fallback run in
        it, and the result is a view into it) instead of being copied first."""
        t, as_numpy = self._tensor(x)
        self._check_op(op, t)
        self._check_flat("reduce_scatter", t, divisible=True)
        n = self.world_size
        c = t.shape[0] // n
        self.traffic.record(self.group_name, "reduce_scatter", _nbytes(t), n)
        path = self._reduce_scatter_path()
        if n == 1:
            self._enter("reduce_scatter")
            self._job.board.leave()
            out = t if donate else t.clone()
        elif path == "reduce":
            out = self._reduce_scatter_via_reduce(t, op, c, donate)
        elif path == "native":
            out = torch.empty(c, dtype=t.dtype, device=t.device)
            try:
                self._issue("reduce_scatter", _reduce_scatter_single, out, t, op=_OPS[op])
                self._job.native_reduce_scatter = True
            except UnsupportedCollective:
                if self.reduce_scatter_mode == "native":
                    raise
                # this backend has no reduce-scatter (decided identically on every rank): fall back
                self._job.native_reduce_scatter = False
                out = self._reduce_scatter_via_all_reduce(t, op, c, donate)
        else:
            out = self._reduce_scatter_via_all_reduce(t, op, c, donate)
        if op == "avg":
            out /= n
        return self._out(out, as_numpy)

    def _reduce_scatter_path(self) -> str:
        """``native``, ``reduce`` or ``all_reduce`` (see the module docstring)."""
        if self.reduce_scatter_mode != "auto":
            return self.reduce_scatter_mode
        if self._on_gloo:
            return "reduce"
        return "all_reduce" if self._job.native_reduce_scatter is False else "native"

    def _reduce_scatter_via_reduce(self, t: torch.Tensor, op: str, c: int, donate: bool) -> torch.Tensor:
        """One reduce per chunk to its owner, all in flight together. Each chunk is reduced in a copy
        (gloo uses a non-root's buffer as scratch), or in place in a donated input; this rank keeps
        the chunk it owns."""
        chunks = [t[i * c:(i + 1) * c] if donate else t[i * c:(i + 1) * c].clone()
                  for i in range(self.world_size)]
        self._issue_each("reduce_scatter", [
            (dist.reduce, (chunk,), {"dst": self.global_ranks[i], "op": _OPS[op]})
            for i, chunk in enumerate(chunks)
        ])
        return chunks[self.rank]

    def _reduce_scatter_via_all_reduce(self, t: torch.Tensor, op: str, c: int, donate: bool) -> torch.Tensor:
        """Fallback: all-reduce the whole buffer, keep this rank's chunk (recorded as a reduce-scatter)."""
        full = t if donate else t.clone()
        self._issue("reduce_scatter", dist.all_reduce, full, op=_OPS[op])
        self.fallbacks["reduce_scatter"] = self.fallbacks.get("reduce_scatter", 0) + 1
        mine = full[self.rank * c:(self.rank + 1) * c]
        return mine if donate else mine.clone()

    def all_gather(self, x: Any) -> Any:
        t, as_numpy = self._tensor(x)
        self._check_flat("all_gather", t)
        n = self.world_size
        self.traffic.record(self.group_name, "all_gather", _nbytes(t) * n, n)
        if n == 1:
            self._enter("all_gather")
            self._job.board.leave()
            return self._out(t.clone(), as_numpy)
        out = torch.empty(t.shape[0] * n, dtype=t.dtype, device=t.device)
        if self._gathers_by_broadcast():
            chunks = out.split(t.shape[0])
            chunks[self.rank].copy_(t)
            self._issue_each("all_gather", [
                (dist.broadcast, (chunk,), {"src": self.global_ranks[i]}) for i, chunk in enumerate(chunks)
            ])
        else:
            self._issue("all_gather", _all_gather_single, out, t)
        return self._out(out, as_numpy)

    def all_gather_into(self, x: torch.Tensor, destinations: list[list[tuple[int, torch.Tensor]]]) -> None:
        """An all-gather of ``x`` whose result is written where it is used instead of returned:
        ``destinations[j]`` lists ``(offset, view)`` pairs, and ``view`` receives rank ``j``'s
        ``x[offset:offset + view.numel()]``. Positions no pair lists (padding) are not delivered.
        Traffic is recorded as the all-gather of ``x``.

        On the broadcast path (gloo) each view of at least :data:`DIRECT_GATHER_MIN` elements is
        broadcast into from its owner, so nothing lands in a buffer that then has to be copied; the
        smaller views of a rank travel together in one staging buffer. Elsewhere the packed result
        is gathered once and copied out."""
        self._check_flat("all_gather", x)
        n = self.world_size
        if len(destinations) != n:
            raise CollectiveError(f"all_gather_into on group {self.group_name}: {len(destinations)} "
                                  f"destination lists for {n} ranks")
        for pieces in destinations:
            for off, view in pieces:
                if view.dtype != x.dtype or not view.is_contiguous() or off + view.numel() > x.shape[0]:
                    raise CollectiveError(f"all_gather_into on group {self.group_name}: the destination at "
                                          f"offset {off} is not a contiguous {x.dtype} view inside a chunk")
        if n == 1 or not self._gathers_by_broadcast():
            gathered = self.all_gather(x)
            c = x.shape[0]
            for j, pieces in enumerate(destinations):
                for off, view in pieces:
                    view.copy_(gathered[j * c + off:j * c + off + view.numel()].view(view.shape))
            return
        self.traffic.record(self.group_name, "all_gather", _nbytes(x) * n, n)
        calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        staged: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = []
        for j, pieces in enumerate(destinations):
            src = self.global_ranks[j]
            small = [(off, view) for off, view in pieces if view.numel() < DIRECT_GATHER_MIN]
            for off, view in (p for p in pieces if p[1].numel() >= DIRECT_GATHER_MIN):
                if j == self.rank:
                    view.copy_(x[off:off + view.numel()].view(view.shape))
                calls.append((dist.broadcast, (view,), {"src": src}))
            if small:
                staging = torch.empty(sum(v.numel() for _, v in small), dtype=x.dtype, device=x.device)
                if j == self.rank:
                    torch.cat([x[off:off + v.numel()] for off, v in small], out=staging)
                calls.append((dist.broadcast, (staging,), {"src": src}))
                staged.append((staging, small))
        self._issue_each("all_gather", calls)
        for staging, small in staged:
            at = 0
            for _, view in small:
                view.copy_(staging[at:at + view.numel()].view(view.shape))
                at += view.numel()

    def _gathers_by_broadcast(self) -> bool:
        return self.all_gather_mode == "broadcast" or (self.all_gather_mode == "auto" and self._on_gloo)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError(
                "root", root, f"must be a rank of group {self.group_name} (size {self.world_size})"
            )
        t, as_numpy = self._tensor(x)
        out = t.clone()
        self.traffic.record(
            self.group_name, "broadcast", _nbytes(t), self.world_size, is_root=self.rank == root
        )
        if self.world_size > 1:
            self._issue("broadcast", dist.broadcast, out, src=self.global_ranks[root])
        else:
            self._enter("broadcast")
            self._job.board.leave()
        return self._out(out, as_numpy)

    def barrier(self) -> None:
        self.traffic.record(self.group_name, "barrier", 0, self.world_size)
        if self.world_size == 1:
            self._enter("barrier")
            self._job.board.leave()
            return
        if "nccl" in self._job.backend and self.device.startswith("cuda"):
            # an NCCL barrier is an all-reduce of one element; waiting on it bounds it by the timeout
            token = torch.zeros(1, device=self._torch_device)
            self._issue("barrier", dist.all_reduce, token)
            torch.cuda.synchronize(self._torch_device)
            return
        self._issue("barrier", dist.barrier)

    # -- sub-groups ---------------------------------------------------------------------------------
    @overload
    def split(self, color: int, key: int | None = None, name: str | None = None) -> TorchCommunicator: ...
    @overload
    def split(self, color: None, key: int | None = None, name: str | None = None) -> None: ...

    def split(
        self, color: int | None, key: int | None = None, name: str | None = None
    ) -> TorchCommunicator | None:
        """``MPI_Comm_split``: ranks with the same color form a group, ordered by (key, rank).

        ``color=None`` opts out (returns None). ``name`` names the new group for traffic accounting
        (members of one color must agree on it); the default is ``<parent>/split<k>:<color>`` with
        ``k`` this group's collective count, as in the simulator. The new communicator records into
        this one's ``traffic`` counter and shares the timeout settings. No traffic is recorded.
        """
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ConfigError("color", color, "must be a non-negative integer or None")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise ConfigError("key", key, "must be an integer or None")
        default_name = f"{self.group_name}/split{self._calls}:{color}"
        mine = [-1 if color is None else color, self.rank if key is None else key, self.global_rank,
                _name_hash(name), _pg_count()]
        table = torch.empty(self.world_size * len(mine), dtype=torch.int64, device=self._torch_device)
        self._issue("split", _all_gather_single, table,
                    torch.tensor(mine, dtype=torch.int64, device=self._torch_device))
        rows = table.reshape(self.world_size, len(mine)).tolist()
        by_color: dict[int, list[tuple[int, int, int, int, int]]] = {}
        for grank, (c, k, g, h, count) in enumerate(rows):
            if c >= 0:
                by_color.setdefault(c, []).append((k, grank, g, h, count))
        for c, members in by_color.items():
            if len({m[3] for m in members}) > 1:
                raise CollectiveError(
                    f"split of group {self.group_name}: members of color {c} disagree on the "
                    f"group name (rank {self.global_rank} passed {name!r})"
                )
            members.sort(key=lambda m: (m[0], m[1]))
        if not self._is_world and color is not None:
            self._align_group_names([m[4] for m in by_color[color]])
        mine_pg: Any = None
        my_ranks: tuple[int, ...] = ()
        for c in sorted(by_color):
            ranks = [m[2] for m in by_color[c]]
            if not self._is_world and c != color:
                continue  # local synchronisation: only the members create their group
            pg = self._new_group(ranks, name if c == color else None)
            if c == color:
                mine_pg, my_ranks = pg, tuple(ranks)
        if color is None:
            return None
        return TorchCommunicator(mine_pg, self.device, timeout_s=self.timeout_s,
                                 group_name=default_name if name is None else name, traffic=self.traffic,
                                 reduce_scatter=self.reduce_scatter_mode, all_gather=self.all_gather_mode,
                                 _global_ranks=my_ranks,
                                 _fallbacks=self.fallbacks)

    def _align_group_names(self, counts: list[int]) -> None:
        """Before a locally synchronised ``new_group``: torch names such a group by hashing its ranks
        with the number of groups the process registered so far, so members that registered different
        numbers (one sat out an earlier split) would wait under different names. The behind ones
        register single-rank placeholder groups (local, no peers, no communication) to catch up."""
        if min(counts) < 0:
            return  # torch does not expose the count: nothing to align
        for _ in range(max(counts) - _pg_count()):
            dist.new_group([self.global_rank], use_local_synchronization=True, timeout=self._timeout)

    def _new_group(self, ranks: list[int], name: str | None) -> Any:
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if ranks != sorted(ranks):
            if "sort_ranks" not in _NEW_GROUP_PARAMS:
                raise CollectiveError(
                    f"split of group {self.group_name}: a key order that differs from rank order "
                    f"needs new_group(sort_ranks=False) (torch {torch.__version__} has none)"
                )
            kwargs["sort_ranks"] = False
        if not self._is_world:
            kwargs["use_local_synchronization"] = True
        if name is not None and "group_desc" in _NEW_GROUP_PARAMS:
            kwargs["group_desc"] = name
        try:
            return dist.new_group(ranks, **kwargs)
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(f"split of group {self.group_name}: new_group({ranks}) failed on rank "
                                  f"{self.global_rank}: {e}") from e

    # -- the control path (objects; not traffic-accounted; bounded by the process-group timeout) ----
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``root`` (rank order), None elsewhere. World communicator only."""
        self._require_world("gather_object")
        out: list[Any] | None = [None] * self.world_size if self.rank == root else None
        try:
            dist.gather_object(obj, out, dst=root, group=self._job.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._error("gather_object", self._calls - 1, e) from e
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank. World communicator only."""
        self._require_world("broadcast_object")
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=root, group=self._job.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._error("broadcast_object", self._calls - 1, e) from e
        return box[0]

    def _require_world(self, what: str) -> None:
        if not self._is_world:
            raise ConfigError("group", self.group_name, f"{what} runs on the world communicator only")


class PendingAllReduce:
    """An all-reduce started by :meth:`TorchCommunicator.all_reduce_start`; :meth:`wait` completes it."""

    def __init__(self, comm: TorchCommunicator, tensor: torch.Tensor, op: str, work: Any, call: int):
        self._comm, self._tensor, self._op, self._work, self._call = comm, tensor, op, work, call
        self._done = False

    def wait(self) -> torch.Tensor:
        """Wait at most the group's timeout (CollectiveTimeout naming the ranks that never arrived);
        returns the reduced tensor (the one given to ``all_reduce_start``)."""
        if not self._done:
            comm = self._comm
            try:
                if self._work is not None:
                    self._work.wait(timeout=comm._timeout)
            except Exception as e:  # noqa: BLE001 - every backend error becomes ours, with a diagnosis
                raise comm._error("all_reduce", self._call, e) from e
            if self._op == "avg":
                self._tensor /= comm.world_size
            self._done = True
        return self._tensor


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel() * t.element_size())


class UnsupportedCollective(CollectiveError):
    """The backend has no such operation (raised before any data moved)."""


def _unsupported(e: BaseException) -> bool:
    """Did the backend refuse the operation itself (rather than fail while running it)?"""
    text = str(e).lower()
    return isinstance(e, NotImplementedError) or "not supported" in text or "does not support" in text \
        or "unsupported" in text
