"""ShardPlan: which intervals of the flat parameter space each rank owns, with padding kept apart.

Every partitioner (the seed's, DeepSpeed's, FSDP's, ZeroRedundancyOptimizer's, a user's) produces a
ShardPlan; C-ZERO-001 is checked on it by interval arithmetic, never by touching every element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import numpy as np

from ..errors import ConfigError
from ..values.layout import ParamLayout

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


class ShardTable(Sequence[RankShard]):
    """Every rank's shard as numpy arrays: a read-only sequence of :class:`RankShard`.

    Rank ``r`` owns the intervals ``[starts[i], ends[i])`` for ``i`` in ``[first[r], first[r + 1])``
    (sorted by start, empty ones dropped, touching ones joined) and stores ``padding[r]`` padding
    elements. A plan of 2^20 ranks is a few arrays, not a million Python objects; C-ZERO-001 checks it
    with array arithmetic (:func:`zerosim.checks.partition.check_partition_plan`) and a RankShard is
    made only for the ranks someone asks for (and kept, so asking twice gives the same object).
    Values must fit in int64 (:data:`MAX_VALUE`): :meth:`from_lists` leaves larger ones to tuples.
    """

    MAX_VALUE = 2**62

    def __init__(self, first: np.ndarray, starts: np.ndarray, ends: np.ndarray, padding: np.ndarray):
        self.first = np.asarray(first, dtype=np.int64)
        self.starts = np.asarray(starts, dtype=np.int64)
        self.ends = np.asarray(ends, dtype=np.int64)
        self.padding = np.asarray(padding, dtype=np.int64)
        self._cache: dict[int, RankShard] = {}

    @classmethod
    def from_lists(cls, per_rank: Sequence[Sequence[Interval]], padding: Sequence[int]) -> ShardTable | None:
        """The table of already merged per-rank intervals; None when a value does not fit in int64."""
        counts = np.fromiter((len(ivs) for ivs in per_rank), dtype=np.int64, count=len(per_rank))
        first = np.zeros(len(per_rank) + 1, dtype=np.int64)
        np.cumsum(counts, out=first[1:])
        flat = [v for ivs in per_rank for iv in ivs for v in iv]
        pads = list(padding)
        if any(not -cls.MAX_VALUE < v < cls.MAX_VALUE for v in (*flat, *pads)):
            return None
        pairs = np.array(flat, dtype=np.int64).reshape(-1, 2)
        return cls(first, pairs[:, 0], pairs[:, 1], np.array(pads, dtype=np.int64))

    @property
    def world_size(self) -> int:
        return len(self.padding)

    def real_numel(self) -> np.ndarray:
        """Real elements per rank (int64)."""
        cum = np.zeros(len(self.starts) + 1, dtype=np.int64)
        np.cumsum(self.ends - self.starts, out=cum[1:])
        return cum[self.first[1:]] - cum[self.first[:-1]]

    def interval_counts(self) -> np.ndarray:
        return np.diff(self.first)

    def owners(self) -> np.ndarray:
        """The rank of every interval, in table order."""
        return np.repeat(np.arange(self.world_size, dtype=np.int64), self.interval_counts())

    def __len__(self) -> int:
        return len(self.padding)

    def _shard(self, rank: int) -> RankShard:
        shard = self._cache.get(rank)
        if shard is None:
            lo, hi = int(self.first[rank]), int(self.first[rank + 1])
            ivs = tuple(zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist(), strict=True))
            shard = self._cache[rank] = RankShard(rank, ivs, int(self.padding[rank]))
        return shard

    @overload
    def __getitem__(self, index: int) -> RankShard: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[RankShard, ...]: ...

    def __getitem__(self, index: int | slice) -> RankShard | tuple[RankShard, ...]:
        if isinstance(index, slice):
            return tuple(self._shard(r) for r in range(*index.indices(len(self))))
        n = len(self)
        r = index + n if index < 0 else index
        if not 0 <= r < n:
            raise IndexError(index)
        return self._shard(r)

    def __iter__(self) -> Iterator[RankShard]:
        return (self._shard(r) for r in range(len(self)))

    def __add__(self, other: Any) -> tuple[RankShard, ...]:
        return tuple(self) + tuple(other)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable):
            pairs = ((self.first, other.first), (self.starts, other.starts), (self.ends, other.ends),
                     (self.padding, other.padding))
            return all(np.array_equal(a, b) for a, b in pairs)
        if isinstance(other, tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ShardTable({len(self)} ranks, {len(self.starts)} intervals)"


@dataclass(frozen=True)
class ShardPlan:
    """A partition of ``[0, total)`` over ``world_size`` ranks, as produced by ``partitioner``.

    ``balance_bound`` is the partitioner's documented bound on (max - min) real elements per rank;
    C-ZERO-001's balance clause checks against it. ``notes`` says where the bound comes from.
    """

    partitioner: str
    world_size: int
    total: int
    shards: tuple[RankShard, ...] | ShardTable
    balance_bound: int
    notes: str = ""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def shard(self, rank: int) -> RankShard:
        if not 0 <= rank < self.world_size:
            raise ConfigError("rank", rank, f"must be in [0, {self.world_size})")
        return self.shards[rank]

    @property
    def table(self) -> ShardTable | None:
        """The shards as arrays when the plan was built as a :class:`ShardTable`, else None."""
        return self.shards if isinstance(self.shards, ShardTable) else None

    @property
    def total_padding(self) -> int:
        if self.table is not None:
            return int(self.table.padding.sum())
        return sum(s.padding for s in self.shards)

    def max_padded_numel(self) -> int:
        if self.table is not None:
            return int((self.table.real_numel() + self.table.padding).max(initial=0))
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
