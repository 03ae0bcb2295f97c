"""ShardPlan: which intervals of the flat parameter space each rank owns, with padding kept apart.

Every partitioner (the seed's, DeepSpeed's, FSDP's, ZeroRedundancyOptimizer's, a user's) produces a
ShardPlan; C-ZERO-001 is checked on it by interval arithmetic, never by touching every element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import ConfigError
from ..layout import ParamLayout

Interval = tuple[int, int]  # half-open [start, end) in the flat index space


@dataclass(frozen=True)
class RankShard:
    """What one rank owns: real-data intervals of the flat space, plus padding elements it stores.

    ``padding`` counts elements the rank allocates that are not model data (alignment, uneven
    splits). They must never be counted as data (C-ZERO-001) nor leak into values or norms.
    """

    rank: int
    intervals: tuple[Interval, ...]
    padding: int = 0

    @property
    def numel(self) -> int:
        """Real (non-padding) elements owned."""
        return sum(e - s for s, e in self.intervals)

    @property
    def padded_numel(self) -> int:
        """Elements this rank stores for its shard: real data plus padding."""
        return self.numel + self.padding

    def owns(self, index: int) -> bool:
        return any(s <= index < e for s, e in self.intervals)


@dataclass(frozen=True)
class ShardPlan:
    """A partition of ``[0, total)`` over ``world_size`` ranks, as produced by ``partitioner``.

    ``balance_bound`` is the partitioner's documented bound on (max - min) real elements per rank;
    C-ZERO-001's balance clause checks against it. ``notes`` says where the bound comes from.
    """

    partitioner: str
    world_size: int
    total: int
    shards: tuple[RankShard, ...]
    balance_bound: int
    notes: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def shard(self, rank: int) -> RankShard:
        if not 0 <= rank < self.world_size:
            raise ConfigError("rank", rank, f"must be in [0, {self.world_size})")
        return self.shards[rank]

    @property
    def total_padding(self) -> int:
        return sum(s.padding for s in self.shards)

    def max_padded_numel(self) -> int:
        return max((s.padded_numel for s in self.shards), default=0)

    def to_json(self, max_intervals_per_rank: int | None = None) -> dict[str, Any]:
        def ivs(s: RankShard) -> list[list[int]]:
            items = s.intervals if max_intervals_per_rank is None else s.intervals[:max_intervals_per_rank]
            return [[a, b] for a, b in items]

        return {
            "partitioner": self.partitioner,
            "world_size": self.world_size,
            "total": self.total,
            "balance_bound": self.balance_bound,
            "notes": self.notes,
            "shards": [
                {"rank": s.rank, "numel": s.numel, "padding": s.padding, "num_intervals": len(s.intervals),
                 "intervals": ivs(s)}
                for s in self.shards
            ],
        }


class Partitioner(Protocol):
    """A rule that splits a layout's flat space over ``world_size`` ranks."""

    name: str
    description: str

    def __call__(self, layout: ParamLayout, world_size: int) -> ShardPlan: ...


@dataclass(frozen=True)
class RegisteredPartitioner:
    name: str
    description: str
    fn: Callable[[ParamLayout, int], ShardPlan]

    def __call__(self, layout: ParamLayout, world_size: int) -> ShardPlan:
        return self.fn(layout, world_size)


PARTITIONERS: dict[str, RegisteredPartitioner] = {}


def register_partitioner(name: str, description: str):
    """Decorator: make ``fn(layout, world_size) -> ShardPlan`` selectable as ``--partitioner name``."""

    def deco(fn: Callable[[ParamLayout, int], ShardPlan]) -> Callable[[ParamLayout, int], ShardPlan]:
        PARTITIONERS[name] = RegisteredPartitioner(name, description, fn)
        return fn

    return deco


def get_partitioner(name: str | RegisteredPartitioner) -> RegisteredPartitioner:
    """The registered rule called ``name`` (a rule passed in is returned as it is)."""
    if isinstance(name, RegisteredPartitioner):
        return name
    from . import _load_builtin  # noqa: F401  (registers the built-in partitioners)

    if not isinstance(name, str):
        raise ConfigError("partitioner", name, f"must be a name; known: {', '.join(sorted(PARTITIONERS))}")
    try:
        return PARTITIONERS[name]
    except KeyError:
        raise ConfigError(
            "partitioner", name, f"unknown partitioner; known: {', '.join(sorted(PARTITIONERS))}"
        ) from None
