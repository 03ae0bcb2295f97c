"""Where to look when a contract fails: the likely bug class, named from the observations, with evidence.

:func:`diagnose` is a pure function of the step records (every rank's values next to the reference
and the bound) and the contract outcomes. It returns every class whose signature is present, most
specific first (the fixed vocabulary :data:`zerosim.verify.outcome.BUG_CLASSES`):

* ``overlapping-shards``: C-ZERO-001 found ranks that own the same elements (and are not replicas).
* ``unowned-elements``: elements that no rank owns (C-ZERO-001), or that never moved over a phase
  while the reference moved them beyond the bound (a remainder with no owner).
* ``gradient-scale``: the first SGD update equals the reference's gradient step times a constant
  factor (world: summed, not averaged; 1/world: averaged twice); or the update of one group of
  tensors does (the experts of a mixture of experts), named (:mod:`zerosim.verify.diagnosis_groups`).
* ``gradient-not-reduced``: one group of replicated tensors stepped with each rank's own gradient
  (:mod:`zerosim.verify.diagnosis_groups`; checked before ``replicas-not-reduced``).
* ``matrix-optimizer-on-shard``: a matrix optimizer (Adafactor, Muon, a user's) stepped on slices
  of its tensors (:mod:`zerosim.verify.diagnosis_matrix`).
* ``muon-rounding-order``: a failing Muon update nearer float64 Muon of whole tensors than of the
  ranks' row blocks: whole tensors orthogonalised, bfloat16 rounded in another order
  (:mod:`zerosim.verify.diagnosis_matrix`).
* ``permuted-shards``: the values are the reference's, in the wrong places (a gather in the wrong order).
* ``clip-norm``: the divergence starts at a step where the clip binds, the phase's first such step
  (or the failing phase is the only one whose clip binds): a norm over the wrong set of elements, or,
  when every rank holds AdamW's unclipped update there, no clip at all.
* ``rank-local``: every differing element at the first failing step lies in the ranges one rank (or
  one replica group) owns: that rank's optimizer or its shard of the reduction.
* ``late-divergence``: the phase matches for k-1 steps and diverges at step k > 1 (state, counters,
  zeroing).
* ``replicas-not-reduced``: at the first failing SGD step the ranks fall into replicas (the shard
  groups of the run's mesh, or else the groups of ranks holding bitwise the same values), each
  replica's update differs and their mean is the reference's: each replica averaged its gradient over
  its own ranks only, the all-reduce across replicas is missing.
* ``ranks-disagree``: ranks hold different full parameters (gather, broadcast, replica drift; a rank
  whose values equal the previous step's is named stale).
* ``ranks-agree-wrong``: at the first failing step every rank agrees bitwise, yet not with the
  reference (the reduction or the optimizer math).
* ``accumulation-sum`` (gradient accumulation over K micro-batches): the first SGD update is K times
  the reference's: the micro-batch gradients were summed, not averaged.
* ``accumulation-dropped``: the first SGD update is a multiple of one micro-batch's gradient alone
  (mean over ranks): the other micro-batches' gradients were dropped (zeroed between micro-batches).
* ``logged-norm``: C-ZERO-008 failed: the gradient norm the trainer logs is not the norm of the
  gradient it stepped with; named "the norm of the elements one rank owns" when it is that.

Under a mixed-precision policy (:func:`diagnose_mixed`):

* ``no-fp32-master``: at the first failing step every rank's "masters" are values of the compute dtype
  (bf16: the low 16 bits of every float32 are zero) while the reference's are not: the trainer keeps
  no float32 master, and updates smaller than half a bf16 ulp of the weight are lost.
* ``master-init``: at the first failing step every rank's masters differ from the reference's by the
  compute dtype's rounding of the masters the step started from (the model's float32 values, at a
  phase's first step): the float32 masters were made from the ``param_dtype``-cast weights, not from
  the float32 values the model arrived with (DeepSpeed's ``deepspeed.initialize`` does this).
* ``reduce-dtype``: a gradient reduction moved another dtype than the policy's ``reduce_dtype``
  (C-ZERO-005's traffic records; numerically such a run can look right).
* ``loss-scale`` (fp16): the update is the reference's times the loss scale (unscale missing) or
  divided by it (unscaled twice); the clip bound the scaled gradient (its factor is the clip's on a
  gradient the scale times larger); a step overflowed and was taken, or was skipped without an
  overflow; or the logged norm is the scaled one.

Why one module of this length: the classes are read off the same first failing step and the same
owned ranges, and their order (most specific first) is one decision, kept in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.observe import TrainerObservation

from .diagnosis_groups import common_factor as _common_factor
from .diagnosis_groups import group_gradient_scale, group_logged_norm, group_not_reduced
from .diagnosis_matrix import matrix_optimizer_on_shard
from .observation import StepRecord
from .outcome import ContractOutcome, Diagnosis

FACTOR_AGREEMENT = 0.9  # share of the large-gradient elements that must show the same factor (within 1%)


def _failing(rec: StepRecord, obs: TrainerObservation) -> dict[str, np.ndarray]:
    """Per tensor, the mask of elements of ``obs`` beyond the bound at ``rec``."""
    out = {}
    for name, exp in rec.ref.params.items():
        err = np.abs(obs.params[name].astype(np.float64).reshape(-1) - exp.reshape(-1))
        mask = err > rec.bounds.params[name].reshape(-1)
        if mask.any():
            out[name] = mask
    return out


def _state_failing(rec: StepRecord, obs: TrainerObservation) -> bool:
    for name, entry in (obs.state or {}).items():
        ref = rec.ref.state.get(name, {})
        for key, got in entry.items():
            if key not in ref:
                continue
            if key == "step":
                if float(np.asarray(got).reshape(-1)[0]) != float(np.asarray(ref[key]).reshape(-1)[0]):
                    return True
                continue
            bound = rec.bounds.state.get(name, {}).get(key)
            if bound is not None and (np.abs(np.asarray(got, dtype=np.float64) - ref[key]) > bound).any():
                return True
    return False


def _record_fails(rec: StepRecord) -> bool:
    return any(_failing(rec, o) or _state_failing(rec, o) for o in rec.ranks)


def _majority(rec: StepRecord) -> TrainerObservation:
    """The observation most ranks hold bitwise (ties: the lowest rank)."""
    keys = [b"".join(np.ascontiguousarray(o.params[n]).tobytes() for n in rec.ref.params) for o in rec.ranks]
    counts = {k: keys.count(k) for k in keys}
    best = max(range(len(keys)), key=lambda i: (counts[keys[i]], -i))
    return rec.ranks[best]


def _ranks_agree(rec: StepRecord) -> bool:
    first = rec.ranks[0]
    return all(
        np.array_equal(
            np.ascontiguousarray(o.params[n]).view(np.uint8),
            np.ascontiguousarray(first.params[n]).view(np.uint8),
        )
        for o in rec.ranks[1:]
        for n in rec.ref.params
    )


def _ranges(mask: np.ndarray, limit: int = 3) -> str:
    padded = np.concatenate([[False], mask, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    pairs = [f"[{a}:{b}]" for a, b in zip(edges[::2][:limit], edges[1::2][:limit], strict=True)]
    more = len(edges) // 2 - limit
    return ", ".join(pairs) + (f" and {more} more range(s)" if more > 0 else "")


def diagnose(
    records: Sequence[StepRecord], contracts: dict[str, ContractOutcome], mesh: tuple[int, int] | None = None
) -> list[Diagnosis]:
    """Every bug class whose signature the observations show, most specific first (module docstring);
    ``mesh`` = (replicas, shard group size) when the run names one."""
    found: list[Diagnosis] = []
    own = contracts.get("C-ZERO-001")
    found += _overlap(own)
    norm = contracts.get("C-ZERO-008")  # its diagnosis comes last: a wrong gradient explains it
    logged = group_logged_norm(records, norm) or _logged_norm(records, norm)
    if not records:
        return found + logged
    first_bad = next((r for r in records if _record_fails(r)), None)
    found += _unowned(records, own)
    if first_bad is None and not found:
        disagree = _disagree(records, contracts)
        return disagree + logged
    found += _accumulation(records)
    found += _gradient_scale(records)
    first_sgd = _first_sgd_update(records)
    if first_sgd is not None:  # one group of tensors scaled (diagnosis_groups)
        found += group_gradient_scale(*first_sgd, _majority(first_sgd[0]).params)
    if first_bad is not None:
        found += matrix_optimizer_on_shard(first_bad)
        found += _permuted(first_bad)
        found += group_not_reduced(first_bad) or _replicas_not_reduced(first_bad, mesh)
        found += _clip(records, first_bad)
        found += _rank_local(first_bad)
        found += _late(records, first_bad)
    found += _disagree(records, contracts)
    if first_bad is not None and _ranks_agree(first_bad):
        obs = first_bad.ranks[0]
        bad = _failing(first_bad, obs)
        where = ", ".join(f"{n}{_ranges(m, 1)}" for n, m in list(bad.items())[:3]) or "optimizer state"
        found.append(
            Diagnosis(
                "ranks-agree-wrong",
                f"at step {first_bad.step} ({first_bad.phase}) every rank holds "
                f"bitwise the same parameters, yet they differ from the reference in {where}"
                f"{_counter_note(first_bad)}: look at the gradient reduction or the optimizer math, "
                "not at the gather",
            )
        )
    return found + logged


def _counter_note(rec: StepRecord) -> str:
    """'; the optimizer step counter is 2, torch.optim's 1' when a rank exposes a counter that differs."""
    for obs in rec.ranks:
        for name, entry in (obs.state or {}).items():
            if "step" in entry and "step" in rec.ref.state.get(name, {}):
                got = float(np.asarray(entry["step"]).reshape(-1)[0])
                exp = float(np.asarray(rec.ref.state[name]["step"]).reshape(-1)[0])
                if got != exp:
                    return f"; rank {obs.rank}'s optimizer step counter is {got:g}, torch.optim's {exp:g}"
    return ""


