"""The Communicator seam: the only way the ZeRO engine talks to other ranks.

Implementations: ``zerosim.comm.sim`` (N ranks in one process), ``zerosim.comm.mpi`` (mpi4py
buffer calls), ``zerogpu`` (torch.distributed). All of them account traffic the same way, attributed
to the ring algorithm (nccl-tests' PERFORMANCE.md), per collective kind and per group, so C-ZERO-005
and the communication model mean the same thing on every backend.

Ring attribution, for a collective over ``n`` ranks on a buffer of ``S`` bytes (S = the full,
unsharded size: all-reduce input, reduce-scatter input, all-gather output, broadcast buffer):

==============  ==============================  ==============================
collective      bytes sent by each rank          bytes received by each rank
==============  ==============================  ==============================
all_reduce      2 (n-1)/n * S                    2 (n-1)/n * S
reduce_scatter  (n-1)/n * S                      (n-1)/n * S
all_gather      (n-1)/n * S                      (n-1)/n * S
broadcast       S on the root, 0 elsewhere       S on every non-root, 0 on the root
==============  ==============================  ==============================

A group of one rank sends and receives nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
REDUCE_OPS = ("sum", "avg", "max")
DEFAULT_TIMEOUT_S = 60.0


def ring_bytes(collective: str, nbytes: int, n: int, is_root: bool = False) -> tuple[Fraction, Fraction]:
    """(sent, received) bytes of one rank for ``collective`` over ``n`` ranks on an ``nbytes`` buffer."""
    if n <= 1 or collective == "barrier":
        return Fraction(0), Fraction(0)
    if collective == "all_reduce":
        v = Fraction(2 * (n - 1) * nbytes, n)
        return v, v
    if collective in ("reduce_scatter", "all_gather"):
        v = Fraction((n - 1) * nbytes, n)
        return v, v
    if collective == "broadcast":
        return (Fraction(nbytes), Fraction(0)) if is_root else (Fraction(0), Fraction(nbytes))
    raise ValueError(f"unknown collective {collective!r}")


def dtype_label(dtype: Any) -> str:
    """A numpy or torch dtype as its short name (``"float32"``, ``"bfloat16"``); "" for None."""
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def dtype_name(x: Any) -> str:
    """The element dtype of an array or tensor as its short name; "" for none (a barrier)."""
    return dtype_label(getattr(x, "dtype", None))


@dataclass
class TrafficRecord:
    calls: int = 0
    bytes_sent: Fraction = Fraction(0)
    bytes_received: Fraction = Fraction(0)
    payload_bytes: int = 0  # sum of S over calls (the full buffer size)
    #: element dtype of the buffers moved -> calls; what the ring model counts ignores it (not compared)
    dtypes: dict[str, int] = field(default_factory=dict, compare=False)


@dataclass
class TrafficCounter:
    """Per-rank traffic, keyed by (group name, collective). Exact fractions; floats only on output."""

    records: dict[tuple[str, str], TrafficRecord] = field(default_factory=dict)

    def record(self, group: str, collective: str, nbytes: int, n: int, is_root: bool = False,
               dtype: str = "") -> None:
        """One call of ``collective`` on ``group`` (``n`` ranks) moving an ``nbytes`` buffer of ``dtype``."""
        sent, recv = ring_bytes(collective, nbytes, n, is_root)
        r = self.records.setdefault((group, collective), TrafficRecord())
        r.calls += 1
        r.bytes_sent += sent
        r.bytes_received += recv
        r.payload_bytes += nbytes
        if dtype:
            r.dtypes[dtype] = r.dtypes.get(dtype, 0) + 1

    def reset(self) -> None:
        self.records.clear()

    def total_sent(self, group: str | None = None, collective: str | None = None) -> Fraction:
        return sum(
            (
                r.bytes_sent
                for (g, c), r in self.records.items()
                if (group is None or g == group) and (collective is None or c == collective)
            ),
            Fraction(0),
        )

    def total_received(self, group: str | None = None, collective: str | None = None) -> Fraction:
        return sum(
            (
                r.bytes_received
                for (g, c), r in self.records.items()
                if (group is None or g == group) and (collective is None or c == collective)
            ),
            Fraction(0),
        )

    def merge(self, other: TrafficCounter) -> None:
        for key, r in other.records.items():
            mine = self.records.setdefault(key, TrafficRecord())
            mine.calls += r.calls
            mine.bytes_sent += r.bytes_sent
            mine.bytes_received += r.bytes_received
            mine.payload_bytes += r.payload_bytes
            for dtype, calls in r.dtypes.items():
                mine.dtypes[dtype] = mine.dtypes.get(dtype, 0) + calls

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"group": g, "collective": c, "calls": r.calls, "bytes_sent": float(r.bytes_sent),
             "bytes_received": float(r.bytes_received), "payload_bytes": r.payload_bytes}
            for (g, c), r in sorted(self.records.items())
        ]


@runtime_checkable
class Communicator(Protocol):
    """What the engine may ask of the other ranks. Arrays are the backend's own (numpy or torch).

    Semantics (identical on every backend):

    - ``all_reduce(x, op)``: every rank gets the elementwise reduction (``sum``, ``avg``, ``max``)
      of all ranks' ``x``. Returns a new array; ``x`` is not modified.
    - ``reduce_scatter(x, op)``: ``x`` is 1-D with ``len(x) % world_size == 0``; rank ``r`` gets the
      reduction of chunk ``r`` (``x[r*c:(r+1)*c]``, ``c = len(x) // world_size``). ``x`` is not
      modified, unless the caller passes ``donate=True`` (it never reads ``x`` again): a backend may
      then use ``x`` as scratch space and return a view into it, saving a copy of the whole input.
    - ``all_gather(x)``: every rank contributes an equally sized 1-D ``x``; all get the
      concatenation in rank order.
    - ``broadcast(x, root)``: every rank gets root's ``x`` (same shape/dtype on every rank).
    - ``barrier()``; ``split(color, key)`` -> the sub-communicator of the ranks with the same
      ``color`` (ordered by ``key``, then by rank), like ``MPI_Comm_split``.
    - ``group_name``: a stable name for traffic accounting (``world``, ``shard[0]``, ``replicate[1]``).
    - ``global_ranks``: the world ranks of this group's members, in group-rank order.
    - A communicator returned by ``split`` records into its parent's ``traffic`` counter (one
      counter per rank), under its own ``group_name``.
    - Reductions are applied in rank order where the backend allows it (simulator: always).
    - Every collective has a timeout; a rank that never arrives raises ``CollectiveTimeout``.
    """

    rank: int
    world_size: int
    group_name: str
    global_ranks: tuple[int, ...]
    traffic: TrafficCounter

    def all_reduce(self, x: Any, op: str = "sum") -> Any: ...
    def reduce_scatter(self, x: Any, op: str = "sum", *, donate: bool = False) -> Any: ...
    def all_gather(self, x: Any) -> Any: ...
    def broadcast(self, x: Any, root: int = 0) -> Any: ...
    def barrier(self) -> None: ...
    def split(self, color: int, key: int | None = None, name: str | None = None) -> Communicator: ...
