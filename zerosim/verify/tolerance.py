"""C-ZERO-002's per-element tolerance for ``zerosim verify``: a rounding-error model propagated through the
optimizer, derived for the trainer's arithmetic dtype (float64: u = 2^-53; float32: u = 2^-24).

A correct sharded trainer computes the same mathematical step as the reference, but adds its
gradients in another order (per rank, then across ranks; the reference adds the concatenated batch)
and rounds its optimizer arithmetic independently. The model bounds, for every element and every
step, how far two such computations can drift apart; a difference beyond it is not rounding.

Gradient (per step). Every gradient element is a sum over the global batch's tokens of products
along a chain of dot products. With n = (tokens of the global batch) + (ranks) + 4 (layers + 1)
(widest layer) bounding the number of additions on any chain, and gamma_n = n u / (1 - n u) the
classical bound for a reordered sum (Higham, Accuracy and Stability, 3.1), the difference is at most

    dg_i = 2 gamma_n (T_i + S) + kappa * max|dp_prev|

where T_i is the mean over ranks of |local gradient_i| (the terms the trainer adds), S the largest
T_i in the tensor (cancellation inside a rank's batch happens at the tensor's scale), the 2 covers
the trainer's and the reference's rounding, and the last term is the gradient's response to the
parameter difference already accumulated, kappa the largest secant ratio |g_k - g_k-1| / |p_k - p_k-1|
seen along the reference's own trajectory (an over-estimate of the gradient's Lipschitz constant,
since consecutive steps also change the batch).

Clipping (clip_grad_norm_, c = min(1, M / (norm + 1e-6))): the norm moves by at most ||dg||_2 +
gamma_P norm (P parameters), so c moves by at most dc = max |c(norm +- dnorm) - c(norm)|, and the
clipped gradient by c dg_i + |g_i| dc.

SGD with momentum mu and weight decay wd (torch: d = g + wd p; buf = mu buf + d; p -= lr buf):
dd = dg + wd dp + u(|g| + wd|p|); dbuf = mu dbuf + dd + 2u|buf|; dp = dp + lr dbuf + 2u(|p| + lr|buf|).

AdamW (p *= 1 - lr wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr m^/(sqrt(v^) + eps)):
dm = b1 dm + (1-b1) dg + 2u|m|, dv = b2 dv + (1-b2)(2|g| dg + dg^2) + 2u v. With s = sqrt(v^),
ds = min(sqrt(dv^), dv^ / s) (|sqrt a - sqrt b| <= both) and s' = max(s - ds, 0) the smallest
possible perturbed root, the update direction r = m^/(s + eps) moves by at most

    dr = dm^ / (s' + eps) + |m^| ds / ((s + eps)(s' + eps)) + 3u |r|.

This is where Adam amplifies rounding: for an element whose gradient is near zero, s is tiny and a
rounding-sized dg becomes an O(1) change of r, i.e. an O(lr) change of the parameter (why float32
AdamW drifts to ~1e-3 on a correct trainer). It is also bounded: by Cauchy-Schwarz every Adam
direction satisfies |r_t| <= R_t = (1-b1)/(1-b1^t) sqrt((1-b2^t)/(1-b2)) sqrt((1-q^t)/(1-q)),
q = b1^2/b2 (R_1 = 1), so dr <= 2 R_t whatever the rounding did. Then
dp = (1 - lr wd) dp + lr dr + 2u(|p| + lr|r|).

The tolerance of element i at step k is its dp (parameters) or the matching state bound; "step"
counters must match exactly. A trainer that keeps float32 master weights of a float64 model (every
parameter float32-representable after every step, e.g. DeepSpeed) is judged with u = 2^-24 and starts
from dp = u |p_0|, the rounding of the initial weights. Everything above is computed from the
reference's own values, the unit roundoff and the sizes: nothing is fitted to a machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.errors import ConfigError

from .model import GPTConfig
from .reference import ReferenceStep

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}


def unit_roundoff(dtype: str) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[dtype]


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum in any order."""
    nu = n * u
    if nu >= 1:
        return math.inf
    return nu / (1 - nu)


def reduction_length(cfg: GPTConfig, world: int) -> int:
    """A bound on the number of additions along any gradient element's chain (see the module docstring)."""
    return world * cfg.batch * cfg.block + world + 4 * (cfg.n_layer + 1) * cfg.widest


def adam_direction_bound(beta1: float, beta2: float, t: int) -> float:
    """R_t: the largest |m^_t| / sqrt(v^_t) any gradient sequence can produce (Cauchy-Schwarz)."""
    q = beta1 * beta1 / beta2
    geometric = t if q == 1 else (1 - q**t) / (1 - q)
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2)) * math.sqrt(geometric)


@dataclass
class StepBounds:
    """Per-element bounds after one step: parameters and optimizer state (torch.optim names)."""

    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]


