"""C-ZERO-006 rank-0 load: a pure function from the full state dict and every rank's shard to a verdict.

After a full (unsharded) state dict is loaded on rank 0, broadcast and sharded, every rank must hold
exactly what it would hold had it sliced the full state dict itself under its plan: the same global
pieces at the same positions of its packed shard, with the same bits, and (where the rank keeps full
working parameters or they are gathered) the same working parameters.

Clauses:

* ``pieces``: each rank holds the global pieces its plan assigns it, no more, no fewer;
* ``shard``: every owned element equals the full state dict's element bit for bit;
* ``params``: the full working parameters equal the full state dict cast to the parameter dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..values.layout import ParamLayout
from ..values.observe import ShardValues
from ..values.verdict import Verdict
from .collect import ViolationCollector
from .judges import judges

CONTRACT = "C-ZERO-006"
CLAUSES = ("pieces", "shard", "params")
MAX_VIOLATIONS = 32
MAX_PER_RANK = 4  #: violations reported per rank and clause (every failing rank is named)

Piece = tuple[int, int, int]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def _tensor_ranges(layout: ParamLayout, idx: np.ndarray) -> list[tuple[str, int, int, int, int]]:
    """``(tensor, first index, end of the last index, count, first index)`` per tensor of sorted global
    indices ``idx``."""
    offsets = np.asarray(layout.offsets + (layout.total_numel,))
    owner = np.searchsorted(offsets, idx, side="right") - 1
    out = []
    for t in np.unique(owner):
        sel = idx[owner == t]
        out.append((layout.tensors[int(t)].name, int(sel[0]), int(sel[-1]) + 1, int(sel.size), int(sel[0])))
    return out


@judges(CONTRACT)
def check_broadcast_shard(
    full: np.ndarray,
    layout: ParamLayout,
    got: Mapping[int, ShardValues],
    plan: Mapping[int, Sequence[Piece]],
    params: Mapping[int, np.ndarray] | None = None,
    context: dict[str, Any] | None = None,
) -> Verdict:
    """C-ZERO-006: ``got[rank]`` (the master shard a rank holds after the broadcast load, with its
    pieces) equals the slice of ``full`` (the full flat state dict in the master dtype) under
    ``plan[rank]`` bit for bit; ``params[rank]`` (optional full working parameters) equal ``full``
    cast to their dtype."""
    out = ViolationCollector(CONTRACT, context, total=MAX_VIOLATIONS, per_rank=MAX_PER_RANK)
    full = np.asarray(full)
    checked = 0
    failing: set[int] = set()

    def add(clause: str, message: str, ranks: tuple[int, ...], **kw: Any) -> None:
        failing.update(ranks)
        out.add(clause, message, ranks=ranks, **kw)

    for rank in sorted(plan):
        checked += 1
        want = tuple(tuple(int(x) for x in p) for p in plan[rank])
        shard = got.get(rank)
        if shard is None:
            add("pieces", "the rank reported no shard", ranks=(rank,))
            continue
        have = tuple(tuple(int(x) for x in p) for p in shard.pieces)
        if sorted(have) != sorted(want):
            extra = sorted(set(have) - set(want))[:3]
            lost = sorted(set(want) - set(have))[:3]
            add("pieces", f"holds pieces {extra} the plan does not give it and lacks {lost}", ranks=(rank,))
            continue
        if shard.values.dtype != full.dtype:
            add("shard", f"the shard is {shard.values.dtype}, the state dict {full.dtype}", ranks=(rank,))
            continue
        for g0, g1, pos in want:
            a, b = _bits(full[g0:g1]), _bits(shard.values[pos:pos + g1 - g0])
            if a.shape != b.shape:
                add("shard", f"the shard stores {b.shape[0]} elements at {pos}, not {g1 - g0}",
                    ranks=(rank,), interval=(g0, g1))
                continue
            diff = np.flatnonzero(a != b)
            if diff.size == 0:
                continue
            for tensor, lo, hi, count, first in _tensor_ranges(layout, diff + g0):
                add("shard",
                    f"{count} element(s) of {tensor} in flat range [{lo}, {hi}) differ from the state dict",
                    ranks=(rank,), tensor=tensor, interval=(lo, hi),
                    expected=float(full[first]), got=float(shard.values[pos + first - g0]))
    for rank in sorted(params or {}):
        checked += 1
        work = np.asarray((params or {})[rank])
        want_params = full.astype(work.dtype)
        if work.shape != want_params.shape:
            add("params", f"the working parameters have shape {work.shape}, not {want_params.shape}",
                ranks=(rank,))
            continue
        diff = np.flatnonzero(_bits(work) != _bits(want_params))
        for tensor, lo, hi, count, first in _tensor_ranges(layout, diff) if diff.size else []:
            add("params",
                f"{count} working parameter element(s) of {tensor} in flat range [{lo}, {hi}) differ",
                ranks=(rank,), tensor=tensor, interval=(lo, hi),
                expected=float(want_params[first]), got=float(work[first]))
    return out.verdict(checked, failing_ranks=sorted(failing))
