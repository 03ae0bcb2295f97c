"""C-ZERO-001: shards cover every parameter, never overlap, stay balanced, and padding is never data.

Clauses (each a separate ``Violation.clause``):

* ``well_formed``: one shard per rank, in rank order; every interval is a pair of ints, start <= end.
* ``coverage``: the union of the real intervals is exactly ``[0, total)``: every gap is reported
  with the ranks on either side of it.
* ``disjoint``: no element is owned twice (by two ranks, or listed twice by one rank).
* ``balance``: max - min real elements per rank <= the partitioner's ``balance_bound``; when the plan
  carries ``balance_target`` / ``balance_tolerance`` (the seed's rule), every shard is also within
  the tolerance of the target (``total // world_size``).
* ``whole_tensor`` (the optimizer state of a StatePlan, which knows the tensors, under a
  whole-tensor partitioner: ``zero-redundancy``, ``round-robin`` or ``contiguous``): every tensor is
  owned whole by one rank of its shard group, the tensor named where it is not. Such a plan's
  ``balance`` is its partitioner's own bound (the largest tensor for ``zero-redundancy``, whole
  blocks for the block maps), not a flat even split's.
* ``padding``: padding never counts as data: no interval reaches outside ``[0, total)``, padding
  counts are non-negative, and when the plan declares ``padded_shard_numel`` every rank stores
  exactly that many elements (real + padding), as its collectives require.

All interval arithmetic: one sort of the k intervals, O(k log k) (k = world size for flat rules),
never O(total).

One check, :func:`check_partition_plan`, judges every partition the contract applies to, chosen by
what it is given:

* a :class:`~zerosim.partition.base.ShardPlan` (a partitioner's plan, a user's partition function
  swept by :func:`zerosim.check_partition`, a benchmark's plans): the clauses above;
* a :class:`~zerosim.values.plan.StatePlan` (the engine's plan, before it trains): the same clauses inside
  every shard group for params, grads and optimizer state, and replicas holding identical shards
  (``replicas``);
* the element ranges a live trainer's ranks own: :class:`~zerosim.values.observe.TrainerStep` records with
  every tensor's element count (``zerosim verify``), or a monitored run's
  :class:`~zerosim.values.observe.MonitorObservation` (:mod:`zerosim.checks.partition_ranges`).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np

from ..cost.optimizer_state import WHOLE_TENSOR_PARTITIONERS, split_tensors
from ..partition.base import RankShard, ShardPlan, ShardTable
from ..values.intervals import clip, first_difference, outside, sweep, sweep_arrays
from ..values.observe import MonitorObservation
from ..values.verdict import Verdict, Violation
from .collect import ViolationCollector
from .judges import judges
from .partition_ranges import _monitor_layout, _owned_ranges

CONTRACT = "C-ZERO-001"
CLAUSES = ("well_formed", "coverage", "disjoint", "balance", "padding", "replicas", "whole_tensor")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


@judges(CONTRACT)
def check_partition_plan(
    plan: Any,
    *,
    limit: int = 20,
    context: dict[str, Any] | None = None,
    numels: dict[str, int] | None = None,
    mesh: tuple[int, int] | None = None,
) -> Verdict:
    """C-ZERO-001 on a partition (see the module docstring); a Verdict with one Violation per finding.

    ``plan``: a ShardPlan (``limit`` caps the violations kept per clause, counts in
    ``details['violations_by_clause']`` stay complete; ``context`` is attached to every violation,
    default world size and total); a StatePlan (``limit`` as for a ShardPlan, violations name global
    ranks, the state kind and the shard group); a live trainer's TrainerStep records, judged on the
    ranges they own against ``numels`` (every tensor's element count) and ``mesh`` ((replicas, shard
    group size) the ranges must follow, where the run names one); or a monitored run's
    MonitorObservations (their own element counts).
    """
    if isinstance(plan, ShardPlan):
        return _shard_plan(plan, limit=limit, context=context)
    from ..values.plan import StatePlan

    if isinstance(plan, StatePlan):
        return _state_plan(plan, limit=limit)
    records = list(plan)
    if numels is None and all(isinstance(o, MonitorObservation) for o in records):
        return _monitor_layout(records)
    if numels is None:
        raise ValueError("a live trainer's owned ranges are judged against numels (elements per tensor)")
    return _owned_ranges(records, numels, mesh)


def _shard_plan(
    plan: ShardPlan, *, limit: int = 20, context: dict[str, Any] | None = None
) -> Verdict:
    """C-ZERO-001 on one ShardPlan.

    ``limit`` caps the violations kept per clause (counts in ``details['violations_by_clause']``
    stay complete); ``context`` is attached to every violation (default: world size and total).
    """
    ws, total = plan.world_size, plan.total
    ctx = {"world_size": ws, "total": total} if context is None else dict(context)
    out = ViolationCollector(CONTRACT, ctx, per_clause=limit)
    verdict = Verdict(CONTRACT, checked=len(plan.shards))
    table = plan.table
    if table is not None and _table_is_well_formed(table, total):
        return _check_table(plan, table, verdict, out, limit)

    # -- well_formed ------------------------------------------------------------------------------
    if not _is_int(total) or total < 0:
        out.add("well_formed", f"total must be a non-negative integer, got {total!r}", got=total)
        return _finish(verdict, out, plan)
    if len(plan.shards) != ws:
        out.add("well_formed", f"plan has {len(plan.shards)} shards for world_size={ws}",
                expected=ws, got=len(plan.shards))
    labelled: list[tuple[int, int, int]] = []
    real = [0] * len(plan.shards)
    for pos, shard in enumerate(plan.shards):
        rank = shard.rank
        if rank != pos:
            out.add("well_formed", f"shard at position {pos} says it is rank {rank}", ranks=(pos,),
                    expected=pos, got=rank)
        for iv in shard.intervals:
            if type(iv) is tuple and len(iv) == 2:  # fast path: a well-formed interval inside the space
                s, e = iv
                if type(s) is int and type(e) is int and 0 <= s <= e <= total:
                    if e > s:
                        labelled.append((s, e, pos))
                        real[pos] += e - s
                    continue
            if not (isinstance(iv, tuple | list) and len(iv) == 2 and _is_int(iv[0]) and _is_int(iv[1])):
                out.add("well_formed", f"interval {iv!r} is not a pair of integers", ranks=(pos,))
                continue
            s, e = int(iv[0]), int(iv[1])
            if s > e:
                out.add("well_formed", "interval has start > end", ranks=(pos,), interval=(s, e))
                continue
            # -- padding: nothing outside [0, total) may be reported as data -------------------
            for lo, hi in outside((s, e), 0, total):
                where = "at or beyond total (padding)" if lo >= total else "below 0"
                out.add("padding", f"rank claims {hi - lo} elements {where} as data", ranks=(pos,),
                        interval=(lo, hi))
            inside = clip((s, e), 0, total)
            if inside:
                labelled.append((inside[0], inside[1], pos))
                real[pos] += inside[1] - inside[0]
        pad = shard.padding
        if not _is_int(pad) or pad < 0:
            out.add("padding", f"padding must be a non-negative integer, got {pad!r}", ranks=(pos,), got=pad)
    padded = plan.meta.get("padded_shard_numel")
    if padded is not None:
        for pos, shard in enumerate(plan.shards):
            if _is_int(shard.padding) and real[pos] + shard.padding != padded:
                out.add("padding", f"rank stores {real[pos]} real + {shard.padding} padding elements, "
                        f"not the declared shard size {padded}", ranks=(pos,),
                        expected=padded, got=real[pos] + shard.padding)

    # -- coverage and disjoint: one sweep over the sorted intervals ------------------------------
    cov = sweep(labelled, 0, total, limit=limit)
    _report_coverage(out, cov)

    # -- balance ------------------------------------------------------------------------------------
    if real:
        hi_rank = max(range(len(real)), key=real.__getitem__)
        lo_rank = min(range(len(real)), key=real.__getitem__)
        spread = real[hi_rank] - real[lo_rank]
        target, tol = plan.meta.get("balance_target"), plan.meta.get("balance_tolerance")
        off_target = 0
        if target is not None and tol is not None:  # the seed's literal clause, shard by shard
            for pos, n in enumerate(real):
                if abs(n - target) > tol:
                    off_target += 1
                    out.add("balance", f"shard holds {n} elements, not within {tol} of total // world_size "
                            f"= {target}", ranks=(pos,), expected=target, got=n)
        if spread > plan.balance_bound and not off_target:
            out.add("balance", f"rank {hi_rank} holds {real[hi_rank]} elements and rank {lo_rank} holds "
                    f"{real[lo_rank]}: spread {spread} exceeds the bound {plan.balance_bound}",
                    ranks=(hi_rank, lo_rank), expected=plan.balance_bound, got=spread)
        verdict.details.update(max_numel=real[hi_rank], min_numel=real[lo_rank], spread=spread)

    verdict.details.update(num_intervals=len(labelled), gap_elements=cov.gap_elements,
                           overlap_elements=cov.overlap_elements)
    return _finish(verdict, out, plan)


def _table_is_well_formed(table: ShardTable, total: Any) -> bool:
    """Whether an array plan needs none of the well_formed / out-of-space findings (else the
    per-interval path reports them one by one)."""
    return (_is_int(total) and 0 <= total < ShardTable.MAX_VALUE and len(table.starts) == len(table.ends)
            and len(table.first) == len(table.padding) + 1 and int(table.first[0]) == 0
            and int(table.first[-1]) == len(table.starts) and bool(np.all(np.diff(table.first) >= 0))
            and bool(np.all(table.starts <= table.ends)) and bool(np.all(table.starts >= 0))
            and bool(np.all(table.ends <= total)) and bool(np.all(table.padding >= 0)))


def _check_table(plan: ShardPlan, table: ShardTable, verdict: Verdict, out: ViolationCollector,
                 limit: int) -> Verdict:
    """C-ZERO-001 on a plan held as arrays: the same clauses, findings and details as the
    per-interval path, with every rank's every interval checked by array arithmetic."""
    ws, total = plan.world_size, plan.total
    if len(table) != ws:
        out.add("well_formed", f"plan has {len(table)} shards for world_size={ws}", expected=ws,
                got=len(table))
    real = table.real_numel()
    padded = plan.meta.get("padded_shard_numel")
    if padded is not None:
        stored = real + table.padding
        bad = np.flatnonzero(stored != padded)

        def padding_finding(i: int) -> tuple[str, dict[str, Any]]:
            pos = int(bad[i])
            n, pad = int(real[pos]), int(table.padding[pos])
            return (f"rank stores {n} real + {pad} padding elements, not the declared shard size {padded}",
                    {"ranks": (pos,), "expected": padded, "got": n + pad})

        out.add_first("padding", len(bad), padding_finding)

    cov = sweep_arrays(table.starts, table.ends, table.owners(), 0, total, limit=limit)
    _report_coverage(out, cov)

    if len(real):
        hi_rank, lo_rank = int(np.argmax(real)), int(np.argmin(real))
        hi_n, lo_n = int(real[hi_rank]), int(real[lo_rank])
        spread = hi_n - lo_n
        target, tol = plan.meta.get("balance_target"), plan.meta.get("balance_tolerance")
        off_target = 0
        if target is not None and tol is not None:
            off = np.flatnonzero(np.abs(real - target) > tol)
            off_target = len(off)

            def balance_finding(i: int) -> tuple[str, dict[str, Any]]:
                pos, n = int(off[i]), int(real[off[i]])
                return (f"shard holds {n} elements, not within {tol} of total // world_size = {target}",
                        {"ranks": (pos,), "expected": target, "got": n})

            out.add_first("balance", off_target, balance_finding)
        if spread > plan.balance_bound and not off_target:
            out.add("balance", f"rank {hi_rank} holds {hi_n} elements and rank {lo_rank} holds "
                    f"{lo_n}: spread {spread} exceeds the bound {plan.balance_bound}",
                    ranks=(hi_rank, lo_rank), expected=plan.balance_bound, got=spread)
        verdict.details.update(max_numel=hi_n, min_numel=lo_n, spread=spread)
    verdict.details.update(num_intervals=int(np.count_nonzero(table.ends > table.starts)),
                           gap_elements=cov.gap_elements, overlap_elements=cov.overlap_elements)
    return _finish(verdict, out, plan)


