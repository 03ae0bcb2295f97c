"""C-ZERO-003, after each step every rank computes with identical, current weights: one check,
:func:`check_replica_identity`, for the engine's runs and for live trainers (``zerosim verify``).

* **The engine's runs** (:class:`~zerosim.values.observe.RankObservation`): every rank's gathered working
  parameters are bitwise equal (clause ``identical``), and equal the working-dtype cast of the master
  assembled from its shard group's shards (clause ``matches_master``: ranks that are all equally
  stale fail too).
* **Live trainers** (:class:`~zerosim.values.observe.TrainerStep`): every rank's full parameters are bitwise
  equal after every step (clause ``identical``); the odd rank out is named, ranks being compared with
  the bit pattern most of them hold.
* **Monitored runs** (:class:`~zerosim.values.observe.MonitorObservation`): every rank that holds a piece of a
  tensor (the same flat element range) holds a piece with the same digest (clause ``identical``), the
  odd rank out named the same way; where no copy is held by more ranks than every other (two ranks
  that differ), the ranks are said to disagree and none is named; either way, a rank whose own update
  departs from its optimizer's formula (C-ZERO-002 ``update``) and whose copy no rank with a sound
  update holds is named instead, as the evidence outranks a count; pieces held by one rank only are
  not compared.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..numerics.xp import numpy_namespace
from ..values.layout import ParamLayout
from ..values.observe import MonitorObservation, RankObservation, TrainerStep, digest
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .judges import judges
from .mismatch import (
    bitwise_diff,
    describe_mismatch,
    element_bytes,
    first_run,
    step_clauses,
    step_verdict,
)
from .update_formula import departs

CONTRACT = "C-ZERO-003"


@judges(CONTRACT)
def check_replica_identity(
    observations: Sequence[RankObservation] | Sequence[TrainerStep] | Sequence[MonitorObservation],
    *,
    layout: ParamLayout | None = None,
) -> Verdict:
    """C-ZERO-003: every rank's weights after each step are bitwise identical (see the module docstring).

    ``observations``: the engine's :class:`~zerosim.values.observe.RankObservation` per rank, or a live
    trainer's :class:`~zerosim.values.observe.TrainerStep` records, or a monitored run's
    :class:`~zerosim.values.observe.MonitorObservation` per rank and check.
    """
    if observations and isinstance(observations[0], MonitorObservation):
        return _digest_identity(observations, CONTRACT)  # type: ignore[arg-type]
    if not observations or isinstance(observations[0], RankObservation):
        return _post_gather_identity(observations, layout=layout, contract=CONTRACT)  # type: ignore[arg-type]
    return _trainer_identity(observations, CONTRACT)  # type: ignore[arg-type]



def assemble(observations: Sequence[RankObservation], step: int, kind: str = "master",
             ranks: Sequence[int] | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The full array of ``kind`` at ``step`` assembled from the shards of ``ranks`` (default all), and
    a mask of the elements nobody covered (None when no observation has values)."""
    out: np.ndarray | None = None
    covered: np.ndarray | None = None
    for obs in observations:
        if ranks is not None and obs.rank not in ranks:
            continue
        so = next((s for s in obs.steps if s.step == step), None)
        if so is None:
            continue
        sv = so.master if kind == "master" else so.optimizer.get(kind.removeprefix("optimizer."))
        if sv is None:
            return None, None
        if out is None or covered is None:
            total = max((g1 for _, g1, _ in sv.pieces), default=0)
            for o in observations:
                s2 = next((s for s in o.steps if s.step == step), None)
                if s2 is not None and s2.master is not None:
                    total = max(total, max((g1 for _, g1, _ in s2.master.pieces), default=0))
            out = np.zeros(total, dtype=sv.values.dtype)
            covered = np.zeros(total, dtype=bool)
        for g0, g1, pos in sv.pieces:
            out[g0:g1] = sv.values[pos:pos + g1 - g0]
            covered[g0:g1] = True
    return out, (None if covered is None else ~covered)


