"""C-ZERO-002 under a mixed-precision policy (bf16 / fp16 compute, float32 masters): the per-tensor
normwise update error of every rank, every step, within a bound estimated from a perturbed reference.

Why not per element: two correct low-precision trainers differ element-wise by as much as a trainer
that keeps no float32 master does (a GPT block under AdamW, lr 1e-2: largest absolute error 6.8e-2
correct, 6.6e-2 without masters), because a bf16 forward and backward is only accurate to about
2^-8 per element and AdamW's update rescales every element to about lr. What separates them is the
error of the whole update of a tensor: with ``dp = p_after - p_before`` the trainer's update and
``dp_ref`` the reference's from the same masters,

    e = ||dp - dp_ref||_2 / ||dp_ref||_2

(median over tensors and steps about 3e-3 for correct trainers, 0.2 to 0.95 without float32 masters,
SGD and AdamW at lr 1e-2 to 1e-4).

The bound is *estimated*, not derived: the reference takes every step twice from the same masters
(:mod:`zerosim.verify.mixed_reference`): once plainly, once in another valid way (the compute copy
rounded after a half-ulp perturbation, the gradients summed in another order). Its per-tensor
deviation ``e_pert`` is a sample of the noise the policy's arithmetic makes on this very step and
tensor (as TTrace, arXiv 2506.09280, estimates its thresholds from perturbed reference runs). A
trainer's error may be :data:`SAFETY` times the larger of the tensor's own ``e_pert`` and the whole
model's (a tensor whose sample happens to be near zero is not judged on luck), plus the float32
rounding of the masters themselves (:data:`MASTER_ULPS` units of float32 roundoff of the new values
relative to the update). Each tensor is judged on its own, so a bug that hits one tensor fails
even when the median over all of them is fine. The optimizer state is judged the same way
(``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``: the change of the state over the step); Adam's
step counter exactly.

Float32 masters from the float32 model (clause ``master_init``): a phase's first step is judged from
the model the trainer received. When on every rank the offset from the reference is, to within half
its norm, the compute-dtype rounding of that model, the masters were made from the cast weights
(DeepSpeed's ``deepspeed.initialize`` does that): exact in the sense that a correct trainer's offset
is independent of that rounding, so what it leaves is about the whole offset, never under half.

Float32 masters (clause ``master_dtype``): a float32 master moved by an update lands on a value of the
compute dtype by chance with probability about 2^-16 (bf16: the low 16 of its 32 bits are zero; fp16:
2^-13). When every element of a tensor that the reference's update moved (at least
:data:`MIN_MOVED` of them) is such a value on a rank, the odds that float32 masters did it are below
2^-200: the trainer keeps its masters in the compute dtype. This clause is exact; the normwise clause
is the statistical one (its ratio for such a trainer is near or above 1, not far above: the lost
updates are of the size of the compute dtype's noise).

fp16's loss scale: a step the trainer skipped (masters and step counter unchanged) is right only when
the reference overflows at the trainer's scale; masters that are not finite after a step mean an
overflow step was taken (clause ``loss_scale``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..values.observe import TrainerObservation
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .tolerance import SAFETY

MIN_MOVED = 16  # elements the reference moved before all-compute-dtype masters are called no float32 master
MASTER_ULPS = 4.0  # float32 roundings of the new master value a trainer may do differently (p - lr u, ...)
U32 = 2.0**-24
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


@dataclass
class MixedPrecisionStep:
    """One step of a live trainer under a mixed-precision policy, with the reference re-started from the
    trainer's masters (``before``) beside it: plain (``ref``) and perturbed (``perturbed``) results.
    ``trainer_skipped``: the trainer's masters did not change (fp16: an overflow skip);
    ``ref_overflow``: the reference's gradients overflowed at the trainer's loss ``scale``."""

    step: int
    phase: str
    before: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]
    perturbed: dict[str, np.ndarray]
    ranks: list[TrainerObservation]
    state_before: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    ref_state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    perturbed_state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    trainer_skipped: bool = False
    ref_overflow: bool = False
    scale: float | None = None
    grad_norm: float = 0.0
    perturbed_grad_norm: float = 0.0
    grad_deviation: float = 0.0  # ||g_perturbed - g_ref||: the perturbed reference's gradient error
    param_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)


def normwise_error(got: np.ndarray, ref: np.ndarray, before: np.ndarray) -> float:
    """``||got - ref|| / ||ref - before||`` (inf when the reference did not move and ``got`` did)."""
    diff = float(np.linalg.norm(np.asarray(got, np.float64) - np.asarray(ref, np.float64)))
    moved = float(np.linalg.norm(np.asarray(ref, np.float64) - np.asarray(before, np.float64)))
    if moved == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / moved


def update_bound(e_pert: float, e_pert_model: float, ref: np.ndarray, before: np.ndarray,
                 safety: float = SAFETY) -> float:
    """The most ``normwise_error`` a correct trainer may show on one tensor (see the module docstring)."""
    moved = float(np.linalg.norm(np.asarray(ref, np.float64) - np.asarray(before, np.float64)))
    size = float(np.linalg.norm(np.asarray(ref, np.float64)))
    rounding = MASTER_ULPS * U32 * size / moved if moved else 0.0
    return safety * max(e_pert, e_pert_model) + rounding


def _model_error(a: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray],
                 before: Mapping[str, np.ndarray]) -> float:
    names = [n for n in ref if n in a and n in before]
    diff = math.sqrt(sum(float(np.sum((np.asarray(a[n], np.float64) - ref[n]) ** 2)) for n in names))
    moved = math.sqrt(sum(float(np.sum((np.asarray(ref[n], np.float64) - before[n]) ** 2)) for n in names))
    return diff / moved if moved else 0.0


def step_equivalence_mixed(records: Sequence[MixedPrecisionStep], contract: str = "C-ZERO-002",
                          safety: float = SAFETY) -> Verdict:
    """C-ZERO-002 in its mixed-precision mode (module docstring): clauses ``normwise_update`` (a tensor's
    update, or its optimizer state's change, beyond its bound), ``step_counter`` and ``loss_scale``.
    Details: the worst error/bound ratio and where, and the median update error."""
    out = ViolationCollector(contract, {"mode": "mixed-precision normwise update"}, total=MAX_LISTED)
    worst: dict[str, Any] = {"ratio": -1.0}
    errors: list[float] = []
    stopped: set[str] = set()
    started: set[str] = set()
    for rec in records:
        if rec.phase in stopped:
            continue
        if _judge_skip(out, rec, stopped):
            continue
        if rec.phase not in started:
            started.add(rec.phase)
            _judge_master_init(out, rec)
        targets: list[tuple[str, str | None, dict[str, np.ndarray], dict[str, np.ndarray],
                            dict[str, np.ndarray]]] = [("params", None, rec.ref, rec.perturbed, rec.before)]
        for sk in STATE_KEYS:
            ref_k = {n: e[sk] for n, e in rec.ref_state.items() if sk in e}
            pert_k = {n: e[sk] for n, e in rec.perturbed_state.items() if sk in e}
            before_k = {n: rec.state_before.get(n, {}).get(sk, np.zeros_like(v)) for n, v in ref_k.items()}
            if ref_k:
                targets.append(("state", sk, ref_k, pert_k, before_k))
        for kind, key, ref, pert, before in targets:
            e_model = _model_error(pert, ref, before)
            for obs in rec.ranks:
                values = obs.params if kind == "params" else {
                    n: e[key] for n, e in (obs.state or {}).items() if key in e}
                for name, exp in ref.items():
                    if name not in values or name not in pert:
                        continue
                    got = np.asarray(values[name], np.float64).reshape(exp.shape)
                    err = normwise_error(got, exp, before[name])
                    err = err if math.isfinite(err) else math.inf
                    bound = update_bound(normwise_error(pert[name], exp, before[name]), e_model, exp,
                                         before[name], safety)
                    if kind == "params":
                        errors.append(err)
                    label = name if key is None else f"{name}[{key}]"
                    ratio = err / bound if bound > 0 else (math.inf if err > 0 else 0.0)
                    if ratio > worst["ratio"]:
                        worst = {"ratio": ratio, "error": err, "bound": bound,
                                 "where": f"step {rec.step}, rank {obs.rank}, {label}"}
                    if err > bound:
                        out.add("normwise_update",
                                f"{label}'s update at step {rec.step} on rank {obs.rank} is off by "
                                f"{err:.3g} of the reference's update (bound {bound:.3g}, "
                                f"{ratio:.3g}x)", {"state": key} if key else None,
                                phase=rec.phase, step=rec.step, ranks=(obs.rank,), tensor=name,
                                error=err, tolerance=bound)
        _judge_counter(out, rec)
        _judge_master_dtype(out, rec)
    details: dict[str, Any] = {"median_update_error": float(np.median(errors)) if errors else 0.0,
                               "safety": safety}
    if worst["ratio"] >= 0:
        details.update(max_error=worst["error"], tolerance=worst["bound"],
                       error_over_tolerance=worst["ratio"], worst=worst["where"])
    return out.listed_verdict(checked=sum(len(r.ranks) for r in records), **details)


def _judge_skip(out: ViolationCollector, rec: MixedPrecisionStep, stopped: set[str]) -> bool:
    """The ``loss_scale`` clause at one step; True when the step is not compared further."""
    bad = [obs for obs in rec.ranks if not all(np.isfinite(v).all() for v in obs.params.values())]
    if bad:
        out.add("loss_scale",
                f"rank {bad[0].rank}'s masters are not finite after step {rec.step}: a step whose gradients "
                "overflowed was taken, not skipped", phase=rec.phase, step=rec.step,
                ranks=tuple(o.rank for o in bad))
        stopped.add(rec.phase)  # nothing later in the phase can be compared with a finite reference
        return True
    if rec.trainer_skipped:
        if not rec.ref_overflow:
            out.add("loss_scale",
                    f"the trainer skipped step {rec.step} (masters unchanged) at loss scale {rec.scale:g}, "
                    "but the gradients do not overflow there: a skip without an overflow",
                    phase=rec.phase, step=rec.step, ranks=tuple(o.rank for o in rec.ranks))
        return True
    return False


def compute_dtype_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """Per element: is the float32 value exactly a value of ``dtype`` (bfloat16 / float16)?"""
    x = np.ascontiguousarray(np.asarray(values, np.float32))
    if dtype == "bfloat16":
        return (x.view(np.uint32) & 0xFFFF) == 0
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32) == x


def round_to_compute_dtype(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 ``values`` rounded to the nearest ``dtype`` (bfloat16 / float16) value, ties to even, as
    float64: what a cast of the masters to the compute dtype makes of them."""
    x = np.ascontiguousarray(np.asarray(values, np.float32))
    if dtype == "bfloat16":
        bits = x.view(np.uint32).astype(np.uint64)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
        return rounded.view(np.float32).astype(np.float64)
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float64)