def _overlap(own: ContractOutcome | None) -> list[Diagnosis]:
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


def _unowned(records: Sequence[StepRecord], own: ContractOutcome | None) -> list[Diagnosis]:
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
                f"{names[i]}{_ranges(local)}; flat range {int(idx[0])}..{int(idx[-1]) + 1} of "
                f"{stuck.size}{tail}: a remainder no rank owns",
            )
        ]
    return []


def _first_sgd_update(records: Sequence[StepRecord]) -> tuple[StepRecord, np.ndarray] | None:
    """The first SGD step when it fails, and the gradient its majority update implies (the update
    divided by the learning rate, weight decay taken off), flattened in parameter order."""
    rec = next((r for r in records if r.phase == "sgd" and r.ref.phase_step == 1), None)
    if rec is None or not _record_fails(rec):
        return None
    obs = _majority(rec)
    lr = _sgd_lr(rec)
    wd = _sgd_wd(rec)
    if lr is None:
        return None
    got = []
    for n, before in rec.ref.params_before.items():
        decay = wd * before.reshape(-1)
        got.append((before.reshape(-1) - obs.params[n].astype(np.float64).reshape(-1)) / lr - decay)
    return rec, np.concatenate(got)


def _flat(grads: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([grads[n].reshape(-1) for n in names])


def _accumulation(records: Sequence[StepRecord]) -> list[Diagnosis]:
    """``accumulation-sum`` / ``accumulation-dropped`` from the first SGD update (module docstring)."""
    first = _first_sgd_update(records)
    if first is None or len(first[0].ref.micro_grads) < 2:
        return []
    rec, g = first
    names = list(rec.ref.params_before)
    k = len(rec.ref.micro_grads)
    found = _common_factor(g, _flat(rec.ref.grad, names))
    if found is not None and found[1] >= FACTOR_AGREEMENT and abs(found[0] - k) <= 0.01 * k:
        return [Diagnosis(
            "accumulation-sum",
            f"the first SGD update (step {rec.step}) is the reference's gradient step times {found[0]:.4g} "
            f"= the {k} micro-batches per step: the micro-batch gradients were summed, not averaged "
            "(the loss of each micro-batch not divided by K)",
        )]
    for j, micro in enumerate(rec.ref.micro_grads):
        fit = _common_factor(g, _flat(micro, names))
        if fit is not None and fit[1] >= FACTOR_AGREEMENT and abs(fit[0]) > 1e-12:
            return [Diagnosis(
                "accumulation-dropped",
                f"the first SGD update (step {rec.step}) is {fit[0]:.4g} x the gradient of micro-batch {j} "
                f"of {k} alone (mean over ranks) on {fit[1]:.0%} of its large elements: the other "
                "micro-batches' gradients were dropped (zeroed between micro-batches, or not accumulated)",
            )]
    return []


def _logged_norm(records: Sequence[StepRecord], outcome: ContractOutcome | None) -> list[Diagnosis]:
    """``logged-norm`` when C-ZERO-008 failed; names the rank's own elements when the logged norm is
    the norm of the reference's gradient over exactly the ranges that rank owns."""
    if outcome is None or outcome.status != "fail":
        return []
    first = outcome.first_violation or {}
    step, rank = first.get("step"), first.get("rank")
    rec = next((r for r in records if r.step == step), None)
    evidence = outcome.reason
    if rec is not None and rank is not None and rank < len(rec.ranks):
        obs = rec.ranks[rank]
        if obs.shards and obs.grad_norm is not None:
            squares = sum(float(np.sum(np.square(rec.ref.grad[n].reshape(-1)[a:b])))
                          for n, ranges in obs.shards.items() for a, b in ranges)
            own = squares ** 0.5
            if abs(own - obs.grad_norm) <= 1e-6 * max(own, 1e-300):
                evidence = (f"rank {rank} logged {obs.grad_norm:.6g} at step {step}: the norm of the "
                            f"reference's gradient over the elements rank {rank} owns ({own:.6g}), not over "
                            f"all of them ({rec.ref.grad_norm:.6g}): the norm is not reduced across ranks")
    return [Diagnosis("logged-norm", evidence)]


def _gradient_scale(records: Sequence[StepRecord]) -> list[Diagnosis]:
    first = _first_sgd_update(records)
    if first is None:
        return []
    rec, g = first
    world = len(rec.ranks)
    r = _flat(rec.ref.grad, list(rec.ref.params_before))
    found = _common_factor(g, r)
    if found is None:
        return []
    factor, share = found
    if abs(factor - 1) < 1e-3 or share < FACTOR_AGREEMENT:
        return []
    k = len(rec.ref.micro_grads)
    if k > 1 and abs(factor - k) <= 0.01 * k and abs(factor - world) > 0.01 * world:
        return []  # accumulation-sum says it
    meaning = ""
    if abs(factor - world) <= 0.01 * world:
        meaning = f" = the world size {world}: gradients summed over ranks, not averaged"
    elif abs(factor - 1 / world) <= 0.01 / world:
        meaning = f" = 1/world (world {world}): gradients divided by the world size twice"
    return [
        Diagnosis(
            "gradient-scale",
            f"the first SGD update (step {rec.step}) is the reference's gradient "
            f"step times {factor:.4g} on {share:.0%} of "
            f"the large-gradient elements{meaning}",
        )
    ]


def _sgd_lr(rec: StepRecord) -> float | None:
    # lr from the reference's own step: p_before - p_after = lr (g + wd p_before) at SGD's first step;
    # a tensor whose gradient was None is left out: torch.optim does not step it, decay included
    num = den = 0.0
    wd = _sgd_wd(rec)
    for n, before in rec.ref.params_before.items():
        if not np.any(rec.ref.grad[n]):
            continue
        d = before.reshape(-1) - rec.ref.params[n].reshape(-1)
        s = rec.ref.grad[n].reshape(-1) + wd * before.reshape(-1)
        num += float(d @ s)
        den += float(s @ s)
    return num / den if den > 0 else None


def _sgd_wd(rec: StepRecord) -> float:
    # weight decay from the momentum buffer after the first step: buf = g + wd p_before
    num = den = 0.0
    for n, before in rec.ref.params_before.items():
        buf = rec.ref.state.get(n, {}).get("momentum_buffer")
        if buf is None:
            continue
        num += float((buf.reshape(-1) - rec.ref.grad[n].reshape(-1)) @ before.reshape(-1))
        den += float(before.reshape(-1) @ before.reshape(-1))
    return num / den if den > 0 else 0.0


def _permuted(rec: StepRecord) -> list[Diagnosis]:
    obs = _majority(rec)
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


def _key(rec: StepRecord, obs: TrainerObservation) -> bytes:
    """The bytes of every parameter ``obs`` holds (equal keys: bitwise the same values)."""
    return b"".join(np.ascontiguousarray(obs.params[n]).tobytes() for n in rec.ref.params)


def _replica_groups(rec: StepRecord, mesh: tuple[int, int] | None) -> list[list[int]] | None:
    """Positions in ``rec.ranks`` of each replica: the mesh's shard groups (None when the ranks of one
    disagree), or else the groups of ranks holding bitwise the same parameters."""
    keys = [_key(rec, o) for o in rec.ranks]
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


def _replicas_not_reduced(rec: StepRecord, mesh: tuple[int, int] | None) -> list[Diagnosis]:
    if rec.phase != "sgd":  # SGD's step is linear in the gradient: the replicas' mean is the reference's
        return []
    groups = _replica_groups(rec, mesh)
    if groups is None or len(groups) < 2 or len({len(g) for g in groups}) != 1:
        return []
    heads = [rec.ranks[g[0]] for g in groups]
    if len({_key(rec, o) for o in heads}) < 2:
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


def _phase_records(records: Sequence[StepRecord], phase: str) -> list[StepRecord]:
    return [r for r in records if r.phase == phase]


def _clip(records: Sequence[StepRecord], first_bad: StepRecord) -> list[Diagnosis]:
    """``clip-norm`` when the divergence starts at a step where the clip binds and that step is the
    phase's first binding one, or the failing phase is the only one whose clip binds."""
    phase = _phase_records(records, first_bad.phase)
    binding = [r for r in phase if r.ref.clip_bound]
    if not first_bad.ref.clip_bound:
        return []
    clipped_phases = {r.phase for r in records if r.ref.clip_bound}
    if binding[0] is not first_bad and clipped_phases != {first_bad.phase}:
        return []
    matched = (
        f"steps {phase[0].step}-{first_bad.step - 1} of the {first_bad.phase} phase match the reference; "
        if first_bad.step > phase[0].step
        else ""
    )
    which = "the first step" if binding[0] is first_bad else "a step"
    start = (
        f"{matched}the divergence starts at step {first_bad.step}, {which} where the clip binds (global "
        f"gradient norm {first_bad.ref.grad_norm:.4g}, clip factor {first_bad.ref.clip_coef:.4g})"
    )
    if _unclipped_update(phase, first_bad):
        cause = (
            ": every rank's update there is the unclipped one (max_grad_norm "
            f"{(first_bad.optim or {}).get('max_grad_norm')}): the trainer does not clip at all"
        )
    else:
        cause = (
            ": the norm is likely taken over the wrong set of elements (a local shard, or without the "
            "other ranks' contributions)"
        )
    return [Diagnosis("clip-norm", start + cause)]


def _unclipped_update(phase: Sequence[StepRecord], rec: StepRecord) -> bool:
    """Every rank holds, at ``rec``, AdamW's step with the unclipped gradient from the reference's state
    before it (torch.optim.AdamW's update replayed in float64; steps before ``rec`` matched)."""
    optim = rec.optim or {}
    if optim.get("name") != "adamw":
        return False
    prev = next((r for r in phase if r.ref.phase_step == rec.ref.phase_step - 1), None)
    if rec.ref.phase_step > 1 and prev is None:
        return False
    lr, wd, eps = float(optim["lr"]), float(optim.get("weight_decay", 0.0)), float(optim.get("eps", 1e-8))
    b1, b2 = (float(b) for b in optim.get("betas", (0.9, 0.999)))
    t = rec.ref.phase_step
    for n, before in rec.ref.params_before.items():
        g = rec.ref.grad[n].astype(np.float64)
        state = prev.ref.state.get(n, {}) if prev is not None else {}
        m = b1 * state.get("exp_avg", np.zeros_like(g)) + (1 - b1) * g
        v = b2 * state.get("exp_avg_sq", np.zeros_like(g)) + (1 - b2) * g * g
        expected = before * (1 - lr * wd) - (lr / (1 - b1**t)) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + eps)
        slack = rec.bounds.params[n] + 64 * np.finfo(np.float64).eps * (np.abs(before) + lr)
        for o in rec.ranks:
            if (np.abs(o.params[n].astype(np.float64) - expected) > slack).any():
                return False
    return True


