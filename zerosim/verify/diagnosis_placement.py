"""Diagnoses of where values lie across ranks (C-ZERO-001, C-ZERO-002, C-ZERO-003): shards that
overlap or leave elements unowned, the reference's values in the wrong places, replicas whose
gradients were never reduced across them, a failure confined to one rank's owned ranges, and ranks
that disagree (one of them stale). The catalogue and its order are in :mod:`zerosim.verify.diagnosis`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zerosim.values.observe import TrainerObservation
from zerosim.values.verdict import Verdict

from .diagnosis_evidence import failing, majority, params_key, ranges
from .observation import StepRecord
from .outcome import Diagnosis


def overlap(own: Verdict | None) -> list[Diagnosis]:
    if own is None or own.status != "fail":
        return []
    for v in own.violations:
        if v.get("clause") in ("disjoint", "replicas"):
            return [
                Diagnosis(
                    "overlapping-shards",
                    f"local_shards() at step {v['step']}: {v['tensor']}"
                    f"[{v['start']}:{v['stop']}]: {v['message']}",
                )
            ]
    return []


def unowned(records: Sequence[StepRecord], own: Verdict | None) -> list[Diagnosis]:
    if own is not None:
        for v in own.violations:
            if v.get("clause") == "coverage":
                return [
                    Diagnosis(
                        "unowned-elements",
                        f"local_shards() at step {v['step']}: {v['tensor']}"
                        f"[{v['start']}:{v['stop']}] {v['message']}",
                    )
                ]
    by_phase: dict[str, list[StepRecord]] = {}
    for r in records:
        by_phase.setdefault(r.phase, []).append(r)
    for phase, recs in by_phase.items():
        start, last = recs[0], recs[-1]
        names = list(start.ref.params)
        frozen_parts, moved_parts = [], []
        for n in names:
            initial = start.ref.params_before[n].reshape(-1)
            frozen = np.ones(initial.size, dtype=bool)
            for r in recs:
                for o in r.ranks:
                    frozen &= o.params[n].astype(np.float64).reshape(-1) == initial
            moved = np.abs(last.ref.params[n].reshape(-1) - initial) > last.bounds.params[n].reshape(-1)
            frozen_parts.append(frozen)
            moved_parts.append(moved)
        stuck = np.concatenate(frozen_parts) & np.concatenate(moved_parts)
        if not stuck.any():
            continue
        sizes = np.cumsum([0] + [m.size for m in moved_parts])
        idx = np.flatnonzero(stuck)
        i = int(np.searchsorted(sizes, idx[0], side="right") - 1)
        local = stuck[sizes[i] : sizes[i + 1]]
        tail = " (the end of the flattened parameters)" if idx[-1] == stuck.size - 1 else ""
        return [
            Diagnosis(
                "unowned-elements",
                f"{int(stuck.sum())} element(s) never moved over the {phase} phase "
                f"(steps {start.step}-{last.step}) on any rank while the reference moved them; first in "
                f"{names[i]}{ranges(local)}; flat range {int(idx[0])}..{int(idx[-1]) + 1} of "
                f"{stuck.size}{tail}: a remainder no rank owns",
            )
        ]
    return []


def permuted(rec: StepRecord) -> list[Diagnosis]:
    obs = majority(rec)
    names = list(rec.ref.params)
    got = np.concatenate([obs.params[n].astype(np.float64).reshape(-1) for n in names])
    exp = np.concatenate([rec.ref.params[n].reshape(-1) for n in names])
    bound = np.concatenate([rec.bounds.params[n].reshape(-1) for n in names])
    wrong = np.abs(got - exp) > bound
    if wrong.sum() < 2:
        return []
    # a moved value is one of the reference's values to within rounding: the typical bound, not the
    # largest (Adam's bound reaches O(lr) on near-zero gradients, far wider than the spacing of values)
    tol = float(np.median(bound))
    order = np.sort(exp)
    pos = np.clip(np.searchsorted(order, got[wrong]), 1, order.size - 1)
    nearest = np.minimum(np.abs(order[pos] - got[wrong]), np.abs(order[pos - 1] - got[wrong]))
    if np.mean(nearest <= tol) < 0.99:
        return []
    i = int(np.flatnonzero(wrong)[0])
    j = int(np.argmin(np.abs(exp - got[i])))
    n = 0
    while i + n < got.size and j + n < exp.size and abs(got[i + n] - exp[j + n]) <= tol:
        n += 1
    return [
        Diagnosis(
            "permuted-shards",
            f"at step {rec.step} the parameters hold exactly the reference's values, "
            f"{int(wrong.sum())} of them in the wrong place: flat elements [{i}:{i + n}] hold the "
            f"reference's [{j}:{j + n}] (shards gathered in the wrong order)",
        )
    ]


def _replica_groups(rec: StepRecord, mesh: tuple[int, int] | None) -> list[list[int]] | None:
    """Positions in ``rec.ranks`` of each replica: the mesh's shard groups (None when the ranks of one
    disagree), or else the groups of ranks holding bitwise the same parameters."""
    keys = [params_key(rec, o) for o in rec.ranks]
    if mesh is not None:
        shard = mesh[1]
        groups = [list(range(g, min(g + shard, len(keys)))) for g in range(0, len(keys), shard)]
        if any(keys[i] != keys[g[0]] for g in groups for i in g):
            return None
        return groups
    by_key: dict[bytes, list[int]] = {}
    for i, k in enumerate(keys):
        by_key.setdefault(k, []).append(i)
    return list(by_key.values())


def replicas_not_reduced(rec: StepRecord, mesh: tuple[int, int] | None) -> list[Diagnosis]:
    if rec.phase != "sgd":  # SGD's step is linear in the gradient: the replicas' mean is the reference's
        return []
    groups = _replica_groups(rec, mesh)
    if groups is None or len(groups) < 2 or len({len(g) for g in groups}) != 1:
        return []
    heads = [rec.ranks[g[0]] for g in groups]
    if len({params_key(rec, o) for o in heads}) < 2:
        return []
    for n, exp in rec.ref.params.items():
        mean = np.mean([o.params[n].astype(np.float64) for o in heads], axis=0)
        slack = rec.bounds.params[n] + 4 * np.finfo(np.float64).eps * np.abs(exp)
        if (np.abs(mean - exp) > slack).any():
            return []
    shard = mesh[1] if mesh is not None else len(groups[0])
    names = "; ".join(",".join(str(rec.ranks[i].rank) for i in g) for g in groups[:4])
    more = f" and {len(groups) - 4} more" if len(groups) > 4 else ""
    return [
        Diagnosis(
            "replicas-not-reduced",
            f"at step {rec.step} ({rec.phase}) the {len(groups)} replicas (ranks {names}{more}) each hold "
            "a different update and their mean is the reference's: each replica averaged its gradient over "
            f"its own {shard} rank(s) only; the all-reduce across replicas (ranks r, r + {shard}, ...) is "
            "missing (an HSDP step that skips the replicate reduction, as FSDP's HYBRID_SHARD does on an "
            "(n, 1) mesh in pytorch #154888)",
        )
    ]


def rank_local(rec: StepRecord) -> list[Diagnosis]:
    if any(o.shards is None for o in rec.ranks):
        return []
    obs = majority(rec)
    bad = failing(rec, obs)
    if not bad:
        return []
    owners: list[list[int]] = []
    for o in rec.ranks:
        inside = True
        for n, mask in bad.items():
            mine = np.zeros(mask.size, dtype=bool)
            for a, b in (o.shards or {}).get(n, []):
                mine[a:b] = True
            if (mask & ~mine).any():
                inside = False
                break
        if inside:
            owners.append([o.rank])
    if not owners or len(owners) == len(rec.ranks):
        return []
    who = ",".join(str(o[0]) for o in owners)
    label = f"rank {who}" if len(owners) == 1 else f"ranks {who} (replicas of one shard)"
    where = "; ".join(f"{n}{ranges(m)}" for n, m in list(bad.items())[:3])
    return [
        Diagnosis(
            "rank-local",
            f"at step {rec.step} every element that differs from the reference lies in "
            f"the ranges {label} owns ({where}): look at that rank's optimizer step or its shard of the "
            "gradient reduction",
        )
    ]


def disagree(records: Sequence[StepRecord], contracts: dict[str, Verdict]) -> list[Diagnosis]:
    ident = contracts.get("C-ZERO-003")
    if ident is None or ident.status != "fail":
        return []
    v = ident.first_violation
    assert v is not None
    evidence = (
        f"at step {v['step']} ({v['phase']}) rank {v['rank']}'s {v['tensor']}[{v['start']}:{v['stop']}] "
        f"{v['message']}"
    )
    rec = next((r for r in records if r.step == v["step"]), None)
    prev = next((r for r in records if r.step == v["step"] - 1 and r.phase == v["phase"]), None)
    if rec is not None:
        obs = next(o for o in rec.ranks if o.rank == v["rank"])
        before = (
            prev.ranks[[o.rank for o in prev.ranks].index(v["rank"])].params
            if prev is not None
            else rec.ref.params_before
        )
        if all(
            np.array_equal(obs.params[n].astype(np.float64), np.asarray(before[n], dtype=np.float64))
            for n in rec.ref.params
        ):
            evidence += f"; rank {v['rank']} still holds the parameters of the step before (stale)"
        elif _close(obs, rec):
            evidence += f"; rank {v['rank']} itself matches the reference, the others do not"
    return [
        Diagnosis(
            "ranks-disagree",
            evidence + ": look at the all-gather / broadcast of updated shards, or replicas that drift apart",
        )
    ]


def _close(obs: TrainerObservation, rec: StepRecord) -> bool:
    return not failing(rec, obs)
