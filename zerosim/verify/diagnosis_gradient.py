"""Diagnoses of the size of the gradient step (C-ZERO-002, C-ZERO-008): the first SGD update is the
reference's gradient step times a constant factor (``gradient-scale``), times the number of
micro-batches (``accumulation-sum``), or one micro-batch's gradient alone (``accumulation-dropped``);
the logged norm is one rank's share of it (``logged-norm``). The catalogue and its order are in
:mod:`zerosim.verify.diagnosis`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zerosim.values.verdict import Verdict

from .diagnosis_evidence import first_sgd_update, flat
from .diagnosis_groups import common_factor as _common_factor
from .observation import StepRecord
from .outcome import Diagnosis

FACTOR_AGREEMENT = 0.9  # share of the large-gradient elements that must show the same factor (within 1%)


def accumulation(records: Sequence[StepRecord]) -> list[Diagnosis]:
    """``accumulation-sum`` / ``accumulation-dropped`` from the first SGD update (module docstring)."""
    first = first_sgd_update(records)
    if first is None or len(first[0].ref.micro_grads) < 2:
        return []
    rec, g = first
    names = list(rec.ref.params_before)
    k = len(rec.ref.micro_grads)
    found = _common_factor(g, flat(rec.ref.grad, names))
    if found is not None and found[1] >= FACTOR_AGREEMENT and abs(found[0] - k) <= 0.01 * k:
        return [Diagnosis(
            "accumulation-sum",
            f"the first SGD update (step {rec.step}) is the reference's gradient step times {found[0]:.4g} "
            f"= the {k} micro-batches per step: the micro-batch gradients were summed, not averaged "
            "(the loss of each micro-batch not divided by K)",
        )]
    for j, micro in enumerate(rec.ref.micro_grads):
        fit = _common_factor(g, flat(micro, names))
        if fit is not None and fit[1] >= FACTOR_AGREEMENT and abs(fit[0]) > 1e-12:
            return [Diagnosis(
                "accumulation-dropped",
                f"the first SGD update (step {rec.step}) is {fit[0]:.4g} x the gradient of micro-batch {j} "
                f"of {k} alone (mean over ranks) on {fit[1]:.0%} of its large elements: the other "
                "micro-batches' gradients were dropped (zeroed between micro-batches, or not accumulated)",
            )]
    return []


def gradient_scale(records: Sequence[StepRecord]) -> list[Diagnosis]:
    first = first_sgd_update(records)
    if first is None:
        return []
    rec, g = first
    world = len(rec.ranks)
    r = flat(rec.ref.grad, list(rec.ref.params_before))
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


def logged_norm(records: Sequence[StepRecord], outcome: Verdict | None) -> list[Diagnosis]:
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