class ErrorModel:
    """Propagates the per-element bound of one phase, step by step (see the module docstring)."""

    def __init__(
        self, optim: dict[str, Any], dtype: str, cfg: GPTConfig, world: int, *, rounded_start: bool = False
    ):
        self.rounded_start = rounded_start  # the trainer starts from the weights rounded to ``dtype``
        self.optim = optim
        self.dtype = dtype
        self.u = unit_roundoff(dtype)
        self.n = reduction_length(cfg, world)
        self.gamma_n = gamma(self.n, self.u)
        self.dp: dict[str, np.ndarray] | None = None
        self.dstate: dict[str, dict[str, np.ndarray]] = {}
        self.kappa = 0.0
        self._last: ReferenceStep | None = None

    def _secant(self, ref: ReferenceStep) -> None:
        last = self._last
        if last is None:
            return
        dg = max(float(np.max(np.abs(ref.grad[n] - last.grad[n]))) for n in ref.grad)
        dp = max(float(np.max(np.abs(ref.params_before[n] - last.params_before[n]))) for n in ref.grad)
        if dp > 0:
            self.kappa = max(self.kappa, dg / dp)

    def gradient_bound(self, ref: ReferenceStep) -> dict[str, np.ndarray]:
        """dg for every element: reordering of the sums plus the response to the accumulated dp."""
        self._secant(ref)
        spread = max((float(np.max(np.abs(d))) for d in (self.dp or {}).values()), default=0.0)
        out = {}
        for name, terms in ref.grad_terms.items():
            scale = float(np.max(terms)) if terms.size else 0.0
            out[name] = 2 * self.gamma_n * (terms + scale) + self.kappa * spread
        return out

    def clipped_gradient_bound(self, ref: ReferenceStep, dg: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is None:
            return dg
        total = sum(ref.grad[n].size for n in ref.grad)
        dnorm = (
            math.sqrt(sum(float(np.sum(d * d)) for d in dg.values())) + gamma(total, self.u) * ref.grad_norm
        )

        def coef(norm: float) -> float:
            return min(1.0, float(max_norm) / (max(norm, 0.0) + 1e-6))

        c = ref.clip_coef
        dc = max(abs(coef(ref.grad_norm + dnorm) - c), abs(coef(ref.grad_norm - dnorm) - c))
        return {n: c * dg[n] + np.abs(ref.grad[n]) * dc for n in dg}

    def step(self, ref: ReferenceStep) -> StepBounds:
        dg = self.clipped_gradient_bound(ref, self.gradient_bound(ref))
        coef = ref.clip_coef
        if self.dp is not None:
            dp_prev = self.dp
        elif self.rounded_start:  # float32 masters of a float64 model: one rounding before the first step
            dp_prev = {n: self.u * np.abs(a) for n, a in ref.params_before.items()}
        else:
            dp_prev = {n: np.zeros_like(a) for n, a in ref.params.items()}
        u, lr, wd = self.u, float(self.optim["lr"]), float(self.optim.get("weight_decay", 0.0))
        dp: dict[str, np.ndarray] = {}
        dstate: dict[str, dict[str, np.ndarray]] = {}
        for name, p in ref.params.items():
            g = coef * ref.grad[name]
            p0 = np.abs(ref.params_before[name])
            st = ref.state.get(name, {})
            prev = self.dstate.get(name, {})
            if self.optim["name"] == "sgd":
                mu = float(self.optim.get("momentum", 0.0))
                dd = dg[name] + wd * dp_prev[name] + u * (np.abs(g) + wd * p0)
                buf = np.abs(st.get("momentum_buffer", g + wd * ref.params_before[name]))
                dbuf = mu * prev.get("momentum_buffer", np.zeros_like(p)) + dd + 2 * u * buf
                dp[name] = dp_prev[name] + lr * dbuf + 2 * u * (np.abs(p) + lr * buf)
                dstate[name] = {"momentum_buffer": dbuf}
            else:
                b1, b2 = (float(b) for b in self.optim.get("betas", (0.9, 0.999)))
                eps = float(self.optim.get("eps", 1e-8))
                t = ref.phase_step
                m, v = np.abs(st["exp_avg"]), st["exp_avg_sq"]
                dm = b1 * prev.get("exp_avg", np.zeros_like(p)) + (1 - b1) * dg[name] + 2 * u * m
                dv = (
                    b2 * prev.get("exp_avg_sq", np.zeros_like(p))
                    + (1 - b2) * (2 * np.abs(g) * dg[name] + dg[name] ** 2)
                    + 2 * u * v
                )
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                s = np.sqrt(v / bc2)
                with np.errstate(divide="ignore", invalid="ignore"):
                    ds = np.minimum(np.sqrt(dv / bc2), np.where(s > 0, (dv / bc2) / s, np.inf))
                s_low = np.maximum(s - ds, 0.0)
                r = (m / bc1) / (s + eps)
                dr = (dm / bc1) / (s_low + eps) + (m / bc1) * ds / ((s + eps) * (s_low + eps)) + 3 * u * r
                dr = np.minimum(dr, 2 * adam_direction_bound(b1, b2, t))
                dp[name] = (1 - lr * wd) * dp_prev[name] + lr * dr + 2 * u * (np.abs(p) + lr * r)
                dstate[name] = {"exp_avg": dm, "exp_avg_sq": dv}
        self.dp, self.dstate, self._last = dp, dstate, ref
        return StepBounds(dp, dstate)