def _rank_local(rec: StepRecord) -> list[Diagnosis]:
    if any(o.shards is None for o in rec.ranks):
        return []
    obs = _majority(rec)
    bad = _failing(rec, obs)
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
    where = "; ".join(f"{n}{_ranges(m)}" for n, m in list(bad.items())[:3])
    return [
        Diagnosis(
            "rank-local",
            f"at step {rec.step} every element that differs from the reference lies in "
            f"the ranges {label} owns ({where}): look at that rank's optimizer step or its shard of the "
            "gradient reduction",
        )
    ]


def _late(records: Sequence[StepRecord], first_bad: StepRecord) -> list[Diagnosis]:
    if first_bad.ref.phase_step <= 1:
        return []
    phase = _phase_records(records, first_bad.phase)
    return [
        Diagnosis(
            "late-divergence",
            f"the {first_bad.phase} phase matches the reference for "
            f"{first_bad.ref.phase_step - 1} step(s) (steps {phase[0].step}-{first_bad.step - 1}) and "
            f"diverges from step {first_bad.step}: look at state carried between steps (optimizer "
            "state, step counters, gradient zeroing, a rank that stops updating)",
        )
    ]


def _disagree(records: Sequence[StepRecord], contracts: dict[str, ContractOutcome]) -> list[Diagnosis]:
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
    return not _failing(rec, obs)


