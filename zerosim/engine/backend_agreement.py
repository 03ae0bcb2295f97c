"""The cross-backend agreement bound of one run, built from its unsharded ground truth.

:mod:`zerosim.checks.agreement` says what the bound is and compares two backends' observations with
it; this module computes it for a run: the ground truth's steps (with the terms each gradient adds),
the rounding model C-ZERO-002 uses for the run (:func:`zerosim.engine.reference.rounding_bound`) with
its reduction length set to the additions two backends may order apart
(:func:`zerosim.checks.agreement.cross_backend_length`), propagated step by step. Per step and
element: the master weights, each optimizer state, the clipped gradient and the working weights; the
grad norm and the clip factor as the model gives them; the loss within the reordered-sum bound of its
own scale plus its first-order response to the weights' difference (``sum_i |g_i| dw_i``).
"""

from __future__ import annotations

import numpy as np

from ..checks.agreement import AgreementStep, cross_backend_length, reordered_sum_bound
from ..checks.rounding import UNIT_ROUNDOFF
from ..numerics.groundtruth import train_ground_truth
from .config import ResolvedRun
from .reference import rounding_bound, step_values
from .reference_steps import reduction_length

__all__ = ["agreement_bounds"]


def agreement_bounds(run: ResolvedRun, *, same_local_arithmetic: bool) -> list[AgreementStep] | None:
    """One :class:`AgreementStep` per step of ``run``; None for an optimizer that is not elementwise
    (Muon, Adafactor: the rounding model does not follow them). ``same_local_arithmetic``: both
    backends compute their local gradients with numpy (only the cross-rank reductions may differ);
    otherwise the local gradients' whole chain of additions counts too."""
    if not run.spec.elementwise:
        return None
    mode = "micro" if run.precision.is_mixed else "concat"
    gt = train_ground_truth(run.model_cfg, run.spec, run.precision, run.world_size, run.micro_batches,
                            run.steps, run.seed, grad_mode=mode, record_terms=True)
    local_chain = 0 if same_local_arithmetic else reduction_length(run)
    length = cross_backend_length(run.k, run.replicas, local_chain)
    bound = rounding_bound(run, mode).with_reduction_length(length)
    master_dtype = run.precision.master_dtype
    u_work = UNIT_ROUNDOFF[run.precision.param_dtype] if run.precision.is_mixed else 0.0
    names = [t.name for t in gt.layout.tensors]
    out: list[AgreementStep] = []
    dw_before = {name: np.zeros(t.numel) for name, t in zip(names, gt.layout.tensors, strict=True)}
    for i in range(len(gt.snapshots)):
        values = step_values(gt, i)
        b = bound.step(values)

        def flat(parts: dict[str, np.ndarray]) -> np.ndarray:
            return np.concatenate([np.asarray(parts[name], dtype=np.float64) for name in names])

        master = flat(b.params)
        p = np.abs(flat(values.params))
        kinds = {"master": master, "grads": flat(b.clipped_grad),
                 "gathered": master + u_work * (2 * p + master)}
        for state in run.spec.state_names:
            kinds[f"optimizer.{state}"] = flat({name: b.state[name][state] for name in names})
        grad = flat(values.grad)
        response = float(np.sum(np.abs(grad) * flat(dw_before)))
        loss = gt.snapshots[i].loss
        loss_bound = reordered_sum_bound(length, master_dtype) * abs(loss) + response
        out.append(AgreementStep(kinds, loss_bound, b.grad_norm, b.clip_coef,
                                 {"reduction_length": length, "unit_roundoff": UNIT_ROUNDOFF[master_dtype]}))
        dw_before = {name: b.params[name] + u_work * (2 * np.abs(values.params[name]) + b.params[name])
                     for name in names}
    return out
