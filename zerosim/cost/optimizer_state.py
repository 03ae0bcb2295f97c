"""How much optimizer state each tensor carries, and which tensors a rank steps in a whole-tensor layout.

The memory model of an elementwise optimizer (SGD, Adam, AdamW) is a number of state buffers per
element (:data:`zerosim.cost.memory_settings.OPTIMIZER_STATES`). A matrix optimizer's state follows
each tensor's shape instead, so C-ZERO-004 plans it tensor by tensor, over the tensors the rank
owns whole (:func:`owned_whole_tensors`):

* ``muon`` (torch's recipe): ``momentum_buffer`` (the tensor's shape) on 2-D tensors, AdamW's
  ``exp_avg`` and ``exp_avg_sq`` on the others;
* ``adafactor``: ``row_var`` (every dimension but the last, times 1) and ``col_var`` (every dimension
  but the second to last, times 1) for a tensor of two or more dimensions, ``variance`` (the tensor's
  shape) for the others.

torch's 0-dimensional ``step`` counters are not per-element state and are left out, as the flat
layout's integer step is. A user's optimizer has no known state: :func:`state_numel` gives None.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..partition.base import ShardPlan
from ..values.layout import ParamLayout, TensorSpec

#: optimizers whose update of an element depends on that element alone (any flat split is correct)
ELEMENTWISE = ("sgd", "adam", "adamw")
#: registered partitioners that place every tensor whole on one rank: a whole-tensor layout
#: (``zero-redundancy``: largest first to the least loaded rank; the seed's block maps ``round-robin``
#: and ``contiguous``: whole blocks), each judged by its own balance bound
WHOLE_TENSOR_PARTITIONERS = ("zero-redundancy", "round-robin", "contiguous")


def is_elementwise(optim: Mapping[str, Any]) -> bool:
    """True for the phases ``sgd``, ``adam`` and ``adamw``."""
    return str(optim.get("name")) in ELEMENTWISE


def state_numel(optim: Mapping[str, Any], shape: tuple[int, ...]) -> int | None:
    """Elements of per-element optimizer state torch keeps for one tensor of ``shape`` under ``optim``
    (see the module docstring); None for an optimizer whose state is not known (a user's)."""
    name = str(optim.get("name"))
    numel = math.prod(shape)
    if name in ("adam", "adamw"):
        return 2 * numel
    if name == "sgd":
        return numel if optim.get("momentum") else 0
    if name == "muon":
        return numel if len(shape) == 2 else 2 * numel
    if name == "adafactor":
        if len(shape) < 2:
            return numel
        return math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]
    return None


def owned_whole_tensors(layout: ParamLayout, plan: ShardPlan, local: int) -> list[TensorSpec]:
    """The tensors that shard-group rank ``local`` owns whole under ``plan`` (a tensor split between
    ranks belongs to none: a whole-tensor plan has no such tensor)."""
    intervals = plan.shard(local).intervals
    out = []
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        if t.numel and any(s <= g0 and g0 + t.numel <= e for s, e in intervals):
            out.append(t)
    return out


def split_tensors(layout: ParamLayout, plan: ShardPlan) -> list[tuple[TensorSpec, tuple[int, ...]]]:
    """Every tensor no single rank of ``plan`` owns whole, with the ranks that own part of it (none when
    no rank owns any of it), in layout order.

    Array arithmetic over the plan's intervals sorted by start, O((tensors + intervals) log
    intervals), without a RankShard per rank (a plan of 2^20 ranks is a few arrays): a tensor is
    whole when the last interval starting at or before it covers it and no other interval starts
    inside it (overlapping intervals are the ``disjoint`` clause's finding, not this one's).
    """
    table = plan.table
    if table is not None:
        starts, ends, owners = table.starts, table.ends, table.owners()
    else:
        rows = [(s, e, r) for r in range(plan.world_size) for s, e in plan.shard(r).intervals]
        starts, ends, owners = (np.array([row[i] for row in rows], dtype=object if rows else np.int64)
                                for i in range(3))
    keep = ends > starts
    order = np.argsort(starts[keep], kind="stable")
    s, e, o = starts[keep][order], ends[keep][order], owners[keep][order]
    numels = np.array([t.numel for t in layout.tensors], dtype=np.int64)
    g0 = np.array(layout.offsets, dtype=np.int64)
    g1 = g0 + numels
    if s.dtype == object:  # values beyond int64: compare as Python ints
        g0, g1 = g0.astype(object), g1.astype(object)
    last = np.searchsorted(s, g0, side="right") - 1
    inside = np.searchsorted(s, g1, side="left") - np.searchsorted(s, g0, side="right")
    at = np.clip(last, 0, max(len(s) - 1, 0))
    covered = (last >= 0) & (e[at] >= g1) if len(s) else np.zeros(len(g0), dtype=bool)
    bad = np.flatnonzero((numels > 0) & ~(covered & (inside == 0)))
    out = []
    for i in bad:
        meet = (s < g1[i]) & (e > g0[i])
        out.append((layout.tensors[i], tuple(sorted({int(r) for r in o[meet]}))))
    return out
