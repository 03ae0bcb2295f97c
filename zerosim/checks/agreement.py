"""How close two correct backends' runs of the same configuration must come: the cross-backend
agreement bound, derived from the rounding model of :mod:`zerosim.checks.rounding` as C-ZERO-002's is.

Two backends (the in-process simulator, ``mpiexec``, ``torchrun``) run the same engine on the same
seed, model, strategy and world size. What may differ is the order of the additions: MPI, gloo and
NCCL reduce a group's inputs in their own order where the simulator adds them in rank order, and a
backend computing with torch arrays forms each dot product in its BLAS's blocking where numpy forms it
in its own. Nothing else: every other operation is the same IEEE operation on the same inputs.

- **Bitwise** when every reduction that feeds the training state runs over at most
  :data:`BITWISE_MAX_GROUP` ranks and the local arithmetic is the same library's: a sum of two
  values is one IEEE addition, which is commutative, so every order gives the same bits.
- **Otherwise within the summation bound**, propagated. Two sums of the same ``n`` values in
  different orders each lie within ``gamma_(n-1) sum|x_i|`` of the exact sum (Higham, 3.1), so they
  differ by at most :func:`reordered_sum_bound` ``= 2 gamma_(n-1)`` times ``sum|x_i|``. That is the
  reduced gradient's difference after the first step; the optimizer carries it into the weights and
  moments, and the next gradient is taken at weights that already differ. The rounding model
  propagates exactly that, element by element and step by step, with the reduction length set to the
  additions whose order can differ (:func:`cross_backend_length`). Its values come from the
  unsharded ground truth of the run; nothing is fitted to a machine.
- Traffic counters and holdings: always identical, call for call and byte for byte.

:func:`compare_backends` applies the bound to two lists of rank observations; the bound of a run is
built by :func:`zerosim.engine.backend_agreement.agreement_bounds`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..values.observe import RankObservation, ShardValues
from .rounding import UNIT_ROUNDOFF, gamma

#: the largest reduction group whose result is the same in every order: one IEEE addition is commutative
BITWISE_MAX_GROUP = 2


def reordered_sum_bound(n: int, dtype: str) -> float:
    """How far two sums of the same ``n`` values in ``dtype`` arithmetic, added in different orders, may
    differ, relative to ``sum |x_i|``: ``2 gamma_(n-1)(u)`` (each order is within ``gamma_(n-1)`` of the
    exact sum), and 0 for at most :data:`BITWISE_MAX_GROUP` values (one addition commutes)."""
    if n <= BITWISE_MAX_GROUP:
        return 0.0
    return 2.0 * gamma(n - 1, UNIT_ROUNDOFF[dtype])


def cross_backend_length(shard_group: int, replicas: int, local_chain: int = 0) -> int:
    """The additions along any gradient element's chain whose order two backends may choose apart: the
    shard group's reduction (``shard_group`` terms), the replicate group's (``replicas`` terms) and,
    when the two compute their local gradients with different libraries (numpy and torch), the
    ``local_chain`` additions of those gradients' dot products and batch sums."""
    return shard_group + replicas + local_chain


def bitwise_expected(shard_group: int, replicas: int, same_local_arithmetic: bool) -> bool:
    """Whether two correct backends must agree in every bit (see the module docstring)."""
    return same_local_arithmetic and max(shard_group, replicas) <= BITWISE_MAX_GROUP


@dataclass(frozen=True)
class AgreementStep:
    """The bound of one step, per element of the full flat state in layout order, by kind: "master",
    "optimizer.<name>", "grads" (the clipped gradient the optimizer consumed) and "gathered" (the
    working weights); the scalars' as absolute bounds."""

    bounds: Mapping[str, np.ndarray]
    loss: float
    grad_norm: float
    clip_coef: float
    stats: dict[str, Any] = field(default_factory=dict)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _state_arrays(step: Any) -> dict[str, ShardValues | np.ndarray]:
    out: dict[str, ShardValues | np.ndarray] = {}
    if step.master is not None:
        out["master"] = step.master
    if step.grads is not None:
        out["grads"] = step.grads
    for name, values in (step.optimizer or {}).items():
        out[f"optimizer.{name}"] = values
    if step.gathered is not None:
        out["gathered"] = step.gathered
    return out


def _element_bound(state: ShardValues | np.ndarray, flat_bound: np.ndarray) -> np.ndarray:
    """The bound of every stored element: its global element's, 0 for padding (zeros on both sides)."""
    if isinstance(state, np.ndarray):
        return np.asarray(flat_bound[:state.shape[0]], dtype=np.float64)
    out = np.zeros(state.values.shape[0], dtype=np.float64)
    for g0, g1, pos in state.pieces:
        out[pos:pos + g1 - g0] = flat_bound[g0:g1]
    return out


