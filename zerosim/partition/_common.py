"""Small helpers shared by the built-in partitioners (validation, per-tensor bookkeeping)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..intervals import Interval, merge_adjacent
from ..layout import ParamLayout
from .base import RankShard, ShardPlan

#: The largest shard group a built-in partitioner splits over. A ShardPlan holds one Python object
#: per rank (and C-ZERO-001 sorts every interval): 2^16 ranks take a few seconds and tens of MB on
#: two cores; 2^20 took tens of seconds and 2^30 would need hundreds of GB.
MAX_WORLD_SIZE = 2**16
#: The most flat intervals one ShardPlan may hold (per-tensor rules make up to tensors x ranks):
#: 2^20 intervals are built and checked in a few seconds; past it time and memory grow without bound.
MAX_INTERVALS = 2**20


def check_args(layout: Any, world_size: Any) -> int:
    """Validate a partitioner's arguments at the boundary; return ``world_size``.

    ``world_size`` above :data:`MAX_WORLD_SIZE` is refused up front (ConfigError stating the limit).
    """
    if not isinstance(layout, ParamLayout):
        raise ConfigError("layout", type(layout).__name__, "must be a zerosim.ParamLayout")
    ws = require_positive_int("world_size", world_size)
    if ws > MAX_WORLD_SIZE:
        raise ConfigError(
            "world_size", ws,
            f"at most {MAX_WORLD_SIZE:,} (2^16) ranks per shard group: a shard plan holds every rank's "
            "shard as a Python object, a few seconds at 2^16 ranks; larger groups take minutes and GBs",
        )
    return ws


def check_interval_count(partitioner: str, count: int, world_size: int) -> None:
    """ConfigError when a plan would hold more than :data:`MAX_INTERVALS` flat intervals."""
    if count > MAX_INTERVALS:
        raise ConfigError(
            "world_size", world_size,
            f"{partitioner} would cut this layout into {count:,} intervals at this world size, above the "
            f"limit of {MAX_INTERVALS:,} (2^20) that keeps building and checking a plan within seconds; "
            "use fewer ranks or a flat partitioner (seed, deepspeed)",
        )


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
