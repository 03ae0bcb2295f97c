"""C-ZERO-002 clause ``grad_accounting`` on a monitored run: the gradient the optimizer consumed is the
mean of the ranks' local gradients (the reduction DDP and ZeroRedundancyOptimizer declare) times one
clip coefficient, tensor by tensor.

What each rank observes (:mod:`zerosim.monitor.step_probe`): for every tensor, the projections of its
local gradient (every micro-batch of the step, before the reduction) on k shared random +-1 vectors,
their L1 norm and how many micro-batches were summed; and, at the optimizer's step, the projections of
the gradient it consumed (``.grad`` then), its L1 norm and its sum of squares.

Rounding model (unit roundoff u of the gradient's dtype, ``gamma`` of :mod:`zerosim.checks.rounding`):

* a projection is summed in blocks of :data:`BLOCK` elements in the gradient's dtype, the blocks in
  float64: |error| <= gamma_BLOCK(u) sum|g| (the +-1 products are exact);
* the reduction: DDP divides each local gradient by W (one rounding) and sums W terms (W - 1
  roundings); micro-batches accumulated under ``no_sync`` add m - 1 roundings: per element at most
  gamma_(W+m)(u) times the mean of the ranks' |local| values;
* the clip: one rounding of each element times the coefficient (the coefficient itself is one number
  for every tensor, estimated below, so its own rounding is not an error).

So for tensor t, projection j, with K_t the consumed L1 norm and A_t the mean of the ranks' local L1
norms: |C_tj - c R_tj| <= B_t = (gamma_BLOCK + u) K_t + c (gamma_BLOCK + gamma_(W+m)) A_t, R_tj the
mean of the ranks' local projections. The coefficient c is the one most tensors agree on (each
tensor's least-squares ratio tried, the one within the most tensors' bounds kept), its uncertainty
carried into every tensor's bound; a tensor outside is named. Then c itself: without ``max_grad_norm``
it must be 1 (a c below 1 that a clip at the consumed norm would give is said to be one); with it, c
must be torch's ``min(1, max_grad_norm / (norm + 1e-6))`` of the norm before clipping (the consumed
norm over c).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..values.observe import MonitorObservation
from .collect import ViolationCollector
from .rounding import UNIT_ROUNDOFF, gamma

#: elements summed in the gradient's own dtype before the float64 sum (a projection's blocks)
BLOCK = 64
#: torch's clip_grad_norm_ adds this to the norm before dividing max_norm by it
CLIP_EPS = 1e-6


def _bounds(
    local: list[list[float]], consumed: list[float], world: int, u: float, c: float
) -> tuple[list[float], list[float], float]:
    """(mean local projections R, consumed projections C, bound B) of one tensor; ``local``: each rank's
    row [proj..., l1, micro], ``consumed``: this rank's row [proj..., l1, sq]."""
    k = len(consumed) - 2
    mean = [math.fsum(row[j] for row in local) / world for j in range(k)]
    a = math.fsum(row[k] for row in local) / world
    micro = int(max(row[k + 1] for row in local))
    b = (gamma(BLOCK, u) + u) * consumed[k] + abs(c) * (gamma(BLOCK, u) + gamma(world + micro, u)) * a
    return mean, consumed[:k], b


def _coefficient(tensors: list[tuple[list[float], list[float], float]]) -> tuple[float, float] | None:
    """The clip coefficient most tensors agree on and its uncertainty, or None when no tensor's
    projections determine one. ``tensors``: (R, C, B at c = 1) per tensor."""
    candidates = []
    for r, c, b in tensors:
        rr = math.fsum(x * x for x in r)
        if rr > 0 and sum(abs(x) for x in r) > 4 * b:  # a ratio this tensor determines
            ratio = math.fsum(x * y for x, y in zip(r, c, strict=True)) / rr
            err = 2 * b * sum(abs(x) for x in r) / rr
            candidates.append((ratio, err))
    best: tuple[int, float, float] | None = None
    for ratio, err in candidates:
        agree = sum(
            all(
                abs(y - ratio * x) <= b * max(1.0, abs(ratio)) + err * abs(x)
                for x, y in zip(r, c, strict=True)
            )
            for r, c, b in tensors
        )
        if best is None or (agree, -err) > (best[0], -best[2]):
            best = (agree, ratio, err)
    return None if best is None else (best[1], best[2])


