"""Traffic counted on the wire: a wrapper of torch.distributed's collectives (C-ZERO-005's measured side).

:class:`TrafficCounter` replaces the data collectives of ``torch.distributed`` (and of
``distributed_c10d``, where libraries call them) for the duration of a ``with`` block and records,
per rank, every call's group, kind, buffer size and the element dtype of the tensor it moved.
Bytes are attributed to the ring algorithm exactly as :func:`zerosim.comm.base.ring_bytes` does for
the reference engine. Calls are split into gradient reduction (all-reduce, reduce-scatter, reduce to
one owner), parameter exchange (all-gather, broadcast) and control (scalars: a gradient norm, a loss,
an overflow flag) by :func:`zerosim.checks.traffic.traffic_class`.
Collectives issued through torch's functional collectives (DTensor's ``full_tensor`` and norm
reductions) bypass the wrapped Python functions; none of the peers moves model data that way inside
a step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from zerosim.checks.traffic import TRAFFIC_CLASSES, traffic_class
from zerosim.comm.base import ring_bytes


def local_tensor(tensor: Any) -> Any:
    """The rank-local tensor behind a DTensor (its shard), the tensor itself otherwise."""
    local = getattr(tensor, "_local_tensor", None)
    return local if local is not None else tensor


@dataclass(frozen=True)
class _Wrapped:
    """How to read one torch.distributed function's call: its ring kind, payload and group."""

    kind: str  # all_reduce | reduce_scatter | reduce | all_gather | broadcast
    payload: str  # first | second | second_list | first_list | input_times_n | second_list_times_n
    group_pos: int  # positional index of ``group``


# every data collective the peers call from Python (logged on DDP hooks, ZeroRedundancyOptimizer,
# FSDP2, DeepSpeed); payload = the full buffer size S of zerosim.comm.base's ring attribution
_WRAPPED: dict[str, _Wrapped] = {
    "all_reduce": _Wrapped("all_reduce", "first", 2),
    "all_reduce_coalesced": _Wrapped("all_reduce", "first_list", 2),
    "broadcast": _Wrapped("broadcast", "first", 2),
    "reduce": _Wrapped("reduce", "first", 3),
    "all_gather": _Wrapped("all_gather", "input_times_n", 2),
    "all_gather_into_tensor": _Wrapped("all_gather", "first", 2),
    "all_gather_single": _Wrapped("all_gather", "first", 2),
    "_all_gather_base": _Wrapped("all_gather", "first", 2),
    "all_gather_coalesced": _Wrapped("all_gather", "second_list_times_n", 2),
    "reduce_scatter": _Wrapped("reduce_scatter", "second_list", 3),
    "reduce_scatter_tensor": _Wrapped("reduce_scatter", "second", 3),
    "reduce_scatter_single": _Wrapped("reduce_scatter", "second", 3),
    "_reduce_scatter_base": _Wrapped("reduce_scatter", "second", 3),
}


def _nbytes(t: Any) -> int:
    t = local_tensor(t)
    return int(t.numel()) * int(t.element_size())


def dtype_name(t: Any) -> str:
    """The element dtype of a tensor as its short name (``"float32"``, ``"bfloat16"``)."""
    return str(local_tensor(t).dtype).replace("torch.", "")


@dataclass(frozen=True)
class CollectiveCall:
    """One data collective as a rank saw it: kind, the group's global ranks, buffer size, root or not,
    and the element dtype of the tensor it moved (the first tensor's where a call moves a list)."""

    function: str
    kind: str
    group_ranks: tuple[int, ...]
    payload_bytes: int
    payload_numel: int
    is_root: bool
    dtype: str = ""

    @property
    def traffic_class(self) -> str:
        """``reduce`` (gradient reduction), ``gather`` (parameter exchange) or ``control`` (scalars)."""
        return traffic_class(self.kind, self.payload_numel)

    def record(self) -> dict[str, Any]:
        """The call as plain data (C-ZERO-005's ``reduce_dtype`` clause reads these)."""
        return {"function": self.function, "kind": self.kind, "class": self.traffic_class,
                "dtype": self.dtype, "payload_bytes": self.payload_bytes, "group": list(self.group_ranks)}

    def ring(self) -> tuple[Fraction, Fraction]:
        if self.kind == "reduce":
            # a ring reduce is a pipeline ending at the root: n-1 hops of S bytes, spread evenly as
            # (n-1)/n S per rank, the reduce-scatter's volume (one reduce per owner sums to it exactly)
            return ring_bytes("reduce_scatter", self.payload_bytes, len(self.group_ranks))
        return ring_bytes(self.kind, self.payload_bytes, len(self.group_ranks), self.is_root)


