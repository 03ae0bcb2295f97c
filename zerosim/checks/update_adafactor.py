"""torch.optim.Adafactor's step recomputed in float64 on a whole tensor, with the bound of its rounding
(:mod:`zerosim.checks.tracked`), for the update check (:mod:`zerosim.checks.update_formula`).

Adafactor's step of an element depends on its whole tensor: the step size is the parameter's RMS
(``max(eps2, ||p|| / sqrt(n))``) times ``rho = min(lr, 1 / sqrt(t))``; a matrix's second moment is
factored into row and column means of the squared gradient (``row_var``, ``col_var``: torch factors the
last two dimensions), a vector keeps one (``variance``); the update ``g / sqrt(max(V, eps1^2))`` is
divided by ``max(1, RMS(update) / d)``. So the monitor samples whole tensors for it. torch's order,
which this follows: the step size from the parameter before weight decay; ``p *= 1 - lr wd``; each
statistic ``lerp``-ed towards its new mean with weight ``t^beta2_decay``; ``V = row_var col_var /
max(mean(row_var), eps1)`` (a matrix) or ``variance``; ``p -= alpha / denom x update``. ``eps1``
None is the parameter dtype's machine epsilon.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .rounding import UNIT_ROUNDOFF, gamma
from .tracked import Tracked, blend, norm_of


def _eps1(hp: Mapping[str, Any], dtype: str) -> float:
    eps = hp.get("eps") or [None, 1e-3]
    if eps[0] is not None:
        return float(eps[0])
    return 2.0 * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"])  # torch.finfo(dtype).eps


def adafactor(s: Mapping[str, Any], u: float, dtype: str) -> dict[str, Tracked]:
    """The parameter and state entries after one Adafactor step of the whole tensor sample ``s``
    (``shape``, ``grad``, ``pre``, ``step``, ``hp``), each with its bound."""
    hp = s["hp"]
    shape = tuple(int(n) for n in s["shape"])
    p = Tracked(np.reshape(s["pre"]["param"], shape))
    g = Tracked(np.reshape(s["grad"], shape))
    if hp.get("maximize"):
        g = Tracked(-g.v)
    lr, wd, d = float(hp["lr"]), float(hp.get("weight_decay", 0.0)), float(hp.get("d", 1.0))
    eps2 = float((hp.get("eps") or [None, 1e-3])[1])
    eps1 = _eps1(hp, dtype)
    t = float(s["step"]) + 1
    weight = t ** float(hp.get("beta2_decay", -0.8))
    rho = min(lr, 1 / math.sqrt(t))
    n = p.v.size
    rms = norm_of(p, u)
    rms = Tracked(rms.v / math.sqrt(n), rms.e / math.sqrt(n))
    alpha = Tracked(max(eps2, float(rms.v)) * rho, (float(rms.e) if float(rms.v) > eps2 else 0.0) * rho)
    if wd:
        p = p.times(1 - lr * wd, u)
    out: dict[str, Tracked] = {}
    if len(shape) > 1:
        rows = np.reshape(_pre(s, "row_var", shape[:-1] + (1,)), shape[:-1] + (1,))
        cols = np.reshape(_pre(s, "col_var", shape[:-2] + (1, shape[-1])), shape[:-2] + (1, shape[-1]))
        row_mean = g.square_sum(-1, u).times(1 / shape[-1], u)
        col_mean = g.square_sum(-2, u).times(1 / shape[-2], u)
        row_var = blend(Tracked(rows), row_mean, 1 - weight, u)
        col_var = blend(Tracked(cols), col_mean, 1 - weight, u)
        out["row_var"], out["col_var"] = row_var, col_var
        outer = Tracked(row_var.v * col_var.v,
                        np.abs(row_var.v) * col_var.e + np.abs(col_var.v) * row_var.e
                        + row_var.e * col_var.e + u * np.abs(row_var.v * col_var.v))
        m = shape[-2]
        level = row_var.v.mean(axis=-2, keepdims=True)  # a mean of values of one sign: gamma_m, then / m
        mean = Tracked(level, row_var.e.mean(axis=-2, keepdims=True) + (gamma(m, u) + u) * level)
        estimate = outer.div(mean.clamp_min(eps1), u)
    else:
        variance = blend(Tracked(_pre(s, "variance", shape)), g.mul(g, u), 1 - weight, u)
        out["variance"] = variance
        estimate = variance
    update = estimate.clamp_min(eps1 * eps1).rsqrt(u).mul(g, u)
    size = norm_of(update, u)
    ratio = Tracked(float(size.v) / (math.sqrt(n) * d), float(size.e) / (math.sqrt(n) * d))
    denom = Tracked(max(1.0, float(ratio.v)), float(ratio.e) if float(ratio.v) + float(ratio.e) > 1 else 0.0)
    scale = Tracked(-float(alpha.v) / float(denom.v),
                    (float(alpha.e) + float(alpha.v) * float(denom.e) / float(denom.v)) / float(denom.v))
    out["param"] = p.plus(update.scaled(scale, u), u)
    return {k: Tracked(v.v.reshape(-1), v.e.reshape(-1)) for k, v in out.items()}


def _pre(s: Mapping[str, Any], entry: str, shape: tuple[int, ...]) -> np.ndarray:
    """A statistic before the step: zeros where the optimizer creates it at this step."""
    value = s["pre"].get(entry)
    return np.zeros(shape) if value is None else np.asarray(value, dtype=np.float64)

