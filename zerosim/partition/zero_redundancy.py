"""torch ``ZeroRedundancyOptimizer`` rule: whole tensors, largest first, to the least-loaded rank.

Parameters are sorted by numel, descending (a stable sort: equal sizes keep layout order); each goes
to the rank with the smallest running total (lowest rank on ties). Tensors are never split, so
there is no padding, and a rank may own nothing when there are fewer tensors than ranks.
Serves C-ZERO-001.
"""

from __future__ import annotations

import heapq

from ..values.intervals import Interval
from ..values.layout import ParamLayout
from ._common import check_args, make_plan
from .base import ShardPlan, register_partitioner


def greedy_assignment(numels: list[int], world_size: int) -> list[int]:
    """Owner rank of each tensor under the sorted-greedy rule."""
    order = sorted(range(len(numels)), key=lambda i: numels[i], reverse=True)
    heap = [(0, r) for r in range(world_size)]
    owners = [0] * len(numels)
    for i in order:
        size, rank = heapq.heappop(heap)
        owners[i] = rank
        heapq.heappush(heap, (size + numels[i], rank))
    return owners


@register_partitioner("zero-redundancy", "torch ZeroRedundancyOptimizer: whole tensors, sorted-greedy")
def zero_redundancy_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """ZeroRedundancyOptimizer's partition.

    balance_bound = the largest tensor's numel: when the most-loaded rank received its last
    tensor it was the least loaded, so it exceeds every other rank by at most that tensor.
    """
    ws = check_args(layout, world_size)
    numels = layout.numels()
    owners = greedy_assignment(numels, ws)
    per_rank: list[list[Interval]] = [[] for _ in range(ws)]
    for i, (offset, n) in enumerate(zip(layout.offsets, numels, strict=True)):
        per_rank[owners[i]].append((offset, offset + n))
    return make_plan(
        "zero-redundancy", ws, layout.total_numel, per_rank, [0] * ws, max(numels, default=0),
        notes="whole tensors, sorted by numel descending, each to the least-loaded rank",
        tensor_owners=owners,
    )
