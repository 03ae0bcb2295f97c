"""FSDP2 ``fully_shard`` (and FSDP1 per-tensor) rule: ``torch.chunk`` on dim 0 of every parameter.

For a parameter with ``d0`` rows, ``torch.chunk(t, ws, dim=0)`` gives chunks of ``c = ceil(d0 / ws)``
rows; rank ``r`` gets rows ``[r*c, min((r+1)*c, d0))``, so tail ranks may get fewer rows or none
(d0=5, ws=4 -> 2, 2, 1, 0). Every rank's shard is padded to chunk 0's size (``c`` rows).

How rows map to the flat space: parameters are row-major, so rows ``[a, b)`` of a parameter at flat
offset ``o`` with ``m = prod(shape[1:])`` elements per row are the single flat interval
``[o + a*m, o + b*m)``. A 0-d parameter is treated as one row of one element (torch.chunk itself
rejects 0-d tensors). Serves C-ZERO-001.
"""

from __future__ import annotations

import math

from ..values.intervals import Interval
from ..values.layout import ParamLayout
from ._common import ceil_div, check_args, check_interval_count, make_plan
from .base import ShardPlan, register_partitioner


def chunk_rows(d0: int, world_size: int) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of dim 0 each rank gets under ``torch.chunk(t, world_size, dim=0)``."""
    c = ceil_div(d0, world_size)
    return [(min(r * c, d0), min((r + 1) * c, d0)) for r in range(world_size)]


def rows_to_flat(offset: int, rows: tuple[int, int], row_numel: int) -> Interval:
    """Flat interval of rows ``[a, b)`` of a row-major tensor starting at ``offset``."""
    a, b = rows
    return (offset + a * row_numel, offset + b * row_numel)


def _rows_and_row_numel(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows of dim 0, elements per row); a 0-d tensor is one row of one element."""
    shape = shape or (1,)
    return shape[0], math.prod(shape[1:])


@register_partitioner("fsdp", "FSDP2 fully_shard: torch.chunk on dim 0 per tensor, padded to chunk 0's size")
def fsdp_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """FSDP's dim-0 chunking.

    balance_bound = sum over tensors of (c_i - min_rows_i) * m_i, where ``c_i`` is chunk 0's rows,
    ``min_rows_i = max(0, d0_i - (ws-1)*c_i)`` the last rank's rows and ``m_i`` the row size: per
    tensor no two ranks differ by more than that, and the bound adds the worst case of each tensor.
    """
    ws = check_args(layout, world_size)
    shapes = [(offset, *_rows_and_row_numel(tensor.shape)) for offset, tensor in
              zip(layout.offsets, layout.tensors, strict=True)]
    # only ranks below ceil(d0 / c) get rows of a tensor: O(intervals) work, never O(tensors * ranks)
    check_interval_count("fsdp", sum(ceil_div(d0, ceil_div(d0, ws)) for _, d0, m in shapes if d0 * m), ws)
    per_rank: list[list[Interval]] = [[] for _ in range(ws)]
    real = [0] * ws
    stored = bound = 0
    for offset, d0, m in shapes:
        c = ceil_div(d0, ws)
        stored += c * m
        bound += (c - max(0, d0 - (ws - 1) * c)) * m
        if c * m == 0:
            continue
        for r in range(ceil_div(d0, c)):
            rows = (r * c, min((r + 1) * c, d0))
            per_rank[r].append(rows_to_flat(offset, rows, m))
            real[r] += (rows[1] - rows[0]) * m
    padding = [stored - n for n in real]  # every rank stores c_i rows of every tensor
    return make_plan(
        "fsdp", ws, layout.total_numel, per_rank, padding, bound,
        notes="torch.chunk(dim=0) per tensor; shards padded to chunk 0's rows",
        padded_shard_numel=stored, padded_total=stored * ws,
    )
