"""Flat units: how a partitioner's plan becomes the padded buffers the collectives move.

A *unit* is what one collective moves at once: one block under FULL_SHARD / HYBRID_SHARD (FSDP's
flat parameter per wrapped module, gathered just before it is used), or the whole model under
NO_SHARD / ZeRO-1 / ZeRO-2 (DeepSpeed's flat partition of a param group).

Inside a unit, the elements are the unit's tensors in flat order (``unit space``, ``n`` elements).
The partitioner's plan says which flat intervals each rank of the shard group owns; intersected
with the unit they give each rank ``owned[j]`` unit elements. The collectives need equal sizes, so
every rank's chunk is ``c = max_j owned[j]`` elements and the *packed* buffer is ``k * c`` long,
rank-major: rank ``j``'s owned elements (in unit order) at ``[j*c, j*c + owned[j])``, then padding.

* For the padded-even partitioners (``fsdp`` flat chunks, ``deepspeed`` ZeRO-1/2, ``deepspeed-zero3``
  and ``seed`` on one rank, ...) the packing is often the *identity*: rank ``j`` owns exactly
  ``[j*c, (j+1)*c)`` of the unit, so the gathered buffer *is* the unit, zero copies.
* Any other plan (per-tensor padding, whole-tensor or whole-block ownership) is packed with a
  handful of slice copies (``segments``), never element by element.

Padding elements are real memory and real traffic (the comm model counts them) but never data:
they are zero, they are excluded from norms, and C-ZERO-004 compares the *owned intervals* to the
plan exactly and the padding to ``c - owned[j]``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..errors import ConfigError
from ..partition import ShardPlan, get_partitioner
from ..partition.base import RegisteredPartitioner
from .intervals import Interval
from .layout import ParamLayout
from .strategy import ShardingStrategy

SHORT_PIECE = 256
"""Mean piece length (elements) below which a unit is packed with one fancy-indexed copy."""


@dataclass(frozen=True)
class Segment:
    """A run of ``length`` elements at ``unit_start`` in unit space and ``packed_start`` in packed space."""

    unit_start: int
    packed_start: int
    length: int


@dataclass(frozen=True)
class FlatUnit:
    """One unit: its tensors, where they lie in the flat space, and the packing for a shard group of ``k``."""

    index: int
    name: str
    tensor_names: tuple[str, ...]
    tensor_shapes: tuple[tuple[int, ...], ...]
    tensor_offsets: tuple[int, ...]          # unit-space start of each tensor
    global_pieces: tuple[tuple[int, int, int], ...]  # (global_start, global_end, unit_start), unit order
    numel: int
    k: int
    chunk: int                               # c: elements per rank in the packed buffer
    owned: tuple[tuple[Interval, ...], ...]  # per local rank: owned unit-space intervals, in unit order
    segments: tuple[tuple[Segment, ...], ...]  # per local rank: unit <-> packed copies

    @property
    def packed_numel(self) -> int:
        """``k * c``: the length every reduce-scatter input and all-gather output of this unit has."""
        return self.k * self.chunk

    def owned_numel(self, local_rank: int) -> int:
        return sum(e - s for s, e in self.owned[local_rank])

    def padding(self, local_rank: int) -> int:
        return self.chunk - self.owned_numel(local_rank)

    @cached_property
    def is_identity(self) -> bool:
        """True when packed position == unit position for every owned element (no copies needed)."""
        for j, segs in enumerate(self.segments):
            for s in segs:
                if s.unit_start != s.packed_start:
                    return False
            if self.owned_numel(j) != max(0, min(self.chunk, self.numel - j * self.chunk)):
                return False
        return True

    @cached_property
    def tensor_pieces(self) -> tuple[tuple[int, int, int, int], ...]:
        """``(tensor position in the unit, start inside the tensor, packed start, length)`` for every run
        of owned elements, cut at tensor boundaries: one copy per piece packs or unpacks the unit."""
        out = []
        for segs in self.segments:
            for s in segs:
                pos, end, packed = s.unit_start, s.unit_start + s.length, s.packed_start
                while pos < end:
                    i = bisect.bisect_right(self.tensor_offsets, pos) - 1
                    t_end = self.tensor_offsets[i + 1] if i + 1 < len(self.tensor_offsets) else self.numel
                    n = min(end, t_end) - pos
                    if n > 0:
                        out.append((i, pos - self.tensor_offsets[i], packed, n))
                    pos += max(n, 0) or 1
                    packed += max(n, 0)
        return tuple(out)

    @cached_property
    def short_pieces(self) -> bool:
        """True when the unit's (rank, segment) pieces average fewer than :data:`SHORT_PIECE` elements:
        one fancy-indexed copy (:meth:`pack_indices`) then beats a slice copy per piece, whose fixed
        cost dominates; for longer pieces slice copies run at memory bandwidth and win."""
        pieces = sum(1 for per_rank in self.segments for s in per_rank if s.length > 0)
        return pieces > 0 and self.numel < SHORT_PIECE * pieces

    def pack_indices(self, xp: Any) -> tuple[Any, Any]:
        """``(unit positions, packed positions)`` of every owned element as ``xp`` index arrays, in
        segment order (rank by rank): one fancy-indexed copy packs or unpacks the whole unit, whatever
        the number of ranks. Built once per unit and array namespace."""
        cache = self.__dict__.setdefault("_pack_indices", {})
        key = repr(xp)
        if key not in cache:
            segs = [s for per_rank in self.segments for s in per_rank if s.length > 0]
            unit = [xp.arange(s.unit_start, s.unit_start + s.length, dtype=xp.int64) for s in segs]
            packed = [xp.arange(s.packed_start, s.packed_start + s.length, dtype=xp.int64) for s in segs]
            empty = xp.arange(0, dtype=xp.int64)
            cache[key] = (xp.concat(unit) if unit else empty, xp.concat(packed) if packed else empty)
        return cache[key]

    @cached_property
    def padding_runs(self) -> tuple[tuple[int, int], ...]:
        """``(packed start, length)`` of every rank's padding in the packed buffer."""
        return tuple((j * self.chunk + self.owned_numel(j), self.padding(j))
                     for j in range(self.k) if self.padding(j) > 0)

    def to_global(self, unit_start: int, length: int) -> list[tuple[int, int]]:
        """Global flat ``(start, end)`` pieces of the unit-space run ``[unit_start, unit_start + length)``."""
        out: list[tuple[int, int]] = []
        lo, hi = unit_start, unit_start + length
        for g0, g1, u0 in self.global_pieces:
            u1 = u0 + (g1 - g0)
            a, b = max(lo, u0), min(hi, u1)
            if b > a:
                out.append((g0 + a - u0, g0 + b - u0))
        return out

    def owned_global(self, local_rank: int) -> list[tuple[int, int]]:
        """The rank's owned elements of this unit as global flat intervals (in unit order)."""
        out: list[tuple[int, int]] = []
        for s, e in self.owned[local_rank]:
            out += self.to_global(s, e - s)
        return out


