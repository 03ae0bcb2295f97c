"""The torch.distributed Communicator: the engine's collectives on NCCL (GPU) or gloo (CPU).

One process per rank. Implements :class:`zerosim.comm.base.Communicator` with ``torch.distributed``:
``all_reduce``, ``reduce_scatter_single`` (``reduce_scatter_tensor``), ``all_gather_single``
(``all_gather_into_tensor``), ``broadcast``, ``barrier`` and ``new_group`` for the hybrid shard /
replicate groups. Its concerns live beside it, as the MPI backend's do:

- :mod:`zerogpu.comm_setup`: device and backend choice, ``init_process_group``'s inputs, and the
  per-process job state every communicator shares;
- :mod:`zerogpu.comm_watchdog`: every collective waited at most ``timeout_s``, a timeout naming the
  ranks that never arrived;
- :mod:`zerogpu.comm_decompose`: how a reduce-scatter and an all-gather travel (native, or
  decomposed into reduces / broadcasts / an all-reduce on gloo);
- :mod:`zerogpu.comm_groups`: ``split`` (``MPI_Comm_split``) into sub-groups with ``new_group``;
- :mod:`zerogpu.comm_traffic`: traffic recorded exactly as the simulator and the MPI backend record
  it (ring attribution, :func:`zerosim.comm.base.ring_bytes`), so C-ZERO-005 and the communication
  model mean the same thing under ``torchrun`` as in one process.

Why one module of this length: it is the Communicator interface's one implementation on
torch.distributed, each method a thin wrapper that waits through the watchdog and records traffic;
split further, each piece would hold one method.

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

Test-only fault hook: ``ZEROSIM_FAULT`` (see :mod:`zerosim.comm.fault_plan`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, overload

import numpy as np
import torch
import torch.distributed as dist

from zerosim.comm.base import DEFAULT_TIMEOUT_S, REDUCE_OPS, TrafficCounter
from zerosim.errors import CollectiveError, ConfigError
from zerosim.numerics.xp import divide_, torch_namespace

from .comm_decompose import (
    ALL_GATHER_MODES,
    DECOMPOSE_REDUCE_SCATTER_MIN,
    DIRECT_GATHER_MIN,
    OPS,
    REDUCE_SCATTER_MODES,
    all_gather_into_via_broadcast,
    all_gather_via_broadcast,
    check_destinations,
    native_all_gather,
    native_reduce_scatter,
    reduce_scatter_via_all_reduce,
    reduce_scatter_via_reduce,
    scatter_gathered,
)
from .comm_groups import split_group
from .comm_setup import (
    DIST_BACKENDS,
    Job,
    check_timeout,
    current_job,
    job,
    resolve_backend,
    resolve_device,
)
from .comm_traffic import GroupTraffic
from .comm_watchdog import GroupWatch, PendingAllReduce, UnsupportedCollective

__all__ = ["ALL_GATHER_MODES", "DIRECT_GATHER_MIN", "DIST_BACKENDS", "REDUCE_SCATTER_MODES",
           "PendingAllReduce", "TorchCommunicator", "UnsupportedCollective", "current_job",
           "init_distributed", "resolve_backend", "resolve_device"]

def init_distributed(backend: str = "auto", device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
                     reduce_scatter: str = "auto", all_gather: str = "auto") -> TorchCommunicator:
    """``init_process_group`` from torchrun's environment (``env://``) and the world communicator.

    ``timeout_s`` bounds the rendezvous and every collective (:mod:`zerogpu.comm_watchdog`). On NCCL,
    sets ``TORCH_NCCL_BLOCKING_WAIT=1`` (unless already set) so a timed-out collective raises in
    the rank instead of the watchdog killing the process without a diagnostic.
    """
    check_timeout(timeout_s)
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
        check_timeout(timeout_s)
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise ConfigError("reduce_scatter", reduce_scatter, f"known: {', '.join(REDUCE_SCATTER_MODES)}")
        if all_gather not in ALL_GATHER_MODES:
            raise ConfigError("all_gather", all_gather, f"known: {', '.join(ALL_GATHER_MODES)}")
        self._job = job(float(timeout_s))
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
        self.reduce_scatter_mode = reduce_scatter
        self.all_gather_mode = all_gather
        # gloo moves this group's tensors (no NCCL, or CPU tensors beside it): decompose by default
        self._on_gloo = not ("nccl" in self._job.backend and self.device.startswith("cuda"))
        self.traffic = traffic if traffic is not None else TrafficCounter()
        self.fallbacks = _fallbacks if _fallbacks is not None else {}  # collective -> calls by a fallback
        self._traffic = GroupTraffic(self.traffic, group_name, self.world_size, self.fallbacks)
        self._watch = GroupWatch(self._job, self._pg, group_name, self.global_rank, self.global_ranks,
                                 self.timeout_s)
        self._is_world = group is None or group is dist.group.WORLD

    def __repr__(self) -> str:
        return (f"TorchCommunicator(group={self.group_name!r}, rank={self.rank}/{self.world_size}, "
                f"device={self.device!r})")

    @property
    def job(self) -> Job:
        """The process's shared communicator state this communicator uses."""
        return self._job

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

    # -- collectives ----------------------------------------------------------------------------------
    def all_reduce(self, x: Any, op: str = "sum") -> Any:
        t, as_numpy = self._tensor(x)
        self._check_op(op, t)
        out = t.clone()
        self._traffic.all_reduce(t)
        if self.world_size > 1:
            self._watch.issue("all_reduce", dist.all_reduce, out, op=OPS[op])
        else:
            self._watch.local("all_reduce")
        if op == "avg" and self.world_size > 1:
            divide_(out, self.world_size)  # the simulator's arithmetic: the sum, then divide in place
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
        self._traffic.all_reduce(t)
        work: Any = None
        if self.world_size > 1:
            work, call = self._watch.start("all_reduce", dist.all_reduce, t, op=OPS[op])
        else:
            call = self._watch.local("all_reduce")
        return PendingAllReduce(self._watch, t, op, work, call, self.world_size)

    def reduce_scatter(self, x: Any, op: str = "sum", *, donate: bool = False) -> Any:
        """``donate=True``: ``x`` is scratch space (gloo's reduces and the all-reduce fallback run in
        it, and the result is a view into it) instead of being copied first."""
        t, as_numpy = self._tensor(x)
        self._check_op(op, t)
        self._check_flat("reduce_scatter", t, divisible=True)
        n = self.world_size
        c = t.shape[0] // n
        self._traffic.reduce_scatter(t)
        path = self._reduce_scatter_path(int(t.shape[0]))
        if n == 1:
            self._watch.local("reduce_scatter")
            out = t if donate else t.clone()
        elif path == "reduce":
            out = reduce_scatter_via_reduce(self._watch, self.rank, t, op, c, donate)
        elif path == "native":
            out = torch.empty(c, dtype=t.dtype, device=t.device)
            try:
                self._watch.issue("reduce_scatter", native_reduce_scatter, out, t, op=OPS[op])
                self._job.native_reduce_scatter = True
            except UnsupportedCollective:
                if self.reduce_scatter_mode == "native":
                    raise
                # this backend has no reduce-scatter (decided identically on every rank): fall back
                self._job.native_reduce_scatter = False
                out = self._reduce_scatter_fallback(t, op, c, donate)
        else:
            out = self._reduce_scatter_fallback(t, op, c, donate)
        if op == "avg" and n > 1:  # x / 1 is x, bit for bit: a group of one skips the pass
            divide_(out, n)
        return self._out(out, as_numpy)

    def _reduce_scatter_path(self, numel: int) -> str:
        """``native``, ``reduce`` or ``all_reduce`` for a reduce-scatter of ``numel`` elements (see
        :mod:`zerogpu.comm_decompose`)."""
        if self.reduce_scatter_mode != "auto":
            return self.reduce_scatter_mode
        if self._on_gloo and numel >= DECOMPOSE_REDUCE_SCATTER_MIN:
            return "reduce"
        return "all_reduce" if self._job.native_reduce_scatter is False else "native"

    def _reduce_scatter_fallback(self, t: torch.Tensor, op: str, c: int, donate: bool) -> torch.Tensor:
        """The all-reduce path, counted as a fallback (recorded as the reduce-scatter asked for)."""
        out = reduce_scatter_via_all_reduce(self._watch, self.rank, t, op, c, donate)
        self._traffic.fallback("reduce_scatter")
        return out

    def all_gather(self, x: Any) -> Any:
        t, as_numpy = self._tensor(x)
        self._check_flat("all_gather", t)
        n = self.world_size
        self._traffic.all_gather(t)
        if n == 1:
            self._watch.local("all_gather")
            return self._out(t.clone(), as_numpy)
        out = torch.empty(t.shape[0] * n, dtype=t.dtype, device=t.device)
        if self._gathers_by_broadcast():
            all_gather_via_broadcast(self._watch, self.rank, t, out)
        else:
            self._watch.issue("all_gather", native_all_gather, out, t)
        return self._out(out, as_numpy)

    def all_gather_into(self, x: torch.Tensor, destinations: list[list[tuple[int, torch.Tensor]]]) -> None:
        """An all-gather of ``x`` whose result is written where it is used instead of returned:
        ``destinations[j]`` lists ``(offset, view)`` pairs, and ``view`` receives rank ``j``'s
        ``x[offset:offset + view.numel()]``. Positions no pair lists (padding) are not delivered.
        Traffic is recorded as the all-gather of ``x``.

        On the broadcast path (gloo) the views are broadcast into directly
        (:func:`~zerogpu.comm_decompose.all_gather_into_via_broadcast`); elsewhere the packed result
        is gathered once and copied out."""
        self._check_flat("all_gather", x)
        check_destinations(self.group_name, x, destinations, self.world_size)
        if self.world_size == 1 or not self._gathers_by_broadcast():
            scatter_gathered(self.all_gather(x), x.shape[0], destinations)
            return
        self._traffic.all_gather(x)
        all_gather_into_via_broadcast(self._watch, self.rank, x, destinations)

    def _gathers_by_broadcast(self) -> bool:
        return self.all_gather_mode == "broadcast" or (self.all_gather_mode == "auto" and self._on_gloo)

    def broadcast(self, x: Any, root: int = 0) -> Any:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self.world_size:
            raise ConfigError(
                "root", root, f"must be a rank of group {self.group_name} (size {self.world_size})"
            )
        t, as_numpy = self._tensor(x)
        out = t.clone()
        self._traffic.broadcast(t, is_root=self.rank == root)
        if self.world_size > 1:
            self._watch.issue("broadcast", dist.broadcast, out, src=self.global_ranks[root])
        else:
            self._watch.local("broadcast")
        return self._out(out, as_numpy)

    def barrier(self) -> None:
        self._traffic.barrier()
        if self.world_size == 1:
            self._watch.local("barrier")
            return
        if "nccl" in self._job.backend and self.device.startswith("cuda"):
            # an NCCL barrier is an all-reduce of one element; waiting on it bounds it by the timeout
            token = torch.zeros(1, device=self._torch_device)
            self._watch.issue("barrier", dist.all_reduce, token)
            torch.cuda.synchronize(self._torch_device)
            return
        self._watch.issue("barrier", dist.barrier)

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
        default_name = f"{self.group_name}/split{self._watch.calls}:{color}"
        made = split_group(self._watch, self.rank, self.world_size, self._is_world, self._torch_device,
                           color, key, name)
        if made is None:
            return None
        mine_pg, my_ranks = made
        return TorchCommunicator(mine_pg, self.device, timeout_s=self.timeout_s,
                                 group_name=default_name if name is None else name, traffic=self.traffic,
                                 reduce_scatter=self.reduce_scatter_mode, all_gather=self.all_gather_mode,
                                 _global_ranks=my_ranks,
                                 _fallbacks=self.fallbacks)

    # -- the control path (objects; not traffic-accounted; bounded by the process-group timeout) ----
    def gather_object(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` on ``root`` (rank order), None elsewhere. World communicator only."""
        self._require_world("gather_object")
        out: list[Any] | None = [None] * self.world_size if self.rank == root else None
        try:
            dist.gather_object(obj, out, dst=root, group=self._job.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._watch.error("gather_object", self._watch.calls - 1, e) from e
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank. World communicator only."""
        self._require_world("broadcast_object")
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=root, group=self._job.control_group)
        except Exception as e:  # noqa: BLE001
            raise self._watch.error("broadcast_object", self._watch.calls - 1, e) from e
        return box[0]

    def _require_world(self, what: str) -> None:
        if not self._is_world:
            raise ConfigError("group", self.group_name, f"{what} runs on the world communicator only")
