"""DeepSpeed's partition rules: ZeRO-1/2 (one padded flat buffer) and ZeRO-3 (each parameter padded).

Both serve C-ZERO-001. Padding is counted per rank and never listed as data.

* ``deepspeed`` (``runtime/zero/stage_1_and_2.py``): the parameter group is flattened in order and
  zero-padded at the end to a multiple of ``2 * ws`` (``nccl_start_alignment_factor = 2``); rank
  ``r`` owns ``flat[r * p : (r + 1) * p]`` with ``p = padded / ws``. A parameter may straddle two
  ranks. We model one parameter group (the whole layout).
* ``deepspeed-zero3`` (``runtime/zero/partition_parameters.py``): every parameter is padded to a
  multiple of ``ws``; ``p_i = padded_i / ws`` and rank ``r`` owns elements ``[r * p_i, (r+1) * p_i)``
  of parameter ``i``. The padding sits on the tail ranks and is unused.
"""

from __future__ import annotations

import numpy as np

from ..values.intervals import Interval
from ..values.layout import ParamLayout
from ._common import ceil_div, check_args, check_interval_count, make_flat_plan, make_plan
from .base import ShardPlan, ShardTable, register_partitioner

NCCL_START_ALIGNMENT_FACTOR = 2


def flat_partition(total: int, world_size: int, alignment: int) -> tuple[int, list[Interval], list[int]]:
    """Pad ``total`` to a multiple of ``alignment`` and cut it in ``world_size`` equal parts.

    Returns ``(partition_size, real interval per rank, padding per rank)``.
    """
    padded = ceil_div(total, alignment) * alignment
    part = padded // world_size
    intervals, padding = [], []
    for r in range(world_size):
        start, end = r * part, (r + 1) * part
        real_end = min(end, total)
        real = max(real_end - start, 0)
        intervals.append((start, start + real))
        padding.append(part - real)
    return part, intervals, padding


@register_partitioner(
    "deepspeed", "DeepSpeed ZeRO-1/2: flat buffer padded to a multiple of 2*ws, equal parts"
)
def deepspeed_zero12_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """DeepSpeed ZeRO-1/2 flat partition.

    balance_bound = min(p, 2*ws - 1): every rank but the tail ones holds exactly ``p`` real elements;
    the padding (at most ``2*ws - 1`` elements, all at the end) is what the tail ranks lack.
    """
    ws = check_args(layout, world_size)
    total = layout.total_numel
    alignment = NCCL_START_ALIGNMENT_FACTOR * ws
    notes = f"flat buffer padded to a multiple of {alignment} (2*ws); every rank stores {{part}} elements"
    if total + alignment < ShardTable.MAX_VALUE:
        part = ceil_div(total, alignment) * alignment // ws
        starts = np.arange(ws, dtype=np.int64) * part
        ends = np.minimum(starts + part, total)
        real = np.maximum(ends - starts, 0)
        return make_flat_plan(
            "deepspeed", total, starts, starts + real, part - real, min(part, 2 * ws - 1),
            notes=notes.format(part=part), padded_shard_numel=part, padded_total=part * ws,
            alignment=alignment,
        )
    part, intervals, padding = flat_partition(total, ws, alignment)
    return make_plan(
        "deepspeed", ws, total, [[iv] for iv in intervals], padding, min(part, 2 * ws - 1),
        notes=notes.format(part=part), padded_shard_numel=part, padded_total=part * ws, alignment=alignment,
    )


@register_partitioner("deepspeed-zero3", "DeepSpeed ZeRO-3: each parameter padded to a multiple of ws")
def deepspeed_zero3_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """DeepSpeed ZeRO-3 per-parameter partition.

    balance_bound = sum over parameters of min(p_i, pad_i): per parameter the ranks hold ``p_i``
    real elements except the tail ones, which together lack the ``pad_i < ws`` padding elements.
    """
    ws = check_args(layout, world_size)
    # only ranks below ceil(n / p) hold elements of a parameter: O(intervals) work, not O(tensors * ranks)
    pieces = sum(ceil_div(n, ceil_div(n, ws)) for n in layout.numels() if n)
    check_interval_count("deepspeed-zero3", pieces, ws)
    per_rank: list[list[Interval]] = [[] for _ in range(ws)]
    real_numel = [0] * ws
    stored = bound = 0
    for offset, tensor in zip(layout.offsets, layout.tensors, strict=True):
        n = tensor.numel
        part = ceil_div(n, ws)
        pad = part * ws - n
        stored += part
        bound += min(part, pad)
        if part == 0:
            continue
        for r in range(ceil_div(n, part)):
            start = r * part
            real = min(start + part, n) - start
            per_rank[r].append((offset + start, offset + start + real))
            real_numel[r] += real
    padding = [stored - n for n in real_numel]  # every rank stores p_i elements of every parameter
    return make_plan(
        "deepspeed-zero3", ws, layout.total_numel, per_rank, padding, bound,
        notes="each parameter padded to a multiple of ws; tail ranks hold the padding",
        padded_shard_numel=stored, padded_total=stored * ws,
    )