@dataclass(frozen=True)
class UnitPlan:
    """All units of a run for one shard group size, plus the shard-storage offsets of each unit.

    Every rank stores one flat shard of ``shard_numel = sum(c_u)`` elements per kind of sharded
    state; unit ``u`` occupies ``[shard_offsets[u], shard_offsets[u] + c_u)`` of it.
    """

    layout: ParamLayout
    partitioner: str
    k: int
    per_block: bool
    units: tuple[FlatUnit, ...]
    shard_plan: ShardPlan

    @cached_property
    def shard_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for u in self.units:
            out.append(acc)
            acc += u.chunk
        return tuple(out)

    @property
    def shard_numel(self) -> int:
        return sum(u.chunk for u in self.units)

    @property
    def packed_numel(self) -> int:
        """Sum over units of ``k * c_u``: the padded size of the model as the collectives see it."""
        return sum(u.packed_numel for u in self.units)

    def unit_of_block(self, block: str) -> FlatUnit:
        for u in self.units:
            if u.name == block:
                return u
        raise ConfigError("block", block, "no such unit")

    def owned_global(self, local_rank: int) -> list[tuple[int, int, int]]:
        """``(global_start, global_end, shard_position)`` of every real element the rank holds, in shard
        order."""
        out: list[tuple[int, int, int]] = []
        for u, off in zip(self.units, self.shard_offsets, strict=True):
            pos = off
            for s, e in u.owned[local_rank]:
                for g0, g1 in u.to_global(s, e - s):
                    out.append((g0, g1, pos))
                    pos += g1 - g0
        return out

    def padding(self, local_rank: int) -> int:
        return sum(u.padding(local_rank) for u in self.units)


