"""Small helpers shared by the built-in partitioners (validation, per-tensor bookkeeping)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import ConfigError, require_positive_int
from ..values.intervals import Interval, merge_adjacent
from ..values.layout import ParamLayout
from .base import RankShard, ShardPlan, ShardTable

#: The largest shard group a built-in partitioner splits over. A ShardPlan holds its shards as numpy
#: arrays (:class:`ShardTable`, a few tens of bytes per rank): 2^20 ranks are built and checked
#: against C-ZERO-001 in well under a second and about 100 MB on two cores; every step past it is
#: linear, but 2^30 ranks would need tens of GB, so larger worlds are refused up front.
MAX_WORLD_SIZE = 2**20
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
            f"at most {MAX_WORLD_SIZE:,} (2^20) ranks per shard group: a shard plan holds every rank's "
            "shard in arrays, well under a second at 2^20 ranks; larger groups take tens of GB",
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
    """Assemble a ShardPlan; each rank's real intervals are sorted and touching ones joined.

    The shards are held as a :class:`ShardTable` (arrays) unless a value does not fit in int64.
    """
    merged = [merge_adjacent(per_rank[rank]) for rank in range(world_size)]
    table = ShardTable.from_lists(merged, padding)
    shards = table if table is not None else tuple(
        RankShard(rank, merged[rank], int(padding[rank])) for rank in range(world_size)
    )
    return ShardPlan(name, world_size, total, shards, int(balance_bound), notes, dict(meta))


def make_flat_plan(
    name: str,
    total: int,
    starts: np.ndarray,
    ends: np.ndarray,
    padding: np.ndarray,
    balance_bound: int,
    notes: str,
    **meta: Any,
) -> ShardPlan:
    """A ShardPlan where rank ``r`` owns the one interval ``[starts[r], ends[r])`` (none when empty).

    Array arithmetic only: a plan of 2^20 ranks is built in milliseconds. ``total`` must be below
    :data:`ShardTable.MAX_VALUE` (callers fall back to :func:`make_plan` otherwise).
    """
    ws = len(starts)
    keep = ends > starts
    first = np.zeros(ws + 1, dtype=np.int64)
    np.cumsum(keep, out=first[1:])
    table = ShardTable(first, starts[keep], ends[keep], padding)
    return ShardPlan(name, ws, total, table, int(balance_bound), notes, dict(meta))