@dataclass
class TrafficCounter:
    """Counts every torch.distributed data collective this rank issues inside ``with`` (C-ZERO-005).

    Wraps the functions of :data:`_WRAPPED` on ``torch.distributed`` and ``distributed_c10d`` for the
    duration of the block; nested calls (one wrapped function implemented with another) count once,
    at the outermost. A reference a library bound before the block (DeepSpeed caches its all-gather
    function when its engine is built) is out of reach.
    """

    calls: list[CollectiveCall] = field(default_factory=list)
    _saved: dict[tuple[Any, str], Any] = field(default_factory=dict)
    _depth: int = 0

    def __enter__(self) -> TrafficCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        if getattr(dist, "_zerosim_traffic_counter", None) is not None:
            raise RuntimeError("a TrafficCounter is already counting on this rank")
        dist._zerosim_traffic_counter = self  # type: ignore[attr-defined]
        for module in (dist, c10d):
            for name, spec in _WRAPPED.items():
                original = getattr(module, name, None)
                if original is not None:
                    self._saved[(module, name)] = original
                    setattr(module, name, self._wrap(name, spec, original))
        return self

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        for (module, name), original in self._saved.items():
            setattr(module, name, original)
        self._saved.clear()
        dist._zerosim_traffic_counter = None  # type: ignore[attr-defined]

    def _wrap(self, name: str, spec: _Wrapped, original: Any) -> Any:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            outermost = self._depth == 0
            self._depth += 1
            try:
                if outermost:
                    self.calls.append(_describe(name, spec, args, kwargs))
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def summary(self) -> dict[str, Any]:
        """Bytes sent and received per traffic class, calls per function, and every call as a record
        (``collectives``: :meth:`CollectiveCall.record`) on this rank."""
        out: dict[str, Any] = {
            c: {"sent": Fraction(0), "received": Fraction(0)} for c in (*TRAFFIC_CLASSES, "control")
        }
        functions: dict[str, int] = {}
        for call in self.calls:
            sent, received = call.ring()
            out[call.traffic_class]["sent"] += sent
            out[call.traffic_class]["received"] += received
            functions[call.function] = functions.get(call.function, 0) + 1
        out["functions"] = functions
        out["collectives"] = [call.record() for call in self.calls]
        return out


_INPUT_KEYWORDS = ("input_tensor", "input", "input_list", "input_tensor_list")


def _describe(name: str, spec: _Wrapped, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveCall:
    import torch.distributed as dist

    group = kwargs.get("group", args[spec.group_pos] if len(args) > spec.group_pos else None)
    ranks = (
        tuple(dist.get_process_group_ranks(group))
        if group is not None
        else tuple(range(dist.get_world_size()))
    )
    first = kwargs.get("tensor", kwargs.get("output_tensor", kwargs.get("output", args[0] if args else None)))
    second = (
        args[1]
        if len(args) > 1
        else next((kwargs[k] for k in _INPUT_KEYWORDS if k in kwargs), None)
    )
    if spec.payload == "first":
        tensors = [first]
    elif spec.payload == "second":
        tensors = [second]
    elif spec.payload == "first_list":
        tensors = list(first or ())
    elif spec.payload == "second_list":
        tensors = list(second or ())
    elif spec.payload == "second_list_times_n":  # all_gather_coalesced(output_lists, input_list)
        tensors = list(second or ()) * len(ranks)
    else:  # input_times_n: all_gather(tensor_list, tensor), positional or by keyword (DeepSpeed's comm)
        tensors = [second if second is not None else kwargs.get("tensor")] * len(ranks)
    present = [t for t in tensors if t is not None]
    dtype = dtype_name(present[0]) if present else ""
    nbytes = sum(_nbytes(t) for t in tensors)
    numel = sum(int(local_tensor(t).numel()) for t in tensors)
    is_root = False
    if spec.kind == "broadcast":
        src = kwargs.get("src", args[1] if len(args) > 1 else None)
        group_src = kwargs.get("group_src")
        me = dist.get_rank()
        is_root = (src == me) if src is not None else (group_src is not None and ranks[group_src] == me)
    return CollectiveCall(name, spec.kind, ranks, nbytes, numel, is_root, dtype)