def _post_gather_identity(observations: Sequence[RankObservation], *, layout: ParamLayout | None = None,
                          contract: str = "C-ZERO-003") -> Verdict:
    """C-ZERO-003 on the engine's runs: after each step, every rank's gathered working parameters are
    bitwise identical, and equal the working-dtype cast of the float32 master assembled from its shard
    group's shards."""
    col = step_clauses(contract)
    checked = 0
    steps = sorted({s.step for o in observations for s in o.steps})
    by_rank = {o.rank: o for o in observations}
    for step in steps:
        rows = [
            (o.rank, next(s for s in o.steps if s.step == step))
            for o in observations
            if any(s.step == step for s in o.steps)
        ]
        if not rows:
            continue
        base_rank, base = rows[0]
        for rank, so in rows[1:]:
            checked += 1
            if so.gathered is not None and base.gathered is not None:
                mask = bitwise_diff(so.gathered, base.gathered)
                if mask.any():
                    idx = np.arange(mask.size)
                    tensor, interval, e, g, msg = describe_mismatch(
                        layout, idx, mask, so.gathered, base.gathered
                    )
                    col.add(
                        "identical",
                        f"rank {rank}'s gathered weights differ from rank {base_rank}'s: {msg}",
                        step=step,
                        ranks=(base_rank, rank),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                    )
            else:
                bad = sorted(t for t, d in so.gathered_digest.items() if base.gathered_digest.get(t) != d)
                if bad:
                    col.add(
                        "identical",
                        f"rank {rank}'s gathered weights differ from rank {base_rank}'s in "
                        f"{len(bad)} tensors (digests)",
                        step=step,
                        ranks=(base_rank, rank),
                        tensor=bad[0],
                    )
        # the gathered weights must be the current master (not equally stale everywhere)
        groups: dict[int, list[int]] = {}
        for rank, _ in rows:
            groups.setdefault(by_rank[rank].shard_group, []).append(rank)
        for members in groups.values():
            master, missing = assemble(observations, step, "master", members)
            if master is None or missing is None or missing.any():
                continue
            for rank in members:
                so = next(s for s in by_rank[rank].steps if s.step == step)
                if so.gathered is None:
                    if so.gathered_digest and layout is not None and "params" in so.holdings:
                        checked += 1
                        cast = master.astype(numpy_namespace().dtype(so.holdings["params"].dtype))
                        want = {t.name: digest(cast[g0:g0 + t.numel])
                                for t, g0 in zip(layout.tensors, layout.offsets, strict=True)}
                        bad = sorted(t for t, d in so.gathered_digest.items() if want.get(t) != d)
                        if bad:
                            col.add(
                                "matches_master",
                                f"rank {rank} computes with weights that are not the updated "
                                f"master of its shard group (stale?) in {len(bad)} tensors (digests)",
                                step=step,
                                ranks=(rank,),
                                tensor=bad[0],
                            )
                    continue
                checked += 1
                expected = master.astype(so.gathered.dtype)
                mask = bitwise_diff(so.gathered, expected)
                if mask.any():
                    idx = np.arange(mask.size)
                    tensor, interval, e, g, msg = describe_mismatch(layout, idx, mask, so.gathered, expected)
                    col.add(
                        "matches_master",
                        f"rank {rank} computes with weights that are not the updated master "
                        f"of its shard group (stale?): {msg}",
                        step=step,
                        ranks=(rank,),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                    )
    observed = any(s.gathered is not None or s.gathered_digest for o in observations for s in o.steps)
    if not observed:
        v = step_verdict(col, skipped="no gathered weights were observed (observe='none')")
    else:
        v = step_verdict(col, steps=len(steps), ranks=len(observations))
    v.checked = checked
    return v


def _trainer_identity(records: Sequence[TrainerStep], contract: str) -> Verdict:
    """C-ZERO-003 on a live trainer's full parameters; the ranks outside the majority are named."""
    out = ViolationCollector(contract, total=MAX_LISTED)
    max_abs = 0.0
    for rec in records:
        if len(rec.ranks) < 2:
            continue
        for name in rec.ref.params:
            arrays = [np.ascontiguousarray(o.params[name]) for o in rec.ranks]
            groups: dict[bytes, list[int]] = {}
            for i, a in enumerate(arrays):
                groups.setdefault(a.tobytes(), []).append(i)
            if len(groups) == 1:
                continue
            majority = max(groups.values(), key=lambda members: (len(members), -members[0]))
            base = arrays[majority[0]].reshape(-1)
            for members in groups.values():
                if members is majority:
                    continue
                for i in members:
                    a = arrays[i].reshape(-1)
                    differ = (element_bytes(a) != element_bytes(base)).any(axis=1)
                    start, stop = first_run(differ)
                    err = float(np.max(np.abs(a.astype(np.float64) - base.astype(np.float64))))
                    max_abs = max(max_abs, err)
                    out.add(
                        "identical",
                        f"{int(differ.sum())} of {a.size} elements differ bitwise from rank(s) "
                        f"{','.join(str(rec.ranks[m].rank) for m in majority)}",
                        phase=rec.phase, step=rec.step, ranks=(rec.ranks[i].rank,), tensor=name,
                        interval=(start, stop), expected=float(base[start]), got=float(a[start]), error=err,
                        tolerance=0.0,
                    )
    checked = sum(len(rec.ranks) for rec in records)
    return out.listed_verdict(checked=checked, max_error=max_abs, tolerance=0.0)