def bug_classes(diagnosis: Sequence[Diagnosis]) -> list[str]:
    """The classes named, in order (for tests and the --all matrix)."""
    return [d.bug_class for d in diagnosis]


def diagnose_mixed(records: Sequence[Any], contracts: dict[str, ContractOutcome],
                   reduce_verdicts: Sequence[Any] = ()) -> list[Diagnosis]:
    """The mixed-precision classes (module docstring) from :class:`~zerosim.checks.mixed_precision.
    MixedPrecisionStep` records, the contract outcomes and C-ZERO-005's ``reduce_dtype`` verdicts."""
    found: list[Diagnosis] = []
    wrong = [v for verdict in reduce_verdicts for v in verdict.violations]
    if wrong:
        found.append(Diagnosis("reduce-dtype", f"{wrong[0].message}: the gradient was reduced in another "
                               f"dtype than the policy's reduce_dtype ({len(wrong)} reductions)"))
    equivalence = contracts.get("C-ZERO-002")
    violations = equivalence.violations if equivalence is not None else []
    scale_faults = [v for v in violations if v.get("clause") == "loss_scale"]
    if scale_faults:
        found.append(Diagnosis("loss-scale", str(scale_faults[0].get("message", ""))))
    first = next((v for v in violations if v.get("clause") in ("master_dtype", "master_init",
                                                               "normwise_update", "step_counter")), None)
    rec = next((r for r in records if first is not None and r.step == first.get("step")), None)
    if rec is not None:
        found += _no_master(rec) or _rounded_start(rec) or _scaled_update(rec)
    norm = contracts.get("C-ZERO-008")
    if norm is not None and norm.status == "fail" and not any(d.bug_class == "loss-scale" for d in found):
        v = norm.violations[0] if norm.violations else {}
        got, exp = v.get("got"), v.get("expected")
        scale = next((r.scale for r in records if r.step == v.get("step")), None)
        if scale and got and exp and abs(got / exp / scale - 1) < 0.1:
            found.append(Diagnosis("loss-scale", f"the logged norm at step {v.get('step')} is the scaled one "
                                   f"({got:.4g} = {scale:g} x the reference's {exp:.4g}): the norm was "
                                   "taken before unscaling"))
        else:
            found.append(Diagnosis("logged-norm", str(v.get("message", norm.reason))))
    return found


