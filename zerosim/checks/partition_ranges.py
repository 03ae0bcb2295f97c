"""C-ZERO-001, shards cover every parameter exactly once and stay balanced, judged on the element
ranges a live trainer's ranks say they own (``local_shards()`` in ``zerosim verify``, the owned ranges
of a monitored run): the part of :func:`zerosim.checks.partition.check_partition_plan` that reads
observed ranges instead of a plan.

Every element of every parameter is owned (clause ``coverage``), no rank lists an element twice and no
two ranks share one (``disjoint``), and the most and least loaded ranks differ by at most the largest
tensor, which the message names (``balance``: the bound greedy placement of whole tensors guarantees,
so a whole-tensor layout is judged by its own rule, and a flat split by a looser one than its own).
Whether a matrix optimizer (Muon, Adafactor) got whole tensors is left to the values (C-ZERO-002 and
the ``matrix-optimizer-on-shard`` diagnosis): a trainer may keep a tensor's state sharded and still
compute on the whole tensor, as FSDP2's DTensor does. A hybrid layout (every element owned by the same
number k > 1 of ranks) holds when ranks whose ranges meet own identical ranges (replicas of one
shard), each such group has k members, and one rank of each group covers every element exactly once
(``replicas``). The layout is inferred from the ranges alone; given a mesh (R replicas of S shard
ranks: rank r in shard group r // S and replica group r % S), the ranges must also follow it: every
element owned by R ranks and the ranks of one replica group owning identical ranges (clause
``replicas``). The engine's plans are
judged by :mod:`zerosim.checks.partition` before they run, against the same clauses.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..values.observe import MonitorObservation, TrainerStep
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .mismatch import first_run, runs
from .owned_intervals import owned_intervals_verdict

CONTRACT = "C-ZERO-001"


def _monitor_layout(observations: Sequence[MonitorObservation]) -> Verdict:
    """C-ZERO-001 on a monitored run's owned ranges, by the interval sweep of
    :mod:`zerosim.checks.owned_intervals` (each distinct layout judged once, at the first step it shows)."""
    by_step: dict[int, list[MonitorObservation]] = {}
    for obs in observations:
        by_step.setdefault(obs.step, []).append(obs)
    numels: dict[str, int] = {}
    for obs in observations:
        numels.update(obs.numels)
    out = ViolationCollector("C-ZERO-001", total=MAX_LISTED)
    seen: set[Any] = set()
    layouts: list[str] = []
    checked: dict[str, int] = {"elements": 0, "ranges": 0}
    for step, rows in sorted(by_step.items()):
        owned = {o.rank: o.owned for o in rows}
        key = tuple((r, tuple((n, tuple(map(tuple, v))) for n, v in sorted(owned[r].items())))
                    for r in sorted(owned))
        if key in seen:
            continue
        seen.add(key)
        verdict, layout = owned_intervals_verdict(owned, numels, step=step, out=out)
        layouts.append(layout)
        checked = {k: max(checked[k], verdict.details[k]) for k in checked}
    return out.listed_verdict(checked=len(layouts), layouts=layouts, **checked)


def _owned_ranges(
    records: Sequence[TrainerStep], numels: dict[str, int], mesh: tuple[int, int] | None = None
) -> Verdict:
    """C-ZERO-001 on the element ranges every rank owns (see the module docstring); ``numels``: the
    element count per tensor; ``mesh``: (replicas, shard group size) the ranges must follow, when the
    run names one. Each distinct layout is checked once. Without owned ranges (a trainer with
    no ``local_shards()``) the verdict lists nothing and says why in ``details["skipped"]``."""
    with_shards = [r for r in records if all(o.shards is not None for o in r.ranks)]
    if not with_shards:
        return Verdict(CONTRACT, details={"skipped": (
            "the trainer has no local_shards(): coverage, disjointness and "
            "balance of its optimizer shards cannot be observed"
        )})
    out = ViolationCollector(CONTRACT, total=MAX_LISTED)
    seen: set[Any] = set()
    layouts: list[str] = []
    for rec in with_shards:
        key = tuple(
            tuple((n, tuple(map(tuple, ranges))) for n, ranges in sorted((o.shards or {}).items()))
            for o in rec.ranks
        )
        if key in seen:
            continue
        seen.add(key)
        layouts.append(_ranges_layout(rec, numels, out, mesh))
    return out.listed_verdict(checked=len(layouts), layouts=layouts)


def _ranges_layout(
    rec: TrainerStep, numels: dict[str, int], out: ViolationCollector, mesh: tuple[int, int] | None = None
) -> str:
    """Check one step's ranges; add violations to ``out``; describe the inferred layout."""
    ranks = [o.rank for o in rec.ranks]
    owners = {n: np.zeros(numels[n], dtype=object if len(ranks) > 62 else np.int64) for n in numels}
    count = {n: np.zeros(numels[n], dtype=np.int64) for n in numels}
    owned = dict.fromkeys(ranks, 0)
    phase, step = rec.phase, rec.step
    for o in rec.ranks:
        bit = 1 << o.rank
        for name, ranges in (o.shards or {}).items():
            mine = np.zeros(numels[name], dtype=bool)
            for start, stop in ranges:
                if mine[start:stop].any():
                    a, b = first_run(mine[start:stop])
                    out.add(
                        "disjoint",
                        "disjoint: the rank lists these elements twice",
                        None,
                        phase=phase,
                        step=step,
                        ranks=(o.rank,),
                        tensor=name,
                        interval=(start + a, start + b),
                    )
                mine[start:stop] = True
            owners[name][mine] |= bit
            count[name][mine] += 1
            owned[o.rank] += int(mine.sum())
    all_counts = np.concatenate([c for c in count.values()]) if count else np.zeros(0, dtype=np.int64)
    for name, c in count.items():
        if (c == 0).any():
            for start, stop in runs(c == 0)[:4]:
                out.add(
                    "coverage",
                    f"coverage: {stop - start} element(s) owned by no rank "
                    f"({int((c == 0).sum())} of {c.size} in this tensor)",
                    None,
                    phase=phase,
                    step=step,
                    tensor=name,
                    interval=(start, stop),
                )
    positive = all_counts[all_counts > 0]
    k = int(positive.min()) if positive.size else 0
    for name, c in count.items():
        over = c > k
        if k and over.any():
            start, stop = first_run(over)
            holders = _ranks_of(owners[name][start])
            out.add(
                "disjoint",
                f"disjoint: elements owned by ranks {holders} ({int(c[start])} owners where "
                f"the rest of the model has {k})",
                {"ranks": holders},
                phase=phase,
                step=step,
                ranks=(holders[0],),
                tensor=name,
                interval=(start, stop),
                expected=k,
                got=int(c[start]),
            )
    if mesh is not None:
        _follows_mesh(rec, mesh, k, owners, out)
    largest = max(numels.values()) if numels else 0
    biggest = f"{max(numels, key=lambda n: numels[n])!r}, " if numels else ""
    if k <= 1:
        loads = [owned[r] for r in ranks]
        if loads and max(loads) - min(loads) > largest:
            hi, lo = ranks[int(np.argmax(loads))], ranks[int(np.argmin(loads))]
            out.add(
                "balance",
                f"balance: rank {hi} owns {max(loads)} elements, rank {lo} {min(loads)}: more "
                f"apart than the largest tensor ({biggest}{largest})",
                None,
                phase=phase,
                step=step,
                ranks=(hi,),
                tensor="*",
                interval=(0, 0),
                expected=min(loads),
                got=max(loads),
                tolerance=largest,
            )
        return "sharded (each element owned once)" if k == 1 else "no owners"
    # hybrid: replicas of a shard are the ranks whose ranges meet
    parent = {r: r for r in ranks}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for own in owners.values():
        for mask in np.unique(own):
            members = _ranks_of(mask)
            for r in members[1:]:
                parent[find(r)] = find(members[0])
    groups: dict[int, list[int]] = {}
    for r in ranks:
        groups.setdefault(find(r), []).append(r)
    for members in groups.values():
        if len(members) != k:
            out.add(
                "replicas",
                f"replicas: ranks {members} share elements but form a group of {len(members)}, "
                f"not {k} replicas",
                {"ranks": members},
                phase=phase,
                step=step,
                ranks=(members[0],),
                tensor="*",
                interval=(0, 0),
                expected=k,
                got=len(members),
            )
        first = members[0]
        for r in members[1:]:
            for name, own in owners.items():
                a = (own & (1 << first)) != 0
                b = (own & (1 << r)) != 0
                if (a != b).any():
                    start, stop = first_run(a != b)
                    out.add(
                        "replicas",
                        f"replicas: ranks {first} and {r} share elements but own different "
                        "ranges (overlapping shards, not replicas)",
                        {"ranks": [first, r]},
                        phase=phase,
                        step=step,
                        ranks=(r,),
                        tensor=name,
                        interval=(start, stop),
                    )
                    break
    loads = [owned[members[0]] for members in groups.values()]
    if loads and max(loads) - min(loads) > largest:
        out.add(
            "balance",
            f"balance: shard groups own between {min(loads)} and {max(loads)} elements, more "
            f"apart than the largest tensor ({biggest}{largest})",
            None,
            phase=phase,
            step=step,
            tensor="*",
            interval=(0, 0),
            expected=min(loads),
            got=max(loads),
            tolerance=largest,
        )
    return f"hybrid: {len(groups)} shard(s) x {k} replicas"


