"""Who writes and who reads which global ranges of a checkpoint, under a plan.

A plan's state is sharded over one shard group of ``k`` ranks and replicated ``r = world / k``
times. Only replica group 0 (world ranks ``0 .. k-1``) writes: one copy of the state, each of those
ranks its own owned global ranges. Every rank reads what it owns under its own plan.
"""

from __future__ import annotations

from ..values.flat_buffers import build_unit_plan
from ..values.intervals import merge_adjacent
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy

Range = tuple[int, int]


def owned_ranges(
    layout: ParamLayout, strategy: ShardingStrategy, partitioner: str, world_size: int, local_rank: int
) -> tuple[Range, ...]:
    """The global ranges shard-group rank ``local_rank`` owns (everything when the optimizer state is
    not sharded), sorted and joined where they touch."""
    total = layout.total_numel
    if not strategy.shards_optimizer:
        return ((0, total),) if total else ()
    plan = build_unit_plan(layout, strategy, partitioner, world_size)
    return merge_adjacent((g0, g1) for g0, g1, _ in plan.owned_global(local_rank))


def writer_ranges(
    layout: ParamLayout, strategy: ShardingStrategy, partitioner: str, world_size: int
) -> list[tuple[int, tuple[Range, ...]]]:
    """``(world rank, ranges)`` of every rank that writes a shard file under the plan: the ranks of
    replica group 0, in rank order (ranks that own nothing write nothing)."""
    k = strategy.shard_group_size(world_size)
    total = layout.total_numel
    if not strategy.shards_optimizer:
        return [(0, ((0, total),))] if total else []
    plan = build_unit_plan(layout, strategy, partitioner, world_size)
    out = []
    for j in range(k):
        ranges = merge_adjacent((g0, g1) for g0, g1, _ in plan.owned_global(j))
        if ranges:
            out.append((j, ranges))
    return out