def _low_precision_values(a: np.ndarray, dtype: str) -> bool:
    from zerosim.checks.mixed_precision import compute_dtype_values

    return bool(compute_dtype_values(a, dtype).all())


def _no_master(rec: Any) -> list[Diagnosis]:
    dtype = rec.param_dtype
    names = [n for n in rec.ref if np.asarray(rec.ref[n]).size > 1]
    if not all(_low_precision_values(obs.params[n], dtype) for obs in rec.ranks for n in names):
        return []
    if all(_low_precision_values(rec.ref[n], dtype) for n in names):
        return []
    lost, total = 0, 0
    for n in names:
        before = np.asarray(rec.before[n], np.float64)
        update = np.abs(np.asarray(rec.ref[n], np.float64) - before)
        half_ulp = np.abs(before) * 2.0 ** -(8 if dtype == "bfloat16" else 11)
        lost += int((update < half_ulp).sum())
        total += update.size
    return [Diagnosis("no-fp32-master", f"at step {rec.step} ({rec.phase}) every rank's masters are {dtype} "
                      f"values: the trainer keeps no float32 master; {lost} of {total} elements of the "
                      f"reference's update are below half a {dtype} ulp of the weight and are lost")]


def _rounded_start(rec: Any) -> list[Diagnosis]:
    """``master-init`` (module docstring): on every rank the compute-dtype rounding of the masters the step
    started from explains the offset from the reference
    (:func:`zerosim.checks.mixed_precision.rounded_start_share`)."""
    from zerosim.checks.mixed_precision import ROUNDED_START_MATCH, rounded_start_share

    shares = [rounded_start_share(rec, obs) for obs in rec.ranks]
    if not shares or any(s is None or s >= ROUNDED_START_MATCH for s in shares):
        return []
    worst = max(s for s in shares if s is not None)
    return [Diagnosis("master-init", f"at step {rec.step} ({rec.phase}) every rank's masters are the "
                      f"reference's plus the {rec.param_dtype} rounding of the masters the step started from "
                      f"(it leaves {worst:.2g} of the difference): the float32 masters were made from the "
                      f"{rec.param_dtype}-cast weights, not from the float32 values the model arrived with")]


