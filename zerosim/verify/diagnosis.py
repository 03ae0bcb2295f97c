"""Where to look when a contract fails: the likely bug class, named from the observations, with evidence.

:func:`diagnose` is a pure function of the step records (every rank's values next to the reference
and the bound) and the contract outcomes. It returns every class whose signature is present, most
specific first (the fixed vocabulary :data:`zerosim.verify.outcome.BUG_CLASSES`):

* ``non-finite-weights``: a rank's full parameters hold a non-finite value (inf, NaN) where the
  float64 reference's are finite: named by tensor, first non-finite element, rank and step. The
  trainer's own arithmetic broke (an optimizer that divides by a zero second moment, an overflow):
  C-ZERO-002 fails, the run is no harness error. Listed first: what follows it is its consequence.
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

The order (most specific first) is one decision, kept here with the classes read off the timeline of
a phase (``clip-norm``, ``late-divergence``) and ``ranks-agree-wrong``; the signatures themselves live
by concept: the evidence every class reads (:mod:`zerosim.verify.diagnosis_evidence`), the size of the
gradient step (:mod:`zerosim.verify.diagnosis_gradient`), where values lie across ranks
(:mod:`zerosim.verify.diagnosis_placement`), groups of tensors (:mod:`zerosim.verify.diagnosis_groups`),
matrix optimizers (:mod:`zerosim.verify.diagnosis_matrix`) and mixed precision
(:mod:`zerosim.verify.diagnosis_mixed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zerosim.values.verdict import Verdict

from .diagnosis_evidence import (
    failing,
    first_sgd_update,
    majority,
    phase_records,
    ranges,
    ranks_agree,
    record_fails,
)
from .diagnosis_gradient import accumulation, gradient_scale, logged_norm
from .diagnosis_groups import group_gradient_scale, group_logged_norm, group_not_reduced
from .diagnosis_matrix import matrix_optimizer_on_shard
from .diagnosis_mixed import diagnose_mixed
from .diagnosis_placement import disagree, overlap, permuted, rank_local, replicas_not_reduced, unowned
from .observation import StepRecord
from .outcome import Diagnosis

__all__ = ["bug_classes", "diagnose", "diagnose_mixed"]


def diagnose(
    records: Sequence[StepRecord], contracts: dict[str, Verdict], mesh: tuple[int, int] | None = None
) -> list[Diagnosis]:
    """Every bug class whose signature the observations show, most specific first (module docstring);
    ``mesh`` = (replicas, shard group size) when the run names one."""
    found: list[Diagnosis] = non_finite(records)
    own = contracts.get("C-ZERO-001")
    found += overlap(own)
    norm = contracts.get("C-ZERO-008")  # its diagnosis comes last: a wrong gradient explains it
    logged = group_logged_norm(records, norm) or logged_norm(records, norm)
    if not records:
        return found + logged
    first_bad = next((r for r in records if record_fails(r)), None)
    found += unowned(records, own)
    if first_bad is None and not found:
        return disagree(records, contracts) + logged
    found += accumulation(records)
    found += gradient_scale(records)
    first_sgd = first_sgd_update(records)
    if first_sgd is not None:  # one group of tensors scaled (diagnosis_groups)
        found += group_gradient_scale(*first_sgd, majority(first_sgd[0]).params)
    if first_bad is not None:
        found += matrix_optimizer_on_shard(first_bad)
        found += permuted(first_bad)
        found += group_not_reduced(first_bad) or replicas_not_reduced(first_bad, mesh)
        found += _clip(records, first_bad)
        found += rank_local(first_bad)
        found += _late(records, first_bad)
    found += disagree(records, contracts)
    if first_bad is not None and ranks_agree(first_bad):
        obs = first_bad.ranks[0]
        bad = failing(first_bad, obs)
        where = ", ".join(f"{n}{ranges(m, 1)}" for n, m in list(bad.items())[:3]) or "optimizer state"
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


def non_finite(records: Sequence[StepRecord]) -> list[Diagnosis]:
    """``non-finite-weights`` (C-ZERO-002): the first step at which a rank's full parameters hold a
    non-finite value where the reference's are finite, naming the tensor, its first such element, the
    rank and the step; [] when every value the trainer returned is finite."""
    for rec in records:
        for obs in rec.ranks:
            for name, exp in rec.ref.params.items():
                got = np.asarray(obs.params[name]).reshape(-1)
                ref = np.asarray(exp).reshape(-1)
                bad = ~np.isfinite(got) & np.isfinite(ref)
                if not bad.any():
                    continue
                i = int(np.flatnonzero(bad)[0])
                others = [o.rank for o in rec.ranks if o.rank != obs.rank
                          and not np.isfinite(np.asarray(o.params[name]).reshape(-1)[i])]
                also = f" (and on rank(s) {', '.join(map(str, others))})" if others else ""
                return [Diagnosis(
                    "non-finite-weights",
                    f"at step {rec.step} ({rec.phase}) rank {obs.rank}'s full_parameters() hold "
                    f"{got[i]} in {name}[{i}]{also}, {int(bad.sum())} non-finite element(s) of that tensor, "
                    f"where the float64 reference holds {ref[i]:.6g}: the trainer's own arithmetic "
                    "produced it (an optimizer that divides by a zero second moment, an overflow)",
                )]
    return []


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


def _clip(records: Sequence[StepRecord], first_bad: StepRecord) -> list[Diagnosis]:
    """``clip-norm`` when the divergence starts at a step where the clip binds and that step is the
    phase's first binding one, or the failing phase is the only one whose clip binds."""
    phase = phase_records(records, first_bad.phase)
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


def _late(records: Sequence[StepRecord], first_bad: StepRecord) -> list[Diagnosis]:
    if first_bad.ref.phase_step <= 1:
        return []
    phase = phase_records(records, first_bad.phase)
    return [
        Diagnosis(
            "late-divergence",
            f"the {first_bad.phase} phase matches the reference for "
            f"{first_bad.ref.phase_step - 1} step(s) (steps {phase[0].step}-{first_bad.step - 1}) and "
            f"diverges from step {first_bad.step}: look at state carried between steps (optimizer "
            "state, step counters, gradient zeroing, a rank that stops updating)",
        )
    ]


def bug_classes(diagnosis: Sequence[Diagnosis]) -> list[str]:
    """The classes named, in order (for tests and the --all matrix)."""
    return [d.bug_class for d in diagnosis]