def units_per_block(strategy: ShardingStrategy) -> bool:
    """FULL_SHARD and HYBRID_SHARD gather block by block; every other strategy moves one flat unit."""
    return strategy.shards_params


def unit_tensor_groups(layout: ParamLayout, strategy: ShardingStrategy) -> list[tuple[str, tuple[int, ...]]]:
    """(unit name, tensor indices) of every unit: one per block, or one "model" unit."""
    if units_per_block(strategy):
        return [(b.name, b.tensor_indices) for b in layout.blocks]
    return [("model", tuple(range(len(layout.tensors))))]


def build_unit_plan(
    layout: ParamLayout, strategy: ShardingStrategy, partitioner: str | RegisteredPartitioner, world_size: int
) -> UnitPlan:
    """Units for ``strategy`` with the partitioner's plan over one shard group of ``k`` ranks."""
    k = strategy.shard_group_size(world_size)
    rule = get_partitioner(partitioner)
    plan = rule(layout, k)
    per_block = units_per_block(strategy)
    offsets = layout.offsets
    groups = unit_tensor_groups(layout, strategy)
    rank_intervals = [sorted(plan.shard(j).intervals) for j in range(k)]
    rank_ends = [[e for _, e in ivs] for ivs in rank_intervals]
    units = []
    for idx, (name, tids) in enumerate(groups):
        tensors = [layout.tensors[i] for i in tids]
        t_offsets: list[int] = []
        pieces: list[tuple[int, int, int]] = []  # (global start, global end, unit offset)
        acc = 0
        for i, t in zip(tids, tensors, strict=True):
            t_offsets.append(acc)
            if t.numel:
                g0 = offsets[i]
                if pieces and pieces[-1][1] == g0:
                    pieces[-1] = (pieces[-1][0], g0 + t.numel, pieces[-1][2])
                else:
                    pieces.append((g0, g0 + t.numel, acc))
            acc += t.numel
        numel = acc
        owned = tuple(_owned_in_unit(rank_intervals[j], rank_ends[j], pieces) for j in range(k))
        counts = [sum(e - s for s, e in o) for o in owned]
        chunk = max(counts, default=0)
        segments = []
        for j in range(k):
            pos, segs = j * chunk, []
            for s, e in owned[j]:
                segs.append(Segment(s, pos, e - s))
                pos += e - s
            segments.append(tuple(segs))
        units.append(FlatUnit(idx, name, tuple(t.name for t in tensors), tuple(t.shape for t in tensors),
                              tuple(t_offsets), tuple(pieces), numel, k, chunk, owned, tuple(segments)))
    return UnitPlan(layout, rule.name, k, per_block, tuple(u for u in units if u.numel), plan)


def _owned_in_unit(intervals: list[Interval], ends: list[int],
                   pieces: list[tuple[int, int, int]]) -> tuple[Interval, ...]:
    """Intersect a rank's sorted global intervals with the unit's pieces; unit-space, unit order, joined."""
    out: list[Interval] = []
    for g0, g1, u0 in pieces:  # pieces are in unit order and increasing global order within a unit
        for i in range(bisect.bisect_right(ends, g0), len(intervals)):
            s, e = intervals[i]
            if s >= g1:
                break
            a, b = max(s, g0) - g0 + u0, min(e, g1) - g0 + u0
            if out and out[-1][1] == a:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
    return tuple(out)