def accounting_violations(rows: Sequence[MonitorObservation], step: int, out: ViolationCollector) -> float:
    """Clause ``grad_accounting`` at one check (see the module docstring): each rank's consumed gradient
    against the mean of every rank's local gradient; returns the largest error over its bound."""
    have = [o for o in rows if o.accounting is not None]
    if len(have) != len(rows) or not have:
        return 0.0
    tables: dict[int, dict[str, Any]] = {o.rank: o.accounting for o in have if o.accounting is not None}
    names = tables[have[0].rank]["tensors"]
    if any(t["tensors"] != names for t in tables.values()):
        return 0.0  # the ranks track different tensors: nothing to compare tensor by tensor
    world = len(rows)
    worst = 0.0
    for obs in have:
        acc = tables[obs.rank]
        u = UNIT_ROUNDOFF.get(acc["dtype"], UNIT_ROUNDOFF["float32"])
        per: list[tuple[str, list[float], list[float], float]] = []
        for t, name in enumerate(names):
            local = [tables[o.rank]["local"][t] for o in have]
            consumed = acc["consumed"][t]
            if any(not all(math.isfinite(v) for v in row) for row in (*local, consumed)):
                continue  # no local gradient or none consumed for this tensor at this step
            r, c, b = _bounds(local, consumed, world, u, 1.0)
            per.append((name, r, c, b))
        found = _coefficient([(r, c, b) for _, r, c, b in per])
        if found is None:
            continue
        coef, coef_err = found
        for name, r, c, b in per:
            allowed = b * max(1.0, abs(coef)) + coef_err * max(abs(x) for x in r)
            error = max(abs(y - coef * x) for x, y in zip(r, c, strict=True))
            worst = max(worst, error / allowed if allowed > 0 else (math.inf if error else 0.0))
            if error > allowed:
                ratio = math.fsum(x * y for x, y in zip(r, c, strict=True)) / max(
                    math.fsum(x * x for x in r), 1e-300
                )
                out.add(
                    "grad_accounting",
                    f"rank {obs.rank} consumed {name}'s gradient at {ratio:.6g} x the mean of the ranks' "
                    f"local gradients, every other tensor at the clip coefficient {coef:.6g} "
                    f"(projection error {error:.3g}, bound {allowed:.3g})",
                    step=step,
                    ranks=(obs.rank,),
                    tensor=name,
                    expected=coef,
                    got=ratio,
                    error=error,
                    tolerance=allowed,
                )
        _clip_coefficient(obs.rank, acc, coef, coef_err, u, step, out)
    return worst


def _clip_coefficient(
    rank: int, acc: dict[str, Any], coef: float, coef_err: float, u: float, step: int, out: ViolationCollector
) -> None:
    """The one coefficient every tensor shares against the clip the loop declared (``max_grad_norm``)."""
    # the clip's norm: every gradient held, those the optimizer does not take included (projections NaN)
    squares = math.fsum(row[-1] for row in acc["consumed"] if math.isfinite(row[-1]))
    consumed_norm = math.sqrt(squares)
    n = len(acc["consumed"])
    tol = coef_err + 4 * u + gamma(BLOCK + n + 2, u)
    threshold = acc.get("max_grad_norm")
    if threshold is None:
        if abs(coef - 1.0) > tol:
            hint = (
                f": that is a clip at max_grad_norm of about {consumed_norm:.6g} the monitor "
                f"was not told of (pass Monitor(..., max_grad_norm=...))"
                if 0 < coef < 1
                else ""
            )
            out.add(
                "grad_accounting",
                f"rank {rank} consumed every tensor's gradient at {coef:.6g} x the mean of the "
                f"ranks' local gradients, the loop declares no clip{hint}",
                step=step,
                ranks=(rank,),
                expected=1.0,
                got=coef,
            )
        return
    if coef <= 0 or not math.isfinite(coef):
        return
    before = consumed_norm / coef  # the norm before clipping
    expected = min(1.0, threshold / (before + CLIP_EPS))
    if abs(coef - expected) > tol * max(1.0, expected) + expected * tol:
        out.add(
            "grad_accounting",
            f"rank {rank} consumed the gradient at {coef:.6g} x the mean of the ranks' local "
            f"gradients; a clip at max_grad_norm={threshold:g} of its norm {before:.6g} gives {expected:.6g}",
            step=step,
            ranks=(rank,),
            expected=expected,
            got=coef,
        )
