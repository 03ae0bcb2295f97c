"""C-ZERO-002's bound against the ground truth for a matrix optimizer (Muon, Adafactor): estimated.

The derived per-element model (:mod:`zerosim.checks.rounding`) follows an optimizer whose update of an
element depends on that element alone; Muon's Newton-Schulz iteration and Adafactor's row / column
statistics and RMS-scaled step spread a difference over the whole tensor. So, as ``zerosim verify``
does for these optimizers, the bound is estimated from a perturbed twin of the ground truth:

* two twins train the same run from the same weights, free-running, with every step's mean gradient
  moved (before the norm) by the derived bound's reordering term, per element
  ``2 gamma_n (T_i + S)`` with ``T_i`` the mean of the local gradients' magnitudes, ``S`` its largest
  value in the tensor and ``gamma_n`` of the run's reduction length; under bf16/fp16 also the 16-bit
  rounding of the local gradients, ``2 u16 T_i + (K + 1) f16``; signs seeded per step, the second
  twin's the opposite of the first's, so every element a correct run's rounding could move across
  zero crosses it in one of them (where an Adam step, the AdamW part of the Muon recipe, turns a
  rounding-sized change into twice its learning rate);
* per tensor, for the parameters and each state array,
  ``bound = SAFETY x max(d_twin, gamma_n max|x|)``, ``d_twin`` the twins' largest distance from the
  ground truth in that tensor and ``x`` the ground truth's values there, the same for every element;
  the grad norm and clip factor likewise, from the twins' norms and factors.

SAFETY = 10: one perturbed sample of a correct run's spread, scaled. The perturbation is the
worst-case size of a reordered reduction's error, far above what a correct run's summation order
changes, and far below what stepping a slice of a tensor changes (which moves the update by O(lr)).
"""

from __future__ import annotations

import numpy as np

from ..checks.rounding import UNDERFLOW, UNIT_ROUNDOFF, gamma
from ..checks.tolerance import SAFETY
from ..numerics.groundtruth import GroundTruth, train_ground_truth
from ..values.layout import ParamLayout
from .config import ResolvedRun
from .reference_steps import Reference, ReferenceStep, reduction_length


class ReorderingPerturbation:
    """``perturb(step, grad, terms)`` for :func:`zerosim.numerics.groundtruth.train_ground_truth`: moves every
    element of the float32 mean gradient by its reordering term (module docstring), seeded signs."""

    def __init__(self, run: ResolvedRun, sign: float = 1.0):
        self.sign = sign
        self.layout = run.layout
        self.seed = run.seed
        self.gamma_n = gamma(reduction_length(run), UNIT_ROUNDOFF[run.precision.master_dtype])
        prec = run.precision
        local = run.world_size * run.micro_batches
        self.u16 = UNIT_ROUNDOFF[prec.grad_dtype] if prec.is_mixed else 0.0
        self.floor = (local + 1) * UNDERFLOW[prec.grad_dtype] if prec.is_mixed else 0.0

    def __call__(self, step: int, grad: np.ndarray, terms: np.ndarray | None) -> None:
        if terms is None:
            raise ValueError("the perturbed twin needs the local gradients' magnitudes (record_terms)")
        delta = np.empty(len(grad), dtype=np.float64)
        for t, g0 in zip(self.layout.tensors, self.layout.offsets, strict=True):
            part = terms[g0:g0 + t.numel]
            largest = float(part.max(initial=0.0))
            delta[g0:g0 + t.numel] = 2 * self.gamma_n * (part + largest) + 2 * self.u16 * part + self.floor
        signs = self.sign * np.random.default_rng([self.seed, step, 51]).choice([-1.0, 1.0], size=len(grad))
        grad[...] = (grad.astype(np.float64) + signs * delta).astype(grad.dtype)


def matrix_independent_reference(run: ResolvedRun) -> Reference:
    """The ground truth of a Muon or Adafactor run with the estimated per-tensor bounds (module
    docstring); fp32 trains on the concatenated batch, bf16/fp16 on per-micro-batch gradients."""
    mode = "micro" if run.precision.is_mixed else "concat"

    def train(sign: float | None) -> GroundTruth:
        return train_ground_truth(run.model_cfg, run.spec, run.precision, run.world_size, run.micro_batches,
                                  run.steps, run.seed, grad_mode=mode, record_terms=True,
                                  perturb=None if sign is None else ReorderingPerturbation(run, sign))

    gt, twins = train(None), [train(1.0), train(-1.0)]
    g = gamma(reduction_length(run), UNIT_ROUNDOFF[run.precision.master_dtype])
    ref = Reference(f"ground_truth[{mode}, estimated bound]", diverged_at=gt.diverged_at)
    steps = len(gt.snapshots)
    for twin in twins:
        if twin.diverged_at is not None and twin.diverged_at < steps:
            steps = twin.diverged_at  # past a twin's divergence there is no estimate: compare before it
            ref.diverged_at = twin.diverged_at
    for i in range(steps):
        snap, others = gt.snapshots[i], [twin.snapshots[i] for twin in twins]
        bounds = {"master": tensor_bounds(snap.params, [o.params for o in others], run.layout, g)}
        for name in run.spec.state_names:
            bounds[f"optimizer.{name}"] = tensor_bounds(snap.state[name], [o.state[name] for o in others],
                                                        run.layout, g)
        norm_bound = SAFETY * max(*(abs(o.grad_norm - snap.grad_norm) for o in others), g * snap.grad_norm)
        clip_bound = SAFETY * max(*(abs(o.clip_coef - snap.clip_coef) for o in others), g * snap.clip_coef)
        ref.steps.append(ReferenceStep(i, snap.params, dict(snap.state), snap.optimizer_step, snap.loss,
                                       snap.grad_norm, snap.clip_coef, bounds=bounds,
                                       grad_norm_bound=norm_bound, clip_coef_bound=clip_bound))
    return ref


def tensor_bounds(expected: np.ndarray, twins: list[np.ndarray], layout: ParamLayout,
                  gamma_n: float) -> np.ndarray:
    """Per element, its tensor's ``SAFETY x max(max |twin - expected|, gamma_n max |expected|)`` over
    the twins."""
    out = np.empty(len(expected), dtype=np.float64)
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        e = expected[g0:g0 + t.numel].astype(np.float64)
        d = max(float(np.abs(twin[g0:g0 + t.numel].astype(np.float64) - e).max(initial=0.0))
                for twin in twins)
        floor = gamma_n * float(np.abs(e).max(initial=0.0))
        out[g0:g0 + t.numel] = SAFETY * max(d, floor)
    return out