def _report_coverage(out: ViolationCollector, cov: Any) -> None:
    for s, e, left, right in cov.gaps:
        ranks = tuple(r for r in (left, right) if r is not None)
        side = f"after rank {left}" if left is not None else "at the start"
        side += f", before rank {right}" if right is not None else ", up to the end"
        out.add("coverage", f"{e - s} elements owned by no rank ({side})", ranks=ranks, interval=(s, e))
    out.set_count("coverage", cov.gap_count)
    for s, e, a, b in cov.overlaps:
        who = f"ranks {a} and {b}" if a != b else f"rank {a} (listed twice)"
        out.add("disjoint", f"{e - s} elements owned by {who}", ranks=(a, b), interval=(s, e))
    if cov.overlap_count:
        out.set_count("disjoint", cov.overlap_count)


def _finish(verdict: Verdict, out: ViolationCollector, plan: ShardPlan) -> Verdict:
    verdict.violations.extend(out.violations)
    verdict.details.update(partitioner=plan.partitioner, world_size=plan.world_size, total=plan.total,
                           balance_bound=plan.balance_bound,
                           violations_by_clause={k: v for k, v in out.per_clause_count.items() if v},
                           suppressed=out.not_listed)
    return verdict


def _state_plan(state_plan: Any, *, limit: int = 20) -> Verdict:
    """C-ZERO-001 for every kind of state of a StatePlan (params, grads, optimizer).

    Sharded kinds: the partition of every shard group satisfies C-ZERO-001 (ranks reported as
    global ranks). Replicated kinds: every rank holds all of ``[0, total)``. Then every replicate
    group (ranks with the same local index in their shard groups) holds identical shards
    (clause ``replicas``): a hybrid plan whose replicas differ would silently diverge.
    """
    from ..values.plan import STATE_KINDS, RankStates

    strategy, topo = state_plan.strategy, state_plan.topology
    total = state_plan.layout.total_numel
    base = state_plan.shard_plan
    out = ViolationCollector(CONTRACT)
    checked = 0
    sharded = {"params": strategy.shards_params, "grads": strategy.shards_grads,
               "optimizer": strategy.shards_optimizer}
    ranks = state_plan.ranks
    whole = sharded["optimizer"] and base.partitioner in WHOLE_TENSOR_PARTITIONERS
    if (isinstance(ranks, RankStates) and ranks.derived(base) and len(ranks) == topo.world_size
            and ranks.flags == tuple(sharded[k] for k in STATE_KINDS)
            and topo.world_size % base.world_size == 0
            and not (whole and split_tensors(state_plan.layout, base))):
        fast = _check_derived(state_plan, sharded, limit)
        if fast is not None:
            return fast
    # Groups whose shards are the very same objects (params, grads and optimizer state of one
    # partition, every shard group of a hybrid plan) are checked once; a tampered group is not.
    seen: dict[tuple, tuple[Verdict, list]] = {}
    for kind in STATE_KINDS:
        groups = topo.shard_groups(strategy) if sharded[kind] else [[r] for r in range(topo.world_size)]
        for g, members in enumerate(groups):
            held = [state_plan.ranks[r].holding(kind) for r in members]
            key = (sharded[kind],) + tuple((id(h.intervals), h.padding) for h in held)
            if key in seen:
                v = seen[key][0]
            else:
                shards = tuple(RankShard(local, h.intervals, h.padding) for local, h in enumerate(held))
                if sharded[kind]:
                    plan = ShardPlan(base.partitioner, len(members), total, shards, base.balance_bound,
                                     base.notes, base.meta)
                else:
                    plan = ShardPlan("replicated", 1, total, shards, 0)
                v = _shard_plan(plan, limit=limit, context={})
                seen[key] = (v, held)  # keep ``held`` alive so the ids in the key stay unique
            ctx = {"state": kind, "group": g}
            for x in v.violations:
                out.add_violation(dataclasses.replace(_to_global(x, members), context={**x.context, **ctx}))
            checked += v.checked
            if whole and kind == "optimizer":
                shards = tuple(RankShard(local, h.intervals, h.padding) for local, h in enumerate(held))
                group_plan = ShardPlan(base.partitioner, len(members), total, shards, base.balance_bound)
                _split_findings(state_plan.layout, group_plan, members, out, ctx)
        if not sharded[kind]:
            replicate_groups = [list(range(topo.world_size))]
        elif topo.world_size > base.world_size:
            replicate_groups = topo.replicate_groups(strategy)
        else:  # one shard group spans the world: every replicate group is a single rank
            replicate_groups = []
        for members in replicate_groups:
            first = state_plan.ranks[members[0]].holding(kind)
            for r in members[1:]:
                other = state_plan.ranks[r].holding(kind)
                if tuple(other.intervals) == tuple(first.intervals) and other.padding == first.padding:
                    continue
                diff = first_difference(first.intervals, other.intervals)
                out.add(
                    "replicas",
                    f"replicas hold different {kind} shards: rank {members[0]} has {first.numel} elements "
                    f"(+{first.padding} padding), rank {r} has {other.numel} (+{other.padding})",
                    ranks=(members[0], r), interval=diff, context={"state": kind})
    return out.verdict(checked, strategy=strategy.name, world_size=topo.world_size, total=total,
                       partitioner=base.partitioner, shard_group_size=base.world_size)


