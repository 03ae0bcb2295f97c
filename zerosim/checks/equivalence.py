"""C-ZERO-002, sharded training equals unsharded training at every step: one check,
:func:`check_step_equivalence`, for the engine's runs (simulate, mpi, torch), for live trainers
(``zerosim verify``) and for monitored runs (:mod:`zerosim.monitor`).

* **The engine's runs** (:class:`~zerosim.values.observe.RankObservation`): every rank's shard of the float32
  master and of every optimizer state equals the reference at the same global positions, every step:
  bitwise against the same-reduction-order reference, within the per-element rounding bound the
  independent ground truth carries (:mod:`zerosim.checks.rounding`) against it, else within the
  normwise fallback (:mod:`zerosim.checks.tolerance`). Padding stays exactly zero. Step counters agree
  exactly, grad norm and clip factor within their bounds. Where the reference went non-finite, the
  comparison stops (outcome "diverged", not a violation).
* **Live trainers** (:class:`~zerosim.values.observe.TrainerStep`): every rank's full parameters, and its
  optimizer state where exposed, within the per-element bound of :class:`~zerosim.checks.tolerance.ErrorModel`
  of the unsharded reference at every step; Adam's ``step`` counter exactly equal.
* **Monitored runs** (:class:`~zerosim.values.observe.MonitorObservation`, no reference beside them): what
  can be judged of the optimizer without one (:mod:`zerosim.checks.live_state`: state present and
  finite, step counters and logged gradient norms agreeing).

Violations name contract, clause, step, rank, tensor and flat element range, with expected vs got
(and, for live trainers, the phase, the error and the tolerance it exceeded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..values.layout import ParamLayout
from ..values.observe import MonitorObservation, RankObservation, ShardValues, TrainerObservation, TrainerStep
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .judges import judges
from .live_state import _monitor_state
from .mismatch import bitwise_diff, describe_mismatch, first_run, step_clauses, step_verdict, values_at
from .tolerance import EQUIVALENCE_TOLERANCE, Tolerance

CONTRACT = "C-ZERO-002"


@judges(CONTRACT)
def check_step_equivalence(
    observations: Sequence[RankObservation] | Sequence[TrainerStep] | Sequence[MonitorObservation],
    reference: Any = None,
    *,
    layout: ParamLayout | None = None,
    bitwise: bool = False,
    tolerance: Tolerance | None = None,
) -> Verdict:
    """C-ZERO-002: what every rank trains equals the unsharded reference, step by step.

    The engine's runs: ``observations`` are :class:`~zerosim.values.observe.RankObservation` and
    ``reference.steps[s]`` holds the full ``master``, ``state`` (by name), ``optimizer_step``,
    ``grad_norm``, ``clip_coef`` and optionally ``grads``. ``bitwise`` demands identical bits (same
    reduction order). Otherwise a step that carries per-element ``bounds`` (by kind: "master",
    "optimizer.<name>"; the ground truth's, :mod:`zerosim.checks.rounding`) and ``grad_norm_bound`` /
    ``clip_coef_bound`` is judged by them, and one without by ``tolerance`` (the normwise fallback,
    :data:`~zerosim.checks.tolerance.EQUIVALENCE_TOLERANCE`). A reference with ``diverged_at = s`` is
    compared on the steps before s only; the verdict's outcome is then "diverged".

    Live trainers: ``observations`` are :class:`~zerosim.values.observe.TrainerStep` records, each carrying
    its reference values and per-element bounds (``reference`` is not used); clauses ``allclose``
    (a parameter or state element beyond its bound) and ``step_counter``. Under a mixed-precision
    policy they are :class:`~zerosim.checks.mixed_precision.MixedPrecisionStep` records, judged by the
    per-tensor normwise update error (:mod:`zerosim.checks.mixed_precision`).

    Monitored runs: ``observations`` are :class:`~zerosim.values.observe.MonitorObservation` per rank and
    check (``reference`` is not used); clauses ``state_present``, ``state_finite``, ``step_counter``
    and ``grad_norm`` (:mod:`zerosim.checks.live_state`).
    """
    if observations and isinstance(observations[0], MonitorObservation):
        return _monitor_state(observations)  # type: ignore[arg-type]
    if reference is None:
        from .mixed_precision import MixedPrecisionStep, step_equivalence_mixed

        if observations and isinstance(observations[0], MixedPrecisionStep):
            return step_equivalence_mixed(observations, CONTRACT)  # type: ignore[arg-type]
        return _trainer_equivalence(observations, CONTRACT)  # type: ignore[arg-type]
    return _shard_equivalence(
        observations, reference, layout=layout, bitwise=bitwise, tolerance=tolerance,  # type: ignore[arg-type]
        contract=CONTRACT,
    )



def _shard_equivalence(
    observations: Sequence[RankObservation],
    reference: Any,
    *,
    layout: ParamLayout | None = None,
    bitwise: bool = False,
    tolerance: Tolerance | None = None,
    contract: str = "C-ZERO-002",
) -> Verdict:
    """C-ZERO-002 on the engine's shards: master weights and optimizer state equal the reference.

    ``reference.steps[s]`` holds the full ``master``, ``state`` (by name), ``optimizer_step``,
    ``grad_norm``, ``clip_coef`` and optionally ``grads``. ``bitwise`` demands identical bits
    (same reduction order). Otherwise a step that carries per-element ``bounds`` (by kind: "master",
    "optimizer.<name>"; the ground truth's, :mod:`zerosim.checks.rounding`) and ``grad_norm_bound`` /
    ``clip_coef_bound`` is judged by them, and one without by ``tolerance`` (the normwise fallback,
    :data:`EQUIVALENCE_TOLERANCE`). A reference with ``diverged_at = s`` (it went non-finite at step
    s) is compared on the steps before s only; the verdict's outcome is then "diverged".
    """
    tol = tolerance or EQUIVALENCE_TOLERANCE["fp32"]
    mode = "bitwise" if bitwise else "allclose"
    col = step_clauses(contract, {"reference": getattr(reference, "name", "?"), "mode": mode})
    diverged_at = getattr(reference, "diverged_at", None)
    checked = 0
    max_abs: dict[str, float] = {}
    max_rel: dict[str, float] = {}
    max_over_bound: dict[str, float] = {}
    derived = False
    failed_kinds: set[tuple[int, str]] = set()
    for obs in observations:
        for so in obs.steps:
            if diverged_at is not None and so.step >= diverged_at:
                continue  # the reference is not finite from here on: nothing to compare against
            if so.step >= len(reference.steps):
                col.add(
                    "steps",
                    f"the reference has {len(reference.steps)} steps; rank observed step {so.step}",
                    step=so.step,
                    ranks=(obs.rank,),
                )
                continue
            ref = reference.steps[so.step]
            bounds = None if bitwise else getattr(ref, "bounds", None)
            derived = derived or bounds is not None
            kinds: list[tuple[str, ShardValues | None, np.ndarray | None]] = [
                ("master", so.master, ref.master)
            ]
            kinds += [(f"optimizer.{n}", so.optimizer.get(n), ref.state.get(n)) for n in sorted(ref.state)]
            if bitwise and getattr(ref, "grads", None) is not None:
                kinds.append(("grads", so.grads, ref.grads))
            for kind, sv, full in kinds:
                if sv is None or full is None:
                    continue
                checked += 1
                idx, got = values_at(sv)
                exp = full[idx]
                pad_pos = sv.padding_positions()
                pad = sv.values[pad_pos]
                # -0.0 is zero: an AdamW decay factor 1 - lr * wd below zero turns a zero into -0.0
                with np.errstate(invalid="ignore"):
                    nz = np.flatnonzero(~(pad == 0)) if pad.size else pad_pos[:0]
                if nz.size:
                    p0 = int(pad_pos[nz[0]])
                    run = 1
                    while run < nz.size and pad_pos[nz[run]] == p0 + run:
                        run += 1
                    col.add(
                        "padding",
                        f"{kind}: {nz.size} padding elements are not zero (padding leaked into "
                        f"values), first at shard positions [{p0}, {p0 + run})",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=kind,
                        expected=0.0,
                        got=float(pad[nz[0]]),
                        context={"state": kind, "shard_positions": (p0, p0 + run)},
                    )
                if (obs.rank, kind) in failed_kinds:
                    continue  # report the first step a kind diverges on each rank, not every later step
                allowed: np.ndarray | float | None = None
                if bitwise:
                    mask = bitwise_diff(got, exp)
                else:
                    g64, e64 = got.astype(np.float64), exp.astype(np.float64)
                    scale = float(np.max(np.abs(full))) if full.size else 0.0
                    err = np.abs(g64 - e64)
                    if bounds is not None and kind in bounds:
                        allowed = bounds[kind][idx]
                    else:
                        allowed = tol.atol_scale * scale
                    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                        mask = ~(err <= allowed)
                        if err.size and isinstance(allowed, np.ndarray):
                            ratio = np.where(err > 0, err / allowed, 0.0)
                            max_over_bound[kind] = max(
                                max_over_bound.get(kind, 0.0),
                                float(np.nanmax(ratio)) if not np.isnan(ratio).all() else float("inf"),
                            )
                        if err.size:
                            max_abs[kind] = max(
                                max_abs.get(kind, 0.0),
                                float(np.nanmax(err)) if not np.isnan(err).all() else float("inf"),
                            )
                            rel = err / np.maximum(np.abs(e64), scale * 1e-30 + 1e-45)
                            max_rel[kind] = max(
                                max_rel.get(kind, 0.0),
                                float(np.nanmax(rel)) if not np.isnan(rel).all() else float("inf"),
                            )
                if mask.any():
                    failed_kinds.add((obs.rank, kind))
                    tensor, interval, e, g, msg = describe_mismatch(layout, idx, mask, got, exp)
                    if isinstance(allowed, np.ndarray):
                        msg += f"; derived bound at the first {float(allowed[int(np.argmax(mask))]):.3g}"
                    col.add(
                        mode,
                        f"{kind} differs from the reference: {msg}",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                        context={"state": kind},
                    )
            if so.optimizer_step != ref.optimizer_step:
                col.add("step_counter", "optimizer step counter differs from the reference", step=so.step,
                        ranks=(obs.rank,), expected=ref.optimizer_step, got=so.optimizer_step)
            nr = tol.norm_rtol if not bitwise else 0.0
            norm_bound = getattr(ref, "grad_norm_bound", None) if not bitwise else None
            clip_bound = getattr(ref, "clip_coef_bound", None) if not bitwise else None
            allowed_norm = nr * abs(ref.grad_norm) if norm_bound is None else norm_bound
            allowed_clip = nr * abs(ref.clip_coef) if clip_bound is None else clip_bound
            if not abs(so.grad_norm - ref.grad_norm) <= allowed_norm:
                col.add("grad_norm", "global gradient norm differs from the reference", step=so.step,
                        ranks=(obs.rank,), expected=ref.grad_norm, got=so.grad_norm,
                        context={"bound": allowed_norm})
            if not abs(so.clip_coef - ref.clip_coef) <= allowed_clip:
                col.add(
                    "clip_coef",
                    "clip coefficient differs from the reference (norm not global?)",
                    step=so.step,
                    ranks=(obs.rank,),
                    expected=ref.clip_coef,
                    got=so.clip_coef,
                    context={"bound": allowed_clip},
                )
    extra: dict[str, Any] = {}
    if derived:
        extra = {"bound": "derived per-element rounding bound (zerosim.checks.rounding)",
                 "max_error_over_bound": max_over_bound}
    if diverged_at is not None:
        extra["diverged_at"] = diverged_at
        extra["diverged"] = (f"the reference went non-finite (loss or state) at step {diverged_at}: "
                             f"compared steps before it only")
    tolerance_json = None if bitwise or derived else tol.to_json()
    v = step_verdict(col, mode=mode, tolerance=tolerance_json, max_abs_error=max_abs, max_rel_error=max_rel,
                     **extra)
    v.diverged_at = diverged_at
    v.checked = checked
    return v


# ---- live trainers -----------------------------------------------------------------------------------


def _trainer_equivalence(records: Sequence[TrainerStep], contract: str) -> Verdict:
    """C-ZERO-002 on a live trainer's full parameters and exposed optimizer state (module docstring)."""
    out = ViolationCollector(contract, total=MAX_LISTED)
    worst: dict[str, Any] = {"ratio": -1.0}
    max_abs = 0.0
    compared_state: set[str] = set()
    for rec in records:
        for obs in rec.ranks:
            for name, exp in rec.ref.params.items():
                got = obs.params[name]
                param_bound = rec.bounds.params[name]
                max_abs = max(max_abs, _compare(out, worst, rec, obs, name, None, got, exp, param_bound))
            for name, entry in (obs.state or {}).items():
                ref_entry = rec.ref.state.get(name, {})
                for key, got in entry.items():
                    if key not in ref_entry:
                        continue
                    compared_state.add(key)
                    exp = ref_entry[key]
                    if key == "step":
                        got_step = float(np.asarray(got).reshape(-1)[0])
                        exp_step = float(np.asarray(exp).reshape(-1)[0])
                        if got_step != exp_step:
                            out.add(
                                "step_counter",
                                f"optimizer step counter is {got_step:g}, torch.optim's is {float(exp):g}",
                                {"state": "step"},
                                phase=rec.phase, step=rec.step, ranks=(obs.rank,), tensor=name,
                                interval=(0, 1), expected=float(exp), got=got_step, tolerance=0.0,
                            )
                        continue
                    bound = rec.bounds.state.get(name, {}).get(key)
                    if bound is None:
                        continue
                    _compare(out, worst, rec, obs, name, key, got, exp, bound)
    details: dict[str, Any] = {"max_abs_error": max_abs, "state_compared": sorted(compared_state)}
    if worst["ratio"] >= 0:
        details.update(
            {
                "max_error": worst["error"],
                "tolerance": worst["tolerance"],
                "error_over_tolerance": worst["ratio"],
                "worst": worst["where"],
            }
        )
    return out.listed_verdict(checked=sum(len(rec.ranks) for rec in records), **details)


def _compare(
    out: ViolationCollector,
    worst: dict[str, Any],
    rec: TrainerStep,
    obs: TrainerObservation,
    name: str,
    key: str | None,
    got: np.ndarray,
    exp: np.ndarray,
    bound: np.ndarray,
) -> float:
    """Compare one tensor (or one of its optimizer states) with the reference under its per-element
    bound; add the first run of elements beyond it; track the worst error/bound ratio. Returns the
    largest absolute error."""
    g = np.asarray(got, dtype=np.float64).reshape(-1)
    e = np.asarray(exp, dtype=np.float64).reshape(-1)
    b = np.asarray(bound, dtype=np.float64).reshape(-1)
    # the same value on both sides agrees, a non-finite one included (the float64 reference diverged as
    # the trainer did: not a trainer's bug); otherwise a non-finite value on either side is beyond any
    # bound (the trainer's NaN error; a reference's infinite bound says nothing)
    same = (g == e) | (np.isnan(g) & np.isnan(e))
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(g - e))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(b > 0, err / b, np.where(err > 0, np.inf, 0.0))
    i = int(np.argmax(ratio)) if ratio.size else 0
    label = name if key is None else f"{name}[{key}]"
    if ratio.size and ratio[i] > worst["ratio"]:
        worst.update(
            ratio=float(ratio[i]),
            error=float(err[i]),
            tolerance=float(b[i]),
            where=f"step {rec.step}, rank {obs.rank}, {label}[{i}]",
        )
    bad = ~(same | (np.isfinite(e) & (err <= b)))
    if bad.any():
        start, stop = first_run(bad)
        n_bad = int(bad.sum())
        j = int(np.argmax(np.where(bad, ratio, -1)))
        what = "parameter" if key is None else f"optimizer state {key!r}"
        out.add(
            "allclose",
            f"{what}: {n_bad} of {e.size} elements beyond tolerance (worst error {err[j]:.3g} vs "
            f"tolerance {b[j]:.3g} at element {j})",
            None if key is None else {"state": key},
            phase=rec.phase, step=rec.step, ranks=(obs.rank,), tensor=name, interval=(start, stop),
            expected=float(e[start]), got=float(g[start]), error=float(err[j]), tolerance=float(b[j]),
        )
    return float(err.max()) if err.size else 0.0


def float32_masters(steps: Sequence[Sequence[TrainerObservation]]) -> bool:
    """Every rank's parameters exactly float32-representable after every step (float32 master weights,
    e.g. DeepSpeed on a float64 model): then C-ZERO-002 is judged with the float32 bound."""
    seen = False
    for ranks in steps:
        for obs in ranks:
            for arr in obs.params.values():
                if arr.dtype != np.float64:
                    return False
                if not np.array_equal(arr.astype(np.float32).astype(np.float64), arr):
                    return False
                seen = True
    return seen
