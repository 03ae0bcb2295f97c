"""C-ZERO-002 clause ``update`` on a monitored run: what ``optimizer.step()`` did equals its class's formula
(torch.optim's SGD, Adam, AdamW, Adafactor, Muon) applied to the consumed gradient and the state before
the step, recomputed in float64 for a sample of every tensor the optimizer steps.

What a rank observes (:mod:`zerosim.monitor.update_probe`, through ``register_step_pre_hook`` and
``register_step_post_hook``, so a loop's own changes outside the step are not counted): per sampled
tensor its hyperparameters, its step counter before the step, and at the sampled elements the
parameter, the gradient and every state entry before the step, the parameter and the state after.
SGD, Adam and AdamW step each element on its own, so a few elements of every tensor are sampled;
Adafactor and Muon step a tensor as a whole (:data:`WHOLE_TENSOR`), so whole tensors are
(:mod:`zerosim.checks.update_adafactor`, :mod:`zerosim.checks.update_muon`).

Rounding model (:mod:`zerosim.checks.tracked`, running error analysis, first order, u of the parameter's
dtype): each operation the optimizer performs in that dtype rounds once, relative u of its result, and
a hyperparameter is rounded to that dtype (relative u) before it multiplies; a blend ``b x + (1 - b) y``
in any of torch's forms (two products and a sum, or ``lerp``) errs by at most 5 u (|x| + |y|) plus the
propagated input errors; a bias correction formed in that dtype errs by
:func:`~zerosim.checks.rounding.bias_correction_error`. Each value carries the bound of its error
through the formula; the bound of an output is the sum. An output outside it is named with its tensor
and state entry. The inputs are the exact values read before the step, so nothing is estimated but
Muon's bfloat16 Newton-Schulz iteration, whose bound is estimated from twins
(:mod:`zerosim.checks.update_muon`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..values.observe import MonitorObservation
from .collect import ViolationCollector
from .rounding import UNIT_ROUNDOFF, bias_correction_error
from .tracked import Tracked, blend
from .update_adafactor import adafactor
from .update_muon import muon

#: the optimizers whose formula is recomputed (torch.optim class names; the row carries the index)
FORMULAS = ("SGD", "Adam", "AdamW", "Adafactor", "Muon")
#: the formulas whose step of an element depends on its whole tensor: whole tensors are sampled
WHOLE_TENSOR = ("Adafactor", "Muon")
#: the state entries (and the parameter) an update can be named by
ENTRIES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "row_var", "col_var",
           "variance")


def _before(s: Mapping[str, Any], entry: str) -> Tracked:
    """A state entry before the step: zeros where the optimizer creates it at this step."""
    value = s["pre"].get(entry)
    return Tracked(np.zeros(len(s["grad"])) if value is None else value)


def _adam(s: Mapping[str, Any], hp: Mapping[str, Any], u: float, decoupled: bool) -> dict[str, Tracked]:
    p, g = Tracked(s["pre"]["param"]), Tracked(s["grad"])
    if hp.get("maximize"):
        g = Tracked(-g.v)
    lr, wd, eps = float(hp["lr"]), float(hp.get("weight_decay", 0.0)), float(hp["eps"])
    b1, b2 = (float(b) for b in hp["betas"])
    t = float(s["step"]) + 1
    if wd and decoupled:
        p = p.times(1 - lr * wd, u)
    elif wd:
        g = g.plus(p.times(wd, u), u)
    m = blend(_before(s, "exp_avg"), g, b1, u)
    v = blend(_before(s, "exp_avg_sq"), g.mul(g, u), b2, u)
    out = {"exp_avg": m, "exp_avg_sq": v}
    second = v
    if hp.get("amsgrad"):
        prev = _before(s, "max_exp_avg_sq")
        second = Tracked(np.maximum(prev.v, v.v), np.maximum(prev.e, v.e))
        out["max_exp_avg_sq"] = second
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    e1, e2 = bias_correction_error(b1, int(t), u), bias_correction_error(b2, int(t), u)
    denom = second.sqrt(u).times(1 / math.sqrt(bc2), u)
    denom = Tracked(denom.v, denom.e + denom.v * e2)
    denom = denom.plus(Tracked(np.full_like(denom.v, eps)), u)
    direction = m.div(denom, u).times(lr / bc1, u)
    direction = Tracked(direction.v, direction.e + np.abs(direction.v) * e1)
    out["param"] = p.plus(Tracked(-direction.v, direction.e), u)
    return out


def _sgd(s: Mapping[str, Any], hp: Mapping[str, Any], u: float) -> dict[str, Tracked]:
    p, g = Tracked(s["pre"]["param"]), Tracked(s["grad"])
    if hp.get("maximize"):
        g = Tracked(-g.v)
    lr, wd = float(hp["lr"]), float(hp.get("weight_decay", 0.0))
    momentum, dampening = float(hp.get("momentum", 0.0)), float(hp.get("dampening", 0.0))
    if wd:
        g = g.plus(p.times(wd, u), u)
    out: dict[str, Tracked] = {}
    if momentum:
        before = s["pre"].get("momentum_buffer")
        if before is None:
            buf = g
        else:
            prev = Tracked(before).times(momentum, u)
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
        elif optimizer == "Adafactor":
            expected = adafactor(s, u, dtype)
        elif optimizer == "Muon":
            expected = muon(s, u)  # type: ignore[arg-type]  # it keeps its twins' spread in the sample
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


#: the latest findings recomputed, by the identity of their samples (a check asks for one rank's
#: finding several times: its clause, C-ZERO-003's attribution), with the samples kept alive
_RECOMPUTED: list[tuple[Any, dict[str, Any]]] = []


def update_finding(obs: MonitorObservation) -> dict[str, Any] | None:
    """A rank's finding: recomputed from its samples where the observation holds them (its own file, the
    rank's own row live), else the finding its row carried."""
    if obs.update_samples is not None and obs.update is not None:
        for samples, finding in _RECOMPUTED:
            if samples is obs.update_samples:
                return finding
        dtype = obs.update.get("dtype", "float32")
        finding = recompute_update(obs.update["optimizer"], obs.update_samples, dtype)
        _RECOMPUTED[:] = [*_RECOMPUTED[-7:], (obs.update_samples, finding)]
        return finding
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