def _follows_mesh(
    rec: TrainerStep, mesh: tuple[int, int], k: int, owners: dict[str, Any], out: ViolationCollector
) -> None:
    """Clause ``replicas`` under a named mesh (R, S): each element has R owners, one per replica, and
    rank r owns what the first rank of its replica group (r % S) owns."""
    replicas, shard = mesh
    label = f"mesh {replicas}x{shard}"
    if k and k != replicas:
        out.add(
            "replicas",
            f"replicas: under {label} every element is owned by {replicas} rank(s), one per replica; "
            f"here by {k}",
            {"mesh": [replicas, shard]},
            phase=rec.phase, step=rec.step, tensor="*", interval=(0, 0), expected=replicas, got=k,
        )
    for o in rec.ranks:
        first = o.rank % shard
        if first == o.rank:
            continue
        for name, own in owners.items():
            a = (own & (1 << first)) != 0
            b = (own & (1 << o.rank)) != 0
            if (a != b).any():
                start, stop = first_run(a != b)
                out.add(
                    "replicas",
                    f"replicas: under {label} ranks {first} and {o.rank} form one replica group "
                    f"(rank % {shard} = {first}) but own different ranges",
                    {"ranks": [first, o.rank], "mesh": [replicas, shard]},
                    phase=rec.phase, step=rec.step, ranks=(o.rank,), tensor=name, interval=(start, stop),
                )
                break


def _ranks_of(mask: Any) -> list[int]:
    """The ranks whose bits are set in an owner mask."""
    m = int(mask)
    out = []
    r = 0
    while m:
        if m & 1:
            out.append(r)
        m >>= 1
        r += 1
    return out