ROUNDED_START_MATCH = 0.5  # the rounding explains a rank's offset when what it leaves is below this share


def rounded_start_share(rec: MixedPrecisionStep, obs: TrainerObservation) -> float | None:
    """``||(p - p_ref) - (round(p_before) - p_before)|| / ||p - p_ref||`` over every tensor: how much of
    a rank's offset from the reference the compute-dtype rounding of the starting masters leaves
    unexplained (None when that rounding or the offset is zero or not finite). A correct trainer's
    offset is independent of the rounding (the share is at least about 1); one whose masters began
    from the cast weights leaves only its own small noise."""
    names = [n for n in rec.ref if n in rec.before and n in obs.params]
    shift = {n: round_to_compute_dtype(rec.before[n], rec.param_dtype) - np.asarray(rec.before[n], np.float64)
             for n in names}
    if not any(np.any(v) for v in shift.values()):
        return None
    total = rest = 0.0
    for n in names:
        offset = (np.asarray(obs.params[n], np.float64).reshape(np.shape(rec.ref[n]))
                  - np.asarray(rec.ref[n], np.float64))
        total += float(np.sum(offset ** 2))
        rest += float(np.sum((offset - shift[n]) ** 2))
    if not math.isfinite(total) or not math.isfinite(rest) or total == 0.0:
        return None
    return math.sqrt(rest / total)


