"""Small helpers shared by the built-in partitioners (validation, per-tensor bookkeeping)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..intervals import Interval, merge_adjacent
from ..layout import ParamLayout
from .base import RankShard, ShardPlan


def check_args(layout: Any, world_size: Any) -> int:
    """Validate a partitioner's arguments at the boundary; return ``world_size``."""
    if not isinstance(layout, ParamLayout):
        raise ConfigError("layout", type(layout).__name__, "must be a zerosim.ParamLayout")
    return require_positive_int("world_size", world_size)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def make_plan(
    name: str,
    world_size: int,
    total: int,
    per_rank: Sequence[Sequence[Interval]],
    padding: Sequence[int],
    balance_bound: int,
    notes: str,
    **meta: Any,
) -> ShardPlan:
    """Assemble a ShardPlan; each rank's real intervals are sorted and touching ones joined."""
    shards = tuple(
        RankShard(rank, merge_adjacent(per_rank[rank]), int(padding[rank])) for rank in range(world_size)
    )
    return ShardPlan(name, world_size, total, shards, int(balance_bound), notes, dict(meta))
