"""C-ZERO-005 on a live trainer: the traffic each rank records lies within the declared strategy's model,
and every gradient reduction moves the dtype the run's policy names.

Pure functions of observation values: per rank and step, the traffic summary ``zerosim verify`` counts
at torch.distributed's collectives (bytes sent and received per traffic class under the ring attribution,
and one record per collective call with its kind, class, group and the element dtype of the tensor it
moved).

* ``ring_model`` (:func:`check_traffic_within_model`): the bytes every rank *receives* per step, per
  traffic class, lie in the band of the declared strategy's communication model
  (:func:`zerosim.cost.comm_model.comm_per_step`), split into gradient reduction (all-reduce,
  reduce-scatter, reduce to an owner) and parameter exchange (all-gather, broadcast). Received bytes
  make a broadcast from each owner (ZeroRedundancyOptimizer) and an all-gather comparable: under both a
  rank receives every element it does not own. The band: at most the model with the trainer's padding;
  at least, per gradient reduction, the same collective on the unpadded gradient, and per parameter
  gather pass, the elements the rank does not store (a trainer that pads less than the model, or
  broadcasts whole tensors without padding, moves less). Below the band is a failure too: a ZeRO-3 that
  gathers once per step keeps whole parameters alive from forward to backward. Scalars (a gradient
  norm, a loss, an overflow flag) are control traffic, counted apart and not judged.
* ``reduce_dtype`` (:func:`check_reduce_dtype`): every gradient reduction moves elements of the dtype
  the run's policy names (the run's dtype in full precision; a mixed-precision policy's reduce dtype).
  A reduction in another dtype is a correctness failure, not an efficiency finding: bfloat16 where the
  policy says float32 loses precision that the parameters may not show, only the bytes do.

The engine's own runs are judged exactly, per group kind and collective, by
:func:`zerosim.checks.step.check_communication`; this module is the same contract where a trainer's
collectives are only observed from outside.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from ..cost.comm_model import comm_per_step
from ..layout import ParamLayout
from ..strategy import ShardingStrategy, Topology
from ..verdict import Verdict
from .collect import ViolationCollector
from .resident_memory import as_layout, stored_numel, strategy_from_declared

CONTRACT = "C-ZERO-005"
#: the judged traffic classes: gradient reduction and parameter exchange (``control`` is counted apart)
TRAFFIC_CLASSES = ("reduce", "gather")
REDUCE_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")
GATHER_COLLECTIVES = ("all_gather", "broadcast")


def traffic_class(kind: str, numel: int) -> str:
    """``reduce`` (gradient reduction), ``gather`` (parameter exchange) or ``control`` (a scalar) for a
    collective of ``kind`` moving ``numel`` elements."""
    if numel <= 1:
        return "control"
    return "reduce" if kind in REDUCE_COLLECTIVES else "gather"


def traffic_band(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    world: int,
    rank: int,
    param_bytes: int,
    grad_bytes: int,
    partitioner: str | None,
    zero1_grad_reduce: str,
    micro_batches: int = 1,
) -> dict[str, tuple[Fraction, Fraction]]:
    """(least, most) bytes ``rank`` receives per step in each traffic class (see the module docstring).

    Under accumulation over ``micro_batches`` K the least is the one-micro-batch model's (a trainer
    that accumulates locally and reduces once, FSDP2 without gradient sync) and the most the K-micro-batch
    model's (a reduction per micro-batch into the shard, DeepSpeed ZeRO-2, zerogpu; ZeRO-3 gathering
    for every micro-batch's forward and backward). Replicated-gradient strategies (DDP, ZeRO-1) have
    one reduction per step in both, so their band stays exact."""
    one = _band_of(layout, strategy, world, rank, param_bytes, grad_bytes, partitioner, zero1_grad_reduce, 1)
    if micro_batches == 1:
        return one
    many = _band_of(layout, strategy, world, rank, param_bytes, grad_bytes, partitioner, zero1_grad_reduce,
                    micro_batches)
    return {c: (min(one[c][0], many[c][0]), max(one[c][1], many[c][1])) for c in TRAFFIC_CLASSES}


def _band_of(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    world: int,
    rank: int,
    param_bytes: int,
    grad_bytes: int,
    partitioner: str | None,
    zero1_grad_reduce: str,
    micro_batches: int,
) -> dict[str, tuple[Fraction, Fraction]]:
    """(least, most) of :func:`traffic_band` for one schedule of ``micro_batches`` micro-batches."""
    est = comm_per_step(
        layout,
        strategy,
        Topology(world),
        partitioner or "fsdp",
        micro_batches=micro_batches,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        zero1_grad_reduce=zero1_grad_reduce,
    )
    psi = layout.total_numel
    stored = stored_numel(layout, strategy, world, rank, partitioner)
    scalars = sum(1 for n in layout.numels() if n == 1)
    band: dict[str, tuple[Fraction, Fraction]] = {c: (Fraction(0), Fraction(0)) for c in TRAFFIC_CLASSES}
    for item in est.items:
        if item.group_size <= 1:
            continue
        most = item.bytes_received
        if item.collective == "all_gather":
            # every gather brings the elements this rank does not store; padding may or may not travel.
            # A one-element tensor moved alone (a peer broadcasting whole tensors) is counted as control
            # traffic, indistinguishable from a scalar: the least leaves those elements out
            passes = Fraction(item.payload_elements, est.packed_numel)
            least = passes * max(psi - stored - scalars, 0) * param_bytes
            cls = "gather"
        else:
            # a gradient buffer of the real elements only (no padding) is the least a reduction moves
            padded = item.payload_elements % psi != 0
            least = most * Fraction(psi, est.packed_numel) if padded else most
            cls = "reduce"
        lo, hi = band[cls]
        band[cls] = (lo + min(least, most), hi + most)
    return band


def check_traffic_within_model(
    declared_strategy: str,
    layout: Any,
    dtype_bytes: int,
    world: int,
    per_rank_traffic: Sequence[Sequence[Mapping[str, Any]]],
    *,
    grad_bytes: int | None = None,
    partitioner: str | None = None,
    zero1_grad_reduce: str = "all_reduce",
    unobserved: Mapping[str, str] | None = None,
    phase: str | None = None,
    first_step: int = 1,
    micro_batches: int = 1,
) -> Verdict:
    """C-ZERO-005 ``ring_model`` on counted traffic: the bytes every rank receives per step, per traffic
    class, lie in the band of the declared strategy's communication model (see the module docstring).

    ``per_rank_traffic[r][i]``: rank ``r``'s traffic summary at the ``i``-th step of the phase (global
    step ``first_step + i``): ``{"reduce" | "gather" | "control": {"sent", "received"}}`` in bytes.
    ``dtype_bytes``: bytes of a parameter element on the wire; ``grad_bytes``: of a gradient element
    (default the same). ``unobserved``: class -> why it cannot be seen (that class is not judged).
    ``micro_batches``: micro-batches per optimizer step (the band of :func:`traffic_band` under
    accumulation). Each violation names rank, step and class (in ``tensor``) with the band in
    ``expected_range``.
    """
    strategy = strategy_from_declared(declared_strategy)
    lay = as_layout(layout)
    skip = dict(unobserved or {})
    out = ViolationCollector(CONTRACT)
    rows: list[dict[str, Any]] = []
    checked = 0
    for rank, steps in enumerate(per_rank_traffic):
        band = traffic_band(
            lay, strategy, world, rank, dtype_bytes, grad_bytes or dtype_bytes, partitioner,
            zero1_grad_reduce, micro_batches,
        )
        rows.append(
            {
                "rank": rank,
                "band": {c: [float(lo), float(hi)] for c, (lo, hi) in band.items()},
                "received": [
                    {c: float(s[c]["received"]) for c in (*TRAFFIC_CLASSES, "control")} for s in steps
                ],
            }
        )
        for i, summary in enumerate(steps):
            for cls in TRAFFIC_CLASSES:
                if cls in skip:
                    continue
                checked += 1
                lo, hi = band[cls]
                got = Fraction(summary[cls]["received"])
                if lo <= got <= hi:
                    continue
                what = "gradient reduction" if cls == "reduce" else "parameter exchange"
                out.add(
                    "ring_model",
                    f"rank {rank} received {float(got):,.0f} bytes of {what} in step {first_step + i}; "
                    f"the {strategy.name} ring model allows {float(lo):,.0f} to {float(hi):,.0f}",
                    {"expected_range": [float(lo), float(hi)]},
                    phase=phase, step=first_step + i, ranks=(rank,), tensor=cls, expected=float(hi),
                    got=float(got), error=float(got) - float(hi), tolerance=0,
                )
    return out.verdict(
        checked=checked,
        strategy=strategy.name,
        partitioner=partitioner,
        param_bytes=dtype_bytes,
        grad_bytes=grad_bytes or dtype_bytes,
        zero1_grad_reduce=zero1_grad_reduce,
        micro_batches=micro_batches,
        ranks=rows,
    )


def check_reduce_dtype(
    per_rank_traffic: Sequence[Sequence[Mapping[str, Any] | None]],
    expected_dtype: str,
    *,
    phase: str | None = None,
    first_step: int = 1,
    ranks: Sequence[int] | None = None,
) -> Verdict:
    """C-ZERO-005 ``reduce_dtype``: every gradient reduction of every rank and step moves elements of
    ``expected_dtype`` (the run's dtype in full precision; a mixed-precision policy's reduce dtype).

    ``per_rank_traffic[r][i]``: rank ``r``'s traffic summary at the ``i``-th step of the phase (global
    step ``first_step + i``), whose ``"collectives"`` list holds one record per collective call
    (``function``, ``kind``, ``class``, ``dtype``, ``payload_bytes``, ``group``; ``calls`` where one
    record stands for several calls, as the engine's per-collective tallies do); a summary without
    records (None, or counted before dtypes were recorded) is not judged. ``ranks[r]``: the rank the
    ``r``-th entry observed (default ``r``). Control traffic (scalars) and
    parameter exchange are not gradient reductions. Each violation names the collective (function and
    kind, in ``tensor``), step, rank, the expected and the moved dtype; one per (rank, step, collective
    function, dtype), with the number of such calls in ``calls``.
    """
    out = ViolationCollector(CONTRACT)
    checked = 0
    for index, steps in enumerate(per_rank_traffic):
        rank = index if ranks is None else ranks[index]
        for i, summary in enumerate(steps):
            records = (summary or {}).get("collectives")
            if records is None:
                continue
            wrong: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
            for rec in records:
                if rec.get("class") != "reduce":
                    continue
                checked += int(rec.get("calls", 1))
                if rec.get("dtype") != expected_dtype:
                    key = (str(rec.get("function")), str(rec.get("kind")), str(rec.get("dtype")))
                    wrong.setdefault(key, []).append(rec)
            for (function, kind, dtype), calls in wrong.items():
                count = sum(int(c.get("calls", 1)) for c in calls)
                moved = sum(int(c.get("payload_bytes", 0)) for c in calls)
                size = f", {moved:,} bytes" if moved else ""
                out.add(
                    "reduce_dtype",
                    f"rank {rank} reduced gradients in {dtype} in step {first_step + i} "
                    f"({count} {function} call(s){size}); the run's policy reduces in {expected_dtype}",
                    {"collective": kind, "calls": count, "dtype": dtype},
                    phase=phase, step=first_step + i, ranks=(rank,), tensor=function,
                    expected=expected_dtype, got=dtype,
                )
    return out.verdict(checked=checked, reduce_dtype=expected_dtype)