def _judge_master_init(out: ViolationCollector, rec: MixedPrecisionStep) -> None:
    """Clause ``master_init`` at a phase's first step (judged from the model the trainer received): every
    rank's offset is the compute-dtype rounding of that model (:func:`rounded_start_share` below
    :data:`ROUNDED_START_MATCH`): the float32 masters were made from the cast weights."""
    shares = [rounded_start_share(rec, obs) for obs in rec.ranks]
    if not shares or any(s is None or s >= ROUNDED_START_MATCH for s in shares):
        return
    worst = max(s for s in shares if s is not None)
    out.add("master_init",
            f"every rank's masters after step {rec.step} are the reference's plus the {rec.param_dtype} "
            f"rounding of the float32 model the step started from (it leaves {worst:.2g} of the "
            f"difference): the float32 masters were made from the {rec.param_dtype}-cast weights",
            phase=rec.phase, step=rec.step, ranks=tuple(o.rank for o in rec.ranks))


def _judge_master_dtype(out: ViolationCollector, rec: MixedPrecisionStep) -> None:
    """Clause ``master_dtype`` (module docstring): the first tensor whose moved masters are all compute-dtype
    values, per rank."""
    for obs in rec.ranks:
        for name, exp in rec.ref.items():
            start = np.asarray(rec.before[name], np.float64).reshape(-1)
            moved = np.asarray(exp, np.float64).reshape(-1) != start
            if int(moved.sum()) < MIN_MOVED:
                continue
            low = compute_dtype_values(np.asarray(obs.params[name]).reshape(-1)[moved], rec.param_dtype)
            if low.all():
                out.add("master_dtype",
                        f"{name}'s masters on rank {obs.rank} after step {rec.step} are all "
                        f"{rec.param_dtype} values ({int(moved.sum())} elements the reference's update "
                        "moved): the trainer keeps no float32 master", phase=rec.phase, step=rec.step,
                        ranks=(obs.rank,), tensor=name)
                break


