"""C-ZERO-008, what the trainer reports equals what it computed: the total gradient norm a live trainer
logs (``last_grad_norm()``) against the norm of the reference's gradient, step by step.

The logged norm is the norm of the averaged gradient before clipping. A correct trainer computes it
from its own gradient g' (within the per-element bound dg of C-ZERO-002's rounding model,
:mod:`zerosim.checks.rounding`, of the reference's g) as the square root of a sum of squares in its
arithmetic dtype (unit roundoff u): per-rank partial sums of its shard's squares, then a sum over
the ranks, then a square root. Derivation of the bound:

* the gradient: by the triangle inequality | ||g'||_2 - ||g||_2 | <= ||g' - g||_2 <= ||dg||_2;
* the sum of squares: P squares (each rounded once, relative error u) added in any order together
  with at most W partial sums (one per rank) is a sum of at most P + W nonnegative terms, so its
  computed value S~ satisfies |S~ - S| <= gamma_(P+W+1) S (Higham, Accuracy and Stability, 3.1:
  gamma_n = n u / (1 - n u));
* the square root: sqrt(S (1 + d)) = sqrt(S) (1 + d/2 + O(d^2)), plus one rounding u of the root, so
  the computed norm is within gamma_(P+W+3) of the exact norm of g' (1/2 gamma_n + u <= gamma_(n+2)).

Together: |logged - ||g||_2| <= ||dg||_2 + gamma_(P+W+3)(u) (||g||_2 + ||dg||_2). Everything comes
from the reference's values, the unit roundoff and the sizes; nothing is fitted to a machine. A rank
whose logged norm is beyond it fails clause ``logged_norm``, even when its parameters are right
(DeepSpeed #7718: ZeRO-2 logged the norm of one rank's gradient partition, its updates were fine).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..values.observe import TrainerStep
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .judges import judges
from .tolerance import logged_norm_bound

CONTRACT = "C-ZERO-008"


@judges(CONTRACT)
def check_logged_norm(records: Sequence[TrainerStep], unit_roundoff: Mapping[str, float]) -> Verdict:
    """C-ZERO-008 on a live trainer's steps: every rank's logged norm within
    :func:`~zerosim.checks.tolerance.logged_norm_bound`
    of the reference's. ``unit_roundoff``: per phase, u of the arithmetic it is judged in. Skipped (in
    the details) when no rank logged a norm. Under a mixed-precision policy (records are
    :class:`~zerosim.checks.mixed_precision.MixedPrecisionStep`) the bound is the estimated one of
    :func:`~zerosim.checks.mixed_precision.logged_norm_bound_mixed`."""
    from .mixed_precision import MixedPrecisionStep, logged_norm_mixed

    if records and isinstance(records[0], MixedPrecisionStep):
        return logged_norm_mixed(records, CONTRACT)
    out = ViolationCollector(CONTRACT, total=MAX_LISTED)
    checked = 0
    worst = {"ratio": -1.0}
    for rec in records:
        ref = rec.ref
        bounds = rec.bounds
        ref_norm = float(ref.grad_norm)  # type: ignore[attr-defined]
        bound = None
        for obs in rec.ranks:
            if obs.grad_norm is None:
                continue
            if bound is None:
                u = unit_roundoff.get(rec.phase, 2.0**-53)
                bound = logged_norm_bound(ref_norm, getattr(bounds, "grad", {}) or {}, u, len(rec.ranks))
            checked += 1
            error = abs(float(obs.grad_norm) - ref_norm)
            ratio = error / bound if bound > 0 else (math.inf if error > 0 else 0.0)
            if ratio > worst["ratio"]:
                worst = {"ratio": ratio, "error": error, "bound": bound, "step": rec.step, "rank": obs.rank}
            if not error <= bound:  # a NaN norm is beyond any bound
                out.add(
                    "logged_norm",
                    f"rank {obs.rank} logged a gradient norm of {obs.grad_norm:.9g} at step {rec.step}; the "
                    f"reference's is {ref_norm:.9g} (error {error:.3g}, bound {bound:.3g})",
                    step=rec.step, ranks=(obs.rank,), expected=ref_norm, got=float(obs.grad_norm),
                    phase=rec.phase, error=error, tolerance=bound,
                )
    if not checked:
        return out.verdict(0, skipped="the trainer has no last_grad_norm(): it logs no gradient norm")
    details: dict[str, object] = {"max_error": worst["error"], "tolerance": worst["bound"],
                                  "error_over_tolerance": worst["ratio"], "worst_step": worst["step"],
                                  "worst_rank": worst["rank"]}
    return out.listed_verdict(checked, **details)