def _split_findings(layout: Any, plan: ShardPlan, members: list[int], out: ViolationCollector,
                    ctx: dict[str, Any]) -> None:
    """Clause ``whole_tensor``: one finding, naming the tensor, for every tensor no rank of the shard
    group ``members`` owns whole under a whole-tensor partitioner's ``plan``."""
    for t, local in split_tensors(layout, plan):
        held = [members[r] for r in local]
        who = (f"ranks {held} each own part of it" if len(held) > 1
               else f"rank {held[0]} owns only part of it" if held else "no rank owns it")
        out.add("whole_tensor", f"tensor {t.name!r} {tuple(t.shape)} is not whole on one rank under the "
                f"whole-tensor partitioner {plan.partitioner!r}: {who}", ranks=tuple(held) or (members[0],),
                tensor=t.name, context=ctx)


def _check_derived(state_plan: Any, sharded: dict[str, bool], limit: int) -> Verdict | None:
    """:func:`_state_plan` for a plan whose every rank's holding is derived from its one ShardPlan.

    Rank ``r`` holds local rank ``r % k``'s shard for sharded kinds and ``[0, total)`` for
    replicated ones (:class:`zerosim.values.plan.RankStates`), so every shard group holds the very same
    shards and every replicate group identical ones: the shard plan and the whole-space shard are
    each checked once, in full, and stand for every group. Returns None when a check fails, so the
    caller reports each group's findings with its global ranks.
    """
    from ..values.plan import STATE_KINDS

    strategy, topo = state_plan.strategy, state_plan.topology
    total = state_plan.layout.total_numel
    base = state_plan.shard_plan
    full = ShardPlan("replicated", 1, total, (RankShard(0, ((0, total),) if total else (), 0),), 0)
    v_sharded = _shard_plan(base, limit=limit, context={})
    v_full = _shard_plan(full, limit=limit, context={})
    if not (v_sharded.passed and v_full.passed):
        return None
    verdict = Verdict(CONTRACT)
    groups = topo.world_size // base.world_size
    for kind in STATE_KINDS:
        verdict.checked += v_sharded.checked * groups if sharded[kind] else v_full.checked * topo.world_size
    verdict.details.update(strategy=strategy.name, world_size=topo.world_size, total=total,
                           partitioner=base.partitioner, shard_group_size=base.world_size)
    return verdict


def _to_global(v: Violation, members: list[int]) -> Violation:
    ranks = tuple(members[r] if 0 <= r < len(members) else r for r in v.ranks)
    return dataclasses.replace(v, ranks=ranks)