def _judge_counter(out: ViolationCollector, rec: MixedPrecisionStep) -> None:
    for obs in rec.ranks:
        for name, entry in (obs.state or {}).items():
            exp = rec.ref_state.get(name, {}).get("step")
            got = entry.get("step")
            if exp is None or got is None:
                continue
            if float(np.asarray(got).reshape(-1)[0]) != float(np.asarray(exp).reshape(-1)[0]):
                out.add("step_counter", f"{name}'s optimizer step counter is "
                        f"{float(np.asarray(got).reshape(-1)[0]):g} after step {rec.step}, the reference's "
                        f"{float(np.asarray(exp).reshape(-1)[0]):g}", phase=rec.phase, step=rec.step,
                        ranks=(obs.rank,), tensor=name)
                return


def logged_norm_bound_mixed(ref_norm: float, grad_deviation: float, elements: int, world: int,
                            safety: float = SAFETY) -> float:
    """C-ZERO-008 under a policy. A correct trainer's gradient g' is estimated within ``safety`` x
    ``grad_deviation`` = ||g_perturbed - g_ref|| of the reference's g (the estimate C-ZERO-002 uses), so by
    the triangle inequality | ||g'|| - ||g|| | <= ||g' - g|| <= safety x grad_deviation; plus the float32
    sum of squares' rounding, gamma_(P+W+3) (as derived in :mod:`zerosim.checks.logged_norm`). The
    deviation of the perturbed *norm* alone is not used: a scalar sample can cancel to near zero."""
    from .rounding import gamma

    return safety * grad_deviation + gamma(elements + world + 3, U32) * abs(ref_norm)


def logged_norm_mixed(records: Sequence[MixedPrecisionStep], contract: str = "C-ZERO-008") -> Verdict:
    """C-ZERO-008 under a policy: every rank's logged norm within :func:`logged_norm_bound_mixed` of the
    reference's unscaled norm before clipping. Steps the trainer skipped (fp16 overflow) are not judged."""
    out = ViolationCollector(contract, total=MAX_LISTED)
    checked = 0
    worst: dict[str, Any] = {"ratio": -1.0}
    for rec in records:
        if rec.trainer_skipped or not math.isfinite(rec.grad_norm):
            continue
        elements = sum(int(np.asarray(v).size) for v in rec.ref.values())
        bound = logged_norm_bound_mixed(rec.grad_norm, rec.grad_deviation, elements, len(rec.ranks))
        for obs in rec.ranks:
            if obs.grad_norm is None:
                continue
            checked += 1
            error = abs(float(obs.grad_norm) - rec.grad_norm)
            if not math.isfinite(error):
                error = math.inf
            ratio = error / bound if bound > 0 else (math.inf if error > 0 else 0.0)
            if ratio > worst["ratio"]:
                worst = {"ratio": ratio, "error": error, "bound": bound, "step": rec.step, "rank": obs.rank}
            if error > bound:
                out.add("logged_norm",
                        f"rank {obs.rank} logged a gradient norm of {obs.grad_norm:.6g} at step {rec.step}; "
                        f"the reference's unscaled norm is {rec.grad_norm:.6g} (error {error:.3g}, "
                        f"bound {bound:.3g})",
                        step=rec.step, ranks=(obs.rank,), expected=rec.grad_norm, got=float(obs.grad_norm),
                        phase=rec.phase, error=error, tolerance=bound)
    if not checked:
        return out.verdict(0, skipped="the trainer has no last_grad_norm(): it logs no gradient norm")
    if worst["ratio"] < 0:
        return out.listed_verdict(checked)
    return out.listed_verdict(checked, max_error=worst["error"], tolerance=worst["bound"],
                              error_over_tolerance=worst["ratio"], worst_step=worst["step"],
                              worst_rank=worst["rank"])