def _and(ranks: Sequence[int]) -> str:
    """``0 and 1``, ``0, 1 and 2``: ranks named in a sentence."""
    text = [str(r) for r in ranks]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " and " + text[-1]


def _digest_identity(observations: Sequence[MonitorObservation], contract: str) -> Verdict:
    """C-ZERO-003 on a monitored run: per step, the ranks holding one piece (tensor, flat range) hold one
    digest; each rank outside the majority is named with the tensor and the range. An empty digest (a
    piece the monitor did not digest, as no other rank held it) is not compared."""
    out = ViolationCollector(contract, total=MAX_LISTED)
    compared = 0
    pieces: dict[int, dict[tuple[str, int, int], dict[str, list[int]]]] = {}
    departed = {(obs.step, obs.rank) for obs in observations if departs(obs)}
    for obs in observations:
        at = pieces.setdefault(obs.step, {})
        for name, start, stop, dig in obs.held:
            if not dig:  # not digested: no other rank held the piece when it was observed
                continue
            at.setdefault((name, start, stop), {}).setdefault(dig, []).append(obs.rank)
    for step in sorted(pieces):
        for (name, start, stop), by_digest in pieces[step].items():
            holders = sorted(r for ranks in by_digest.values() for r in ranks)
            if len(holders) < 2:
                continue
            compared += 1
            if len(by_digest) == 1:
                continue
            sizes = sorted((len(m) for m in by_digest.values()), reverse=True)
            digest_of = {r: d for d, members in by_digest.items() for r in members}
            sound = {digest_of[r] for r in holders if (step, r) not in departed}
            # ranks whose own update departs from their optimizer's formula and whose copy no rank with a
            # sound update holds: named, with a majority or without one (a majority can be wrong)
            evidence = [r for r in holders if (step, r) in departed and digest_of[r] not in sound]
            if evidence and sound:
                others = [r for r in holders if r not in evidence]
                for rank in evidence:
                    out.add("identical", f"rank {rank}'s copy of {name}[{start}:{stop}] differs bitwise from "
                            f"rank(s) {','.join(map(str, others))}, and rank {rank}'s update departs from "
                            "its optimizer's formula (C-ZERO-002 update)",
                            step=step, ranks=(rank,), tensor=name, interval=(start, stop))
                # the sound ranks' copies are compared among themselves as below
                by_digest = {d: m for d, m in by_digest.items() if d in sound}
                holders = sorted(r for ranks in by_digest.values() for r in ranks)
                if len(by_digest) == 1:
                    continue
                sizes = sorted((len(m) for m in by_digest.values()), reverse=True)
            if sizes[0] == sizes[1]:  # no majority: which copy is wrong is not known, so none is named
                copies = "; ".join(f"rank(s) {_and(sorted(m))}: digest {d}" for d, m in by_digest.items())
                out.add(
                    "identical",
                    f"ranks {_and(holders)} disagree on {name}[{start}:{stop}]: {len(by_digest)} different "
                    f"copies ({copies})",
                    step=step, ranks=tuple(holders), tensor=name, interval=(start, stop),
                )
                continue
            majority = max(by_digest.values(), key=lambda members: (len(members), -min(members)))
            for dig, members in by_digest.items():
                if members is majority:
                    continue
                for rank in sorted(members):
                    out.add(
                        "identical",
                        f"rank {rank}'s copy of {name}[{start}:{stop}] differs bitwise from rank(s) "
                        f"{','.join(map(str, sorted(majority)))} (digest {dig}, theirs "
                        f"{next(d for d, m in by_digest.items() if m is majority)})",
                        step=step, ranks=(rank,), tensor=name, interval=(start, stop),
                    )
    return out.listed_verdict(checked=compared, steps=len(pieces))
