"""StatePlan: for (layout, strategy, partitioner, topology), what every rank holds.

Params, gradients and optimizer state are each either replicated (the whole flat space) or the
rank's shard of its shard group's ShardPlan. This is the plan C-ZERO-004 compares the engine's live
arrays against, and the element counts the memory model turns into bytes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, require_rank
from .layout import ParamLayout
from .partition import MAX_WORLD_SIZE, RankShard, ShardPlan, get_partitioner
from .partition.base import RegisteredPartitioner
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


@dataclass(frozen=True)
class StatePlan:
    layout: ParamLayout
    strategy: ShardingStrategy
    topology: Topology
    shard_plan: ShardPlan  # the partition of one shard group (size = strategy.shard_group_size)
    ranks: tuple[RankState, ...]

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

    At most :data:`MAX_WORLD_SIZE` ranks (ConfigError stating the limit): the plan holds a RankState
    per rank.
    """
    if topology.world_size > MAX_WORLD_SIZE:
        raise ConfigError(
            "world_size", topology.world_size,
            f"at most {MAX_WORLD_SIZE:,} (2^16) ranks: a plan holds every rank's params, grads and optimizer "
            "shards as Python objects, a few seconds at 2^16 ranks; larger worlds take minutes and GBs",
        )
    k = strategy.shard_group_size(topology.world_size)
    shard_plan = get_partitioner(partitioner)(layout, k)
    full = RankShard(-1, ((0, layout.total_numel),) if layout.total_numel else (), 0)
    flags = (strategy.shards_params, strategy.shards_grads, strategy.shards_optimizer)
    ranks = []
    for rank in range(topology.world_size):
        group, local = divmod(rank, k)
        own = shard_plan.shard(local)
        held = [own if sharded else full for sharded in flags]
        ranks.append(RankState(rank, group, local, *(RankShard(rank, s.intervals, s.padding) for s in held)))
    return StatePlan(layout, strategy, topology, shard_plan, tuple(ranks))


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