def compare_backends(got: Sequence[RankObservation], sim: Sequence[RankObservation], *, bitwise: bool,
                     bounds: Sequence[AgreementStep] | None) -> dict[str, Any]:
    """Whether ``got`` (a launched backend's ranks) agrees with ``sim`` (the simulator's) step by step:
    every bit where ``bitwise``, else every state element within its bound of ``bounds`` (one entry
    per step); traffic and holdings always identical. A JSON-able summary: ``agrees``, what was
    compared, the worst difference and where, and at most 8 problems."""
    if not bitwise and bounds is None:
        raise ValueError("a comparison that is not bitwise needs the run's agreement bounds")
    problems: list[str] = []
    max_abs, worst_at, differing, compared, worst_ratio = 0.0, "", 0, 0, 0.0
    if [o.rank for o in got] != [o.rank for o in sim]:
        problems.append(f"ranks differ: {[o.rank for o in got]} vs {[o.rank for o in sim]}")
    for g, s in zip(got, sim, strict=False):
        if g.groups != s.groups:
            problems.append(f"rank {g.rank}: groups differ")
        if len(g.steps) != len(s.steps):
            problems.append(f"rank {g.rank}: {len(g.steps)} steps vs {len(s.steps)}")
        for i, (gs, ss) in enumerate(zip(g.steps, s.steps, strict=False)):
            where = f"rank {g.rank} step {gs.step}"
            if gs.traffic != ss.traffic:
                problems.append(f"{where}: traffic differs")
            if gs.holdings != ss.holdings:
                problems.append(f"{where}: holdings differ")
            step_bound = None if bitwise or bounds is None else bounds[min(i, len(bounds) - 1)]
            for label, x, y in (("loss", gs.loss, ss.loss), ("grad norm", gs.grad_norm, ss.grad_norm),
                                ("clip factor", gs.clip_coef, ss.clip_coef)):
                scalar_bound = 0.0 if step_bound is None else {
                    "loss": step_bound.loss, "grad norm": step_bound.grad_norm,
                    "clip factor": step_bound.clip_coef}[label]
                if not (x == y or abs(float(x) - float(y)) <= scalar_bound):
                    problems.append(f"{where}: {label} {x!r} vs {y!r} (bound {scalar_bound:.3g})")
            mine, theirs = _state_arrays(gs), _state_arrays(ss)
            if mine.keys() != theirs.keys():
                problems.append(f"{where}: observed states {sorted(mine)} vs {sorted(theirs)}")
            for name in sorted(mine.keys() & theirs.keys()):
                ms, ts = mine[name], theirs[name]
                a = np.asarray(ms if isinstance(ms, np.ndarray) else ms.values)
                b = np.asarray(ts if isinstance(ts, np.ndarray) else ts.values)
                if a.dtype != b.dtype or a.shape != b.shape:
                    problems.append(f"{where} {name}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
                    continue
                compared += a.size
                n_diff = int(np.count_nonzero(_bits(a) != _bits(b)))
                differing += n_diff
                if a.size == 0:
                    continue
                diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
                diff[np.isnan(diff) & (np.isnan(a) & np.isnan(b))] = 0.0
                j = int(np.nanargmax(diff)) if not np.all(np.isnan(diff)) else 0
                if diff[j] > max_abs:
                    max_abs, worst_at = float(diff[j]), f"{where} {name}[{j}]"
                if step_bound is None:
                    if n_diff:
                        problems.append(f"{where} {name}: {n_diff} of {a.size} elements differ in some bit "
                                        f"(bitwise agreement expected)")
                    continue
                if name not in step_bound.bounds:
                    problems.append(f"{where} {name}: no agreement bound for this state")
                    continue
                allowed = _element_bound(ts, step_bound.bounds[name])
                outside = ~(diff <= allowed)
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratio = np.where(allowed > 0, diff / allowed, np.where(diff > 0, np.inf, 0.0))
                worst_ratio = max(worst_ratio, float(np.nanmax(ratio)))
                if np.any(outside):
                    k = int(np.flatnonzero(outside)[0])
                    problems.append(f"{where} {name}: {int(np.count_nonzero(outside))} of {a.size} elements "
                                    f"beyond their bound; first [{k}]: |diff| {diff[k]:.3g} > "
                                    f"{allowed[k]:.3g}")
    return {
        "agrees": not problems,
        "bitwise_required": bitwise,
        "bitwise_equal": differing == 0 and compared > 0,
        "elements_compared": compared,
        "elements_differing": differing,
        "max_abs_diff": max_abs,
        "max_abs_diff_at": worst_at,
        "bound": "bitwise" if bitwise else "derived per element (zerosim.checks.agreement)",
        "max_diff_over_bound": None if bitwise else worst_ratio,
        "problems": problems[:8],
    }
