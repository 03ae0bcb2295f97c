"""Where each tensor's gradient lives in a rank's full flat gradient (NO_SHARD and ZeRO-1).

A rank that reduces the whole gradient with one all-reduce (NO_SHARD, all-reduce ZeRO-1) keeps it in
one flat buffer of ``total`` elements. The all-reduce adds element to element, so the order of the
elements in that buffer is the engine's to choose:

* **layout order** (NO_SHARD, reduce-scatter ZeRO-1): tensor after tensor, as the parameters are laid
  out. Each tensor's gradient is one range.
* **shard order** (all-reduce ZeRO-1): the elements shard-group rank 0 owns, in the order of its
  packed shard, then rank 1's, and so on, with no padding, as DeepSpeed keeps each rank's gradient
  partition contiguous. Each tensor's gradient is one range per rank that owns part of it, and each
  rank's owned gradient is one range whose position ``i`` is position ``i`` of its master shard:
  the optimizer steps on a view of the buffer, where layout order needs a copy of the owned pieces
  out of it (C-ZERO-002: the same elements, the same arithmetic).

Shard order needs every rank's packed shard to hold its real elements first and its padding last:
true of a plan of one unit, which is what ZeRO-1 uses (:meth:`GradOrder.shard_order` returns None
for a plan with padding inside a rank's shard).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..values.flat_buffers import UnitPlan
from ..values.layout import ParamLayout

#: (start, end) within the tensor's flattened elements, and where that range starts in the buffer
Placement = tuple[int, int, int]


@dataclass(frozen=True)
class GradOrder:
    """The placement of every tensor's gradient in the flat gradient buffer, and this rank's owned range."""

    kind: str  # "layout" | "shard"
    placements: dict[str, tuple[Placement, ...]]
    owned: tuple[int, int]  # this rank's owned elements in the buffer (shard order); (0, total) otherwise
    regions: tuple[tuple[int, int], ...] = ()  # shard order: every rank's owned range, in rank order

    @classmethod
    def layout_order(cls, layout: ParamLayout) -> GradOrder:
        """Tensor after tensor, at the layout's offsets."""
        pairs = zip(layout.tensors, layout.offsets, strict=True)
        placements: dict[str, tuple[Placement, ...]] = {
            t.name: ((0, t.numel, g0),) if t.numel else () for t, g0 in pairs}
        return cls("layout", _with_aliases(placements, layout), (0, layout.total_numel))

    @classmethod
    def shard_order(cls, layout: ParamLayout, plan: UnitPlan, local: int) -> GradOrder | None:
        """Every shard-group rank's owned elements in turn, in the order of its packed shard (None
        when some rank's shard has padding before one of its real elements)."""
        spans: list[tuple[int, int, int]] = []  # (global start, global end, buffer position)
        base, regions = 0, []
        for j in range(plan.k):
            pieces = plan.owned_global(j)
            at = 0
            for g0, g1, pos in pieces:
                if pos != at:
                    return None
                spans.append((g0, g1, base + pos))
                at += g1 - g0
            regions.append((base, base + at))
            base += at
        if base != layout.total_numel:
            return None
        spans.sort()
        placements: dict[str, tuple[Placement, ...]] = {}
        for t, t0 in zip(layout.tensors, layout.offsets, strict=True):
            t1 = t0 + t.numel
            placements[t.name] = tuple((max(g0, t0) - t0, min(g1, t1) - t0, dst + max(g0, t0) - g0)
                                       for g0, g1, dst in spans if g0 < t1 and g1 > t0)
        return cls("shard", _with_aliases(placements, layout), regions[local], tuple(regions))

    def views(self, buffer: Any, name: str) -> list[tuple[Any, int, int]]:
        """``(view of buffer, start, end)`` for each range of tensor ``name``'s flattened gradient."""
        return [(buffer[dst:dst + b - a], a, b) for a, b, dst in self.placements[name]]

    def runs(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """The buffer ranges the gradients of ``names`` occupy, sorted, adjacent ones merged."""
        out: list[list[int]] = []
        for lo, hi in sorted((dst, dst + b - a) for n in names for a, b, dst in self.placements[n]):
            if out and out[-1][1] == lo:
                out[-1][1] = hi
            else:
                out.append([lo, hi])
        return [(lo, hi) for lo, hi in out]


def _with_aliases(placements: dict[str, tuple[Placement, ...]],
                  layout: ParamLayout) -> dict[str, tuple[Placement, ...]]:
    """``placements`` with every alias of a shared tensor placed where that tensor is."""
    return {**placements, **{alias: placements[target] for alias, target in layout.aliases.items()}}
