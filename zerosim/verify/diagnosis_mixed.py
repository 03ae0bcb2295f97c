"""The diagnoses under a mixed-precision policy (:func:`diagnose_mixed`), read off
:class:`~zerosim.checks.mixed_precision.MixedPrecisionStep` records and C-ZERO-005's ``reduce_dtype``
verdicts: ``no-fp32-master``, ``master-init``, ``reduce-dtype``, ``loss-scale`` and ``logged-norm``
(the catalogue is in :mod:`zerosim.verify.diagnosis`). They serve C-ZERO-002 (the masters and the
update), C-ZERO-005 (the reduction dtype) and C-ZERO-008 (the logged norm).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from zerosim.values.verdict import Verdict

from .outcome import Diagnosis


def diagnose_mixed(records: Sequence[Any], contracts: dict[str, Verdict],
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