def _scaled_update(rec: Any) -> list[Diagnosis]:
    """``loss-scale`` when the trainer's change (of the momentum / exp_avg state where exposed, else of the
    masters) is the reference's times the scale, over it, or the clip's factor on a scaled gradient."""
    if rec.scale is None:
        return []
    obs = rec.ranks[0]
    key = next((k for k in ("momentum_buffer", "exp_avg") if obs.state and all(
        k in e for e in obs.state.values()) and all(k in e for e in rec.ref_state.values())), None)
    if key is not None:
        # the gradient each state implies: buf' = mu buf + g (SGD), m' = b1 m + (1 - b1) g (AdamW)
        optim = rec.extra.get("optim") or {}
        keep = float(optim.get("momentum", 0.0)) if key == "momentum_buffer" else float(
            tuple(optim.get("betas", (0.9, 0.999)))[0])
        scale_by = 1.0 if key == "momentum_buffer" else 1.0 - keep
        decay = float(optim.get("weight_decay", 0.0)) if key == "momentum_buffer" else 0.0  # SGD's is in g
        start = {n: keep * np.ravel(rec.state_before.get(n, {}).get(key, 0.0))
                 + decay * np.ravel(rec.before[n]) for n in rec.ref_state}
        got = np.concatenate([np.ravel(obs.state[n][key]) - start[n] for n in rec.ref_state]) / scale_by
        exp = np.concatenate([np.ravel(rec.ref_state[n][key]) - start[n] for n in rec.ref_state]) / scale_by
    else:
        got = np.concatenate([np.ravel(obs.params[n]) - np.ravel(rec.before[n]) for n in rec.ref])
        exp = np.concatenate([np.ravel(rec.ref[n]) - np.ravel(rec.before[n]) for n in rec.ref])
    denom = float(exp @ exp)
    if denom == 0:
        return []
    factor = float(got @ exp) / denom
    where = (f"at step {rec.step} ({rec.phase}) the trainer's {key or 'update'} is {factor:.4g} x the "
             "reference's")
    max_norm = rec.extra.get("max_grad_norm")
    if max_norm and rec.grad_norm > 0:  # first: with a clip near the norm, 1/scale is also its factor
        scaled_clip = min(1.0, max_norm / (rec.scale * rec.grad_norm)) / min(1.0, max_norm / rec.grad_norm)
        if scaled_clip < 0.9 and abs(factor / scaled_clip - 1) < 0.1:
            return [Diagnosis("loss-scale", f"{where}, the factor a clip at {max_norm:g} applies to a "
                              f"gradient {rec.scale:g} times larger: the clip ran on the scaled gradients")]
    if abs(factor / rec.scale - 1) < 0.1:
        return [Diagnosis("loss-scale", f"{where} (the loss scale is {rec.scale:g}): the gradients were not "
                          "unscaled")]
    if abs(factor * rec.scale - 1) < 0.1:
        return [Diagnosis("loss-scale", f"{where} (1 / the loss scale {rec.scale:g}): the gradients were "
                          "unscaled twice")]
    return []
