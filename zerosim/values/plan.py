"""StatePlan: for (layout, strategy, partitioner, topology), what every rank holds.

Params, gradients and optimizer state are each either replicated (the whole flat space) or the
rank's shard of its shard group's ShardPlan. This is the plan C-ZERO-004 compares the engine's live
arrays against, and the element counts the memory model turns into bytes.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from ..errors import ConfigError, require_rank
from ..partition import MAX_WORLD_SIZE, RankShard, ShardPlan, get_partitioner
from ..partition.base import RegisteredPartitioner
from .layout import ParamLayout
from .strategy import ShardingStrategy, Topology

STATE_KINDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class RankState:
    """What one rank holds of each kind of state, as flat-space shards."""

    rank: int
    shard_group: int
    local_rank: int
    params: RankShard
    grads: RankShard
    optimizer: RankShard

    def holding(self, kind: str) -> RankShard:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}[kind]


class RankStates(Sequence[RankState]):
    """Every rank's RankState, derived on demand from one shard group's ShardPlan.

    Rank ``r`` is local rank ``r % k`` of shard group ``r // k``; it holds that local rank's shard of
    ``shard_plan`` for each sharded kind of state and ``[0, total)`` for each replicated one. Nothing
    is stored per rank until someone asks for that rank (then it is kept, so asking twice gives the
    same object): a plan of 2^20 ranks costs what its ShardPlan costs. C-ZERO-001 uses
    :meth:`derived` to know every rank's holding follows from ``shard_plan`` and ``flags``.
    """

    def __init__(self, shard_plan: ShardPlan, world_size: int, total: int, flags: tuple[bool, bool, bool]):
        self.shard_plan = shard_plan
        self.world_size = world_size
        self.flags = flags
        self.full = RankShard(-1, ((0, total),) if total else (), 0)
        self._cache: dict[int, RankState] = {}

    def derived(self, shard_plan: ShardPlan) -> bool:
        return self.shard_plan is shard_plan

    def __len__(self) -> int:
        return self.world_size

    def _state(self, rank: int) -> RankState:
        state = self._cache.get(rank)
        if state is None:
            group, local = divmod(rank, self.shard_plan.world_size)
            own = self.shard_plan.shard(local)
            held = [own if sharded else self.full for sharded in self.flags]
            state = self._cache[rank] = RankState(
                rank, group, local, *(RankShard(rank, s.intervals, s.padding) for s in held))
        return state

    @overload
    def __getitem__(self, index: int) -> RankState: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RankState, ...]: ...

    def __getitem__(self, index: int | slice) -> RankState | tuple[RankState, ...]:
        if isinstance(index, slice):
            return tuple(self._state(r) for r in range(*index.indices(self.world_size)))
        r = index + self.world_size if index < 0 else index
        if not 0 <= r < self.world_size:
            raise IndexError(index)
        return self._state(r)

    def __iter__(self) -> Iterator[RankState]:
        return (self._state(r) for r in range(self.world_size))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankStates | tuple | list):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RankStates({self.world_size} ranks over a shard group of {self.shard_plan.world_size})"


@dataclass(frozen=True)
class StatePlan:
    layout: ParamLayout
    strategy: ShardingStrategy
    topology: Topology
    shard_plan: ShardPlan  # the partition of one shard group (size = strategy.shard_group_size)
    ranks: tuple[RankState, ...] | RankStates

    def rank(self, rank: int) -> RankState:
        require_rank(rank, self.topology.world_size)
        return self.ranks[rank]

    def to_json(self) -> dict[str, Any]:
        out = []
        for r in self.ranks:
            row: dict[str, Any] = {"rank": r.rank, "shard_group": r.shard_group, "local_rank": r.local_rank}
            for kind in STATE_KINDS:
                s = r.holding(kind)
                row[kind] = {"numel": s.numel, "padding": s.padding,
                             "bytes": bytes_in(self.layout, s.intervals), "num_intervals": len(s.intervals)}
            out.append(row)
        return {
            "model": self.layout.name,
            "total_numel": self.layout.total_numel,
            "strategy": self.strategy.name,
            "partitioner": self.shard_plan.partitioner,
            "world_size": self.topology.world_size,
            "ranks_per_node": self.topology.ranks_per_node,
            "shard_group_size": self.shard_plan.world_size,
            "ranks": out,
        }


def build_plan(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    partitioner: str | RegisteredPartitioner,
    topology: Topology,
) -> StatePlan:
    """Compose the partitioner's ShardPlan over each shard group with the strategy's choices.

    At most :data:`MAX_WORLD_SIZE` ranks (ConfigError stating the limit). Every rank's RankState is
    derived from the one ShardPlan on demand (:class:`RankStates`), so a plan of 2^20 ranks holds
    arrays, not a million objects.
    """
    if topology.world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            "world_size", topology.world_size,
            f"at most {MAX_WORLD_SIZE:,} (2^20) ranks: a plan holds every rank's shard in arrays, well "
            "under a second at 2^20 ranks; larger worlds take tens of GB",
        )
    k = strategy.shard_group_size(topology.world_size)
    shard_plan = get_partitioner(partitioner)(layout, k)
    flags = (strategy.shards_params, strategy.shards_grads, strategy.shards_optimizer)
    ranks = RankStates(shard_plan, topology.world_size, layout.total_numel, flags)
    return StatePlan(layout, strategy, topology, shard_plan, ranks)


@dataclass(frozen=True)
class ShardColumns:
    """Per-local-rank numbers of one ShardPlan as arrays: real elements, padding, bytes, intervals."""

    numel: np.ndarray
    padding: np.ndarray
    nbytes: np.ndarray
    num_intervals: np.ndarray


def shard_columns(layout: ParamLayout, shard_plan: ShardPlan) -> ShardColumns:
    """Real elements, padding, bytes (at each tensor's dtype) and interval count of every local rank.

    Array arithmetic on a :class:`ShardTable` (bytes from cumulative bytes at tensor boundaries);
    per shard otherwise.
    """
    table = shard_plan.table
    if table is None:
        shards = shard_plan.shards
        return ShardColumns(*(np.array(v, dtype=object) for v in (
            [s.numel for s in shards], [s.padding for s in shards],
            [bytes_in(layout, s.intervals) for s in shards], [len(s.intervals) for s in shards])))
    cum = np.zeros(len(table.starts) + 1, dtype=np.int64)
    np.cumsum(bytes_before(layout, table.ends) - bytes_before(layout, table.starts), out=cum[1:])
    nbytes = cum[table.first[1:]] - cum[table.first[:-1]]
    return ShardColumns(table.real_numel(), table.padding, nbytes, table.interval_counts())


def bytes_before(layout: ParamLayout, points: np.ndarray) -> np.ndarray:
    """Bytes of the flat range ``[0, p)`` for every ``p`` in ``points`` (each tensor at its dtype)."""
    from .dtypes import itemsize

    offsets = np.array(layout.offsets, dtype=np.int64)
    sizes = np.array([itemsize(t.dtype) for t in layout.tensors], dtype=np.int64)
    if len(offsets) == 0:
        return np.zeros(len(points), dtype=np.int64)
    numels = np.array(layout.numels(), dtype=np.int64)
    start_bytes = np.concatenate(([0], np.cumsum(numels * sizes)[:-1]))
    i = np.maximum(np.searchsorted(offsets, points, side="right") - 1, 0)
    return start_bytes[i] + np.minimum(points - offsets[i], numels[i]) * sizes[i]


def bytes_in(layout: ParamLayout, intervals: tuple[tuple[int, int], ...] | list[tuple[int, int]],
             dtype: str | None = None) -> int:
    """Bytes of the flat-space ``intervals`` at each tensor's own dtype (or at ``dtype`` if given).

    O(intervals * log(tensors) + overlapping tensors): never touches individual elements.
    """
    from .dtypes import itemsize

    if dtype is not None:
        return itemsize(dtype) * sum(e - s for s, e in intervals)
    offsets = layout.offsets
    total = 0
    for s, e in intervals:
        i = max(bisect.bisect_right(offsets, s) - 1, 0)
        while s < e and i < len(layout.tensors):
            t_start = offsets[i]
            t_end = t_start + layout.tensors[i].numel
            lo, hi = max(s, t_start), min(e, t_end)
            if hi > lo:
                total += (hi - lo) * itemsize(layout.tensors[i].dtype)
            if t_end >= e:
                break
            i += 1
    return total
