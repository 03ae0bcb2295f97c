"""C-ZERO-002 clause ``update`` on a monitored run: what ``optimizer.step()`` did equals its class's formula
(torch.optim's SGD, Adam, AdamW) applied to the consumed gradient and the state before the step,
recomputed in float64 for a sample of elements of every tensor the optimizer steps.

What a rank observes (:mod:`zerosim.monitor.step_probe`, through ``register_step_pre_hook`` and
``register_step_post_hook``, so a loop's own changes outside the step are not counted): per sampled
tensor its hyperparameters, its step counter before the step, and at the sampled elements the
parameter, the gradient and every state entry before the step, the parameter and the state after.

Rounding model (running error analysis, first order, u of the parameter's dtype): each operation the
optimizer performs in that dtype rounds once, relative u of its result, and a hyperparameter is
rounded to that dtype (relative u) before it multiplies; a blend ``b x + (1 - b) y`` in any of torch's
forms (two products and a sum, or ``lerp``) errs by at most 5 u (|x| + |y|) plus the propagated input
errors; a bias correction formed in that dtype errs by
:func:`~zerosim.checks.rounding.bias_correction_error`. Each value carries the bound of its error
through the formula; the bound of an output is the sum. An output outside it is named with its tensor
and state entry. The inputs are the exact values read before the step, so nothing is estimated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..observe import MonitorObservation
from .collect import ViolationCollector
from .rounding import UNIT_ROUNDOFF, bias_correction_error

#: the optimizers whose formula is recomputed (torch.optim class names)
FORMULAS = ("SGD", "Adam", "AdamW")
#: the state entries (and the parameter) an update can be named by
ENTRIES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


class _Tracked:
    """A float64 value per sampled element and the bound of its error against the optimizer's own
    arithmetic (unit roundoff ``u``)."""

    def __init__(self, value: Any, err: Any = 0.0):
        self.v = np.asarray(value, dtype=np.float64)
        self.e = np.broadcast_to(np.asarray(err, dtype=np.float64), self.v.shape).copy()

    def plus(self, other: _Tracked, u: float) -> _Tracked:
        v = self.v + other.v
        return _Tracked(v, self.e + other.e + u * np.abs(v))

    def times(self, scalar: float, u: float) -> _Tracked:
        v = self.v * scalar
        return _Tracked(v, self.e * abs(scalar) + 2 * u * np.abs(v))  # the scalar's and the product's

    def mul(self, other: _Tracked, u: float) -> _Tracked:
        v = self.v * other.v
        return _Tracked(
            v, np.abs(self.v) * other.e + np.abs(other.v) * self.e + self.e * other.e + u * np.abs(v)
        )

    def div(self, other: _Tracked, u: float) -> _Tracked:
        v = self.v / other.v
        low = np.maximum(np.abs(other.v) - other.e, 1e-300)
        return _Tracked(v, (self.e + np.abs(v) * other.e) / low + u * np.abs(v))

    def sqrt(self, u: float) -> _Tracked:
        v = np.sqrt(np.maximum(self.v, 0.0))
        return _Tracked(v, np.sqrt(np.maximum(self.v, 0.0) + self.e) - v + u * v)


def _blend(x: _Tracked, y: _Tracked, beta: float, u: float) -> _Tracked:
    """``beta x + (1 - beta) y`` as torch forms it (products and a sum, or ``lerp``)."""
    v = beta * x.v + (1 - beta) * y.v
    return _Tracked(v, beta * x.e + (1 - beta) * y.e + 5 * u * (np.abs(x.v) + np.abs(y.v)))


def _before(s: Mapping[str, Any], entry: str) -> _Tracked:
    """A state entry before the step: zeros where the optimizer creates it at this step."""
    value = s["pre"].get(entry)
    return _Tracked(np.zeros(len(s["grad"])) if value is None else value)


def _adam(s: Mapping[str, Any], hp: Mapping[str, Any], u: float, decoupled: bool) -> dict[str, _Tracked]:
    p, g = _Tracked(s["pre"]["param"]), _Tracked(s["grad"])
    if hp.get("maximize"):
        g = _Tracked(-g.v)
    lr, wd, eps = float(hp["lr"]), float(hp.get("weight_decay", 0.0)), float(hp["eps"])
    b1, b2 = (float(b) for b in hp["betas"])
    t = float(s["step"]) + 1
    if wd and decoupled:
        p = p.times(1 - lr * wd, u)
    elif wd:
        g = g.plus(p.times(wd, u), u)
    m = _blend(_before(s, "exp_avg"), g, b1, u)
    v = _blend(_before(s, "exp_avg_sq"), g.mul(g, u), b2, u)
    out = {"exp_avg": m, "exp_avg_sq": v}
    second = v
    if hp.get("amsgrad"):
        prev = _before(s, "max_exp_avg_sq")
        second = _Tracked(np.maximum(prev.v, v.v), np.maximum(prev.e, v.e))
        out["max_exp_avg_sq"] = second
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    e1, e2 = bias_correction_error(b1, int(t), u), bias_correction_error(b2, int(t), u)
    denom = second.sqrt(u).times(1 / math.sqrt(bc2), u)
    denom = _Tracked(denom.v, denom.e + denom.v * e2)
    denom = denom.plus(_Tracked(np.full_like(denom.v, eps)), u)
    direction = m.div(denom, u).times(lr / bc1, u)
    direction = _Tracked(direction.v, direction.e + np.abs(direction.v) * e1)
    out["param"] = p.plus(_Tracked(-direction.v, direction.e), u)
    return out


def _sgd(s: Mapping[str, Any], hp: Mapping[str, Any], u: float) -> dict[str, _Tracked]:
    p, g = _Tracked(s["pre"]["param"]), _Tracked(s["grad"])
    if hp.get("maximize"):
        g = _Tracked(-g.v)
    lr, wd = float(hp["lr"]), float(hp.get("weight_decay", 0.0))
    momentum, dampening = float(hp.get("momentum", 0.0)), float(hp.get("dampening", 0.0))
    if wd:
        g = g.plus(p.times(wd, u), u)
    out: dict[str, _Tracked] = {}
    if momentum:
        before = s["pre"].get("momentum_buffer")
        if before is None:
            buf = g
        else:
            prev = _Tracked(before).times(momentum, u)
            buf = prev.plus(g.times(1 - dampening, u), u)
        out["momentum_buffer"] = buf
        g = g.plus(buf.times(momentum, u), u) if hp.get("nesterov") else buf
    out["param"] = p.plus(g.times(-lr, u), u)
    return out


def recompute_update(
    optimizer: str, samples: Sequence[Mapping[str, Any]], dtype: str = "float32"
) -> dict[str, Any]:
    """The finding of one rank's sampled update: ``checked`` (elements), ``bad`` (outputs outside their
    bound), the first bad output's ``tensor``, ``entry``, ``expected``, ``got`` and ``bound``, and
    ``worst_ratio`` (the largest error over its bound)."""
    u = UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])
    finding: dict[str, Any] = {
        "optimizer": optimizer,
        "checked": 0,
        "bad": 0,
        "tensor": None,
        "entry": None,
        "expected": None,
        "got": None,
        "bound": None,
        "worst_ratio": 0.0,
    }
    for s in samples:
        hp = s["hp"]
        if optimizer == "SGD":
            expected = _sgd(s, hp, u)
        else:
            expected = _adam(s, hp, u, optimizer == "AdamW" or bool(hp.get("decoupled_weight_decay")))
        finding["checked"] += len(s["grad"])
        for entry in ENTRIES:
            if entry not in expected or entry not in s["post"]:
                continue
            want, got = expected[entry], np.asarray(s["post"][entry], dtype=np.float64)
            bound = want.e + 2.0**-50 * np.abs(want.v)
            error = np.abs(got - want.v)
            bad = ~(error <= bound)  # a NaN where the formula gives a number is outside too
            ratio = np.where(bound > 0, error / np.maximum(bound, 1e-300), np.where(error > 0, np.inf, 0.0))
            finite = ratio[np.isfinite(ratio)]
            if finite.size:
                finding["worst_ratio"] = max(finding["worst_ratio"], float(finite.max()))
            if bad.any():
                finding["bad"] += int(bad.sum())
                if finding["tensor"] is None:
                    i = int(np.flatnonzero(bad)[0])
                    finding.update(
                        tensor=s["tensor"],
                        entry=entry,
                        expected=float(want.v[i]),
                        got=float(got[i]),
                        bound=float(bound[i]),
                    )
    return finding


def update_finding(obs: MonitorObservation) -> dict[str, Any] | None:
    """A rank's finding: recomputed from its samples where the observation holds them (its own file, the
    rank's own row live), else the finding its row carried."""
    if obs.update_samples is not None and obs.update is not None:
        dtype = obs.update.get("dtype", "float32")
        return recompute_update(obs.update["optimizer"], obs.update_samples, dtype)
    return obs.update


def departs(obs: MonitorObservation) -> bool:
    """Whether this rank's update departs from its own optimizer's formula at its check."""
    finding = update_finding(obs)
    return bool(finding and finding["bad"])


def update_violations(rows: Sequence[MonitorObservation], step: int, out: ViolationCollector) -> float:
    """Clause ``update``: each rank's sampled update against its optimizer's formula; the worst ratio."""
    worst = 0.0
    for obs in rows:
        finding = update_finding(obs)
        if not finding:
            continue
        worst = max(worst, float(finding["worst_ratio"]))
        if finding["bad"]:
            out.add(
                "update",
                f"rank {obs.rank}'s {finding['optimizer']} step departs from its formula at "
                f"{finding['bad']} sampled output(s): {finding['tensor']} {finding['entry']} is "
                f"{finding['got']!r}, the formula recomputed in float64 gives {finding['expected']!r} "
                f"(bound {finding['bound']:.3g})",
                step=step,
                ranks=(obs.rank,),
                tensor=finding["tensor"],
                expected=finding["expected"],
                got=finding["got"],
                tolerance=finding["bound"],
            )
    return worst
