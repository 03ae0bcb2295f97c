"""C-ZERO-002's per-element rounding bound: how far a correct sharded run may drift from an unsharded
reference, propagated step by step through clipping and the optimizer. numpy only; every input is a
plain value (hyper-parameters, unit roundoffs, a reduction length, the reference's per-step arrays).

A correct sharded run computes the same mathematical step as the reference but adds its gradients in
another order (per rank, then across ranks; the reference may add one concatenated batch) and rounds
its own arithmetic. For every element and step the model bounds how far the two computations can
drift apart; a difference beyond it is not rounding. Notation: u the unit roundoff of the optimizer's
arithmetic (float32: 2^-24; float64: 2^-53), gamma_n = n u / (1 - n u) (Higham, Accuracy and
Stability, 3.1: the relative error of an n-term sum in any order), dp the bound on the parameters
(the master weights) after the previous step, zero at the start when both runs start from the same
weights (u |p_0| when one side starts from a rounded copy).

Working weights. The gradient is taken at the working weights w: the master itself, or its cast to
16 bits (mixed precision). Rounding is monotone, so a master p' with |p' - p| <= dp has a cast in
[cast(p - dp), cast(p + dp)]: dw = max(cast(p + dp) - cast(p), cast(p) - cast(p - dp)) (zero where
the interval holds no rounding boundary; at most dp + 2 u16 |p| + u16 dp, one 16-bit ulp more than dp).

Gradient. With n bounding the additions along any gradient element's chain of dot products (tokens
of the global batch + terms added across ranks and micro-batches + the model's dot-product depth),

    dg_i = 2 gamma_n (T_i + S) + kappa max|dw| + 2 u_g (T_i + kappa max|dw|) + f_g

T_i: the mean over the K local gradients (ranks x micro-batches) of |local gradient_i|, the terms the
run adds; S: the largest T_i of the tensor (cancellation inside a local batch happens at the tensor's
scale); the 2: both sides round. kappa max|dw| is the gradient's response to the weight difference
already accumulated, kappa the largest secant ratio max|g_k - g_k-1| / max|p_k - p_k-1| seen along the
reference's own trajectory (consecutive steps also change the batch). A secant over a large step
(a large learning rate) can under-state the local response, so where the reference can recompute
its gradient (``probe``) the response is also measured where it acts: the gradient of the same step
and batch at two admissible masters p + dp s, every element moved by its whole bound, s = sign(g)
(along each element's gradient) and s a fixed pseudo-random sign pattern; the response term is the
larger of kappa max|dw| and max |g(probe) - g|. u_g, f_g: a gradient rounded to a 16-bit type
(unit roundoff u_g, underflow f16 = half its smallest subnormal: |fl(x) - x| <= u_g |x| + f16) by
each side once per local gradient. The caller derives f_g from how each side scales (the
simulator: the engine rounds the K unscaled gradients and divides by K, f16; the ground truth rounds
each gradient already scaled by 1/K, K f16: f_g = (K + 1) f16). u_g = f_g = 0 when gradients stay in
the arithmetic's dtype.

Clipping (c = min(1, M / (norm + 1e-6)), or the caller's rounded formula of it, any non-increasing
function). The norm moves by at most dnorm = ||dg||_2 + gamma_P norm (P elements), so c by at most
dc = max(c(norm - dnorm) - c(norm), c(norm) - c(norm + dnorm)); the other side's factor is at most
c+ = min(c + dc, 1), so the clipped gradient moves by c+ dg_i + |g_i| dc, plus 2 u c+ |g_i| where a
factor below 1 may apply (a rounded product on each side).

SGD with momentum mu, dampening tau, weight decay wd (torch: d = g + wd p; buf = d on the first step,
else mu buf + (1 - tau) d; direction e = d + mu buf (Nesterov), buf (momentum) or d; p -= lr e):
dd = dg + wd dp + u(|g| + wd |p|); dbuf = mu dbuf + (1 - tau) dd + 2 gamma_3 (|buf| + 2 (1 - tau) |d|)
(dd + 2u|buf| first); de = dd + mu dbuf + u|e| (Nesterov), dbuf (momentum), dd + 2u|d| (none);
dp = dp + lr de + 2 gamma_2 (|p_before| + lr|e|).

Every local rounding term is taken at the scale of the terms an update adds, not of its result: where
they cancel (a moment whose new gradient opposes it, a weight stepped towards zero) the result is far
smaller than what each side rounded on the way, and implementations take different routes (torch's
``lerp``, an FMA, a fused kernel with float32 coefficients). mu |buf_old| <= |buf| +
(1 - tau) |d|, so |buf| + 2 (1 - tau) |d| bounds the momentum's terms; gamma_k counts the roundings on
the way (a coefficient, a product, the sum).

Adam / AdamW (AdamW: p *= 1 - lr wd, d = g; Adam: d = g + wd p as for SGD; m = b1 m + (1-b1) d;
v = b2 v + (1-b2) d^2; p -= lr m^/(sqrt(v^) + eps), ^ the bias corrections of step t):
dm = b1 dm + (1-b1) dd + 2 gamma_3 (|m| + 2 (1-b1) |d|) + 2u (|m| + |d|) (the terms' scale, as for the
momentum), dv = b2 dv + (1-b2)(2|d| dd + dd^2) + 2 gamma_4 v + 2u (v + d^2) (v's terms are >= 0: its
own scale; four roundings: the square, two coefficients, the sum). The last term of each is the
coefficients': an implementation that holds beta in float32 and forms 1 - beta from it (torch's fused
CUDA Adam does) weighs old and new by values up to u beta off, so m moves by u b1 (|m_old| + |d|) <=
u (|m| + |d|) and v by u b2 (v_old + d^2) <= u (v + d^2); for beta2 = 0.999 that is a relative change
of 1.3e-5 in the new gradient's weight, 200 ulps of a v made of it. With s = sqrt(v^),
ds = min(sqrt(dv^), dv^ / s) (|sqrt a - sqrt b| <= both) and s' = max(s - ds, 0) the smallest possible
perturbed root, the direction r = m^/(s + eps) moves by at most

    dr = dm^ / (s' + eps) + |m^| ds / ((s + eps)(s' + eps)) + 3u |r|.

Where the bias corrections are formed in float32 from float32 betas (torch's fused CUDA Adam) each
is off by up to (t + 2) u b^t / (1 - b^t) + u relative (:func:`bias_correction_error`), which moves r
by that of bc1 plus half that of bc2: added to the 3u|r|.

This is where Adam amplifies rounding: for an element whose gradient is near zero, s is tiny and a
rounding-sized dd becomes an O(1) change of r, i.e. an O(lr) change of the parameter. It is also
bounded: by Cauchy-Schwarz every Adam direction satisfies |r_t| <= R_t = (1-b1)/(1-b1^t)
sqrt((1-b2^t)/(1-b2)) sqrt((1-q^t)/(1-q)), q = b1^2/b2 (R_1 = 1), whatever the gradients; computed
with rounding, m carries at most 2t roundings, v 3t, the root and divisions 6 more, so
|r| <= R_t (1 + gamma_(4t+6)) on each side and dr <= 2 R_t (1 + gamma_(4t+6)). Then
dp = |1 - lr wd| dp + lr dr + 2 gamma_3 (|1 - lr wd| |p_before| + lr|r|) (AdamW; Adam: decay 1).

The bound of element i after step k is its dp (parameters) or the matching state bound; the grad
norm's is dnorm, the clip factor's dc. Everything is computed from the reference's own values, the
unit roundoffs and the sizes: nothing is fitted to a machine.

Why one module of this length: the derivation above is one chain (working weights, gradient, clipping,
optimizer) whose every term feeds the next; its docstring is the proof and the code follows it line
by line.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: unit roundoff u (half an ulp, relative) of each arithmetic dtype
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}
#: half the smallest subnormal: the largest absolute error of rounding a value that underflows
UNDERFLOW = {"float64": 2.0**-1075, "float32": 2.0**-150, "bfloat16": 2.0**-134, "float16": 2.0**-25}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of an n-term sum in any order."""
    nu = n * u
    if nu >= 1:
        return math.inf
    return nu / (1 - nu)


def bias_correction_error(beta: float, t: int, u: float) -> float:
    """The relative error of a bias correction ``1 - beta**t`` formed in the arithmetic's dtype: beta
    rounded (``beta**t`` off by ``t u beta**t``), the power (2u of it) and the difference (u), so at most
    ``(t + 2) u beta**t / (1 - beta**t) + u`` (about 3000 u at t = 1 for beta = 0.999; ``u`` once
    ``beta**t`` vanishes)."""
    power = beta ** float(t)
    return (t + 2) * u * power / (1.0 - power) + u if power < 1.0 else 0.0


def adam_direction_bound(beta1: float, beta2: float, t: int) -> float:
    """R_t: the largest |m^_t| / sqrt(v^_t) any gradient sequence can produce (Cauchy-Schwarz)."""
    q = beta1 * beta1 / beta2
    geometric = t if q == 1 else (1 - q**t) / (1 - q)
    return (1 - beta1) / (1 - beta1**t) * math.sqrt((1 - beta2**t) / (1 - beta2)) * math.sqrt(geometric)


@dataclass(frozen=True)
class OptimizerHyper:
    """The optimizer the bound follows: "sgd", "adam" (L2 weight decay) or "adamw" (decoupled)."""

    name: str
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], name: str | None = None) -> OptimizerHyper:
        """From a dict (or an object's ``to_dict()``) with torch.optim's keys; unknown keys are ignored."""
        b1, b2 = (float(b) for b in d.get("betas", (0.9, 0.999)))
        mx = d.get("max_grad_norm")
        return cls(
            name=str(name or d["name"]),
            lr=float(d["lr"]),
            weight_decay=float(d.get("weight_decay") or 0.0),
            momentum=float(d.get("momentum") or 0.0),
            dampening=float(d.get("dampening") or 0.0),
            nesterov=bool(d.get("nesterov", False)),
            betas=(b1, b2),
            eps=float(d.get("eps", 1e-8)),
            max_grad_norm=None if mx is None else float(mx),
        )


@dataclass
class StepValues:
    """What the reference knows about one step, arrays keyed by tensor name (any float dtype)."""

    t: int                                   # the optimizer's step count after the step (1-based)
    params_before: dict[str, np.ndarray]     # master weights the step started from
    params: dict[str, np.ndarray]            # master weights after the step
    state: dict[str, dict[str, np.ndarray]]  # optimizer state after the step, by torch name
    grad: dict[str, np.ndarray]              # mean gradient over the global batch, before clipping
    grad_terms: dict[str, np.ndarray]        # mean over the local gradients of |local gradient|
    grad_norm: float
    clip_coef: float                         # the factor the reference applied (1.0: none)


@dataclass
class StepBounds:
    """Per-element bounds after one step: parameters and optimizer state (torch.optim names), the
    unclipped and the clipped gradient, and the grad norm and clip factor."""

    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]
    grad: dict[str, np.ndarray] = field(default_factory=dict)
    grad_norm: float = 0.0
    clip_coef: float = 0.0
    clipped_grad: dict[str, np.ndarray] = field(default_factory=dict)  # the gradient the optimizer consumed


def exact_clip_coefficient(max_norm: float) -> Callable[[float], float]:
    """torch.nn.utils.clip_grad_norm_'s factor in real arithmetic: min(1, M / (norm + 1e-6))."""

    def coef(norm: float) -> float:
        return min(1.0, float(max_norm) / (max(norm, 0.0) + 1e-6))

    return coef


class RoundingBound:
    """Propagates the per-element bound of one training run, step by step (see the module docstring).

    ``u``: unit roundoff of the optimizer's arithmetic; ``n``: the reduction length of the gradient;
    ``working_cast``: the cast of master weights to the working dtype (None: they compute with the
    master); ``grad_roundoff`` / ``grad_floor``: u_g and f_g of a 16-bit gradient; ``clip_function``:
    the clip factor as a function of the norm (default the real formula); ``initial_dp``: the bound
    before the first step (default zero); ``probe``: the reference's mean gradient of a step (its
    values) at other master weights (by tensor), None where it cannot recompute one."""

    def __init__(
        self,
        hyper: OptimizerHyper,
        *,
        u: float,
        n: int,
        working_cast: Callable[[np.ndarray], np.ndarray] | None = None,
        grad_roundoff: float = 0.0,
        grad_floor: float = 0.0,
        clip_function: Callable[[float], float] | None = None,
        initial_dp: dict[str, np.ndarray] | None = None,
        probe: Callable[[StepValues, dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
    ):
        self.hyper = hyper
        self.u = u
        self.n = n
        self.gamma_n = gamma(n, u)
        self.working_cast = working_cast
        self.grad_roundoff = grad_roundoff
        self.grad_floor = grad_floor
        mx = hyper.max_grad_norm
        self.clip_function = clip_function or (None if mx is None else exact_clip_coefficient(mx))
        self.probe = probe
        self.dp: dict[str, np.ndarray] | None = initial_dp
        self.dstate: dict[str, dict[str, np.ndarray]] = {}
        self.kappa = 0.0
        self._last: StepValues | None = None

    def with_reduction_length(self, n: int) -> RoundingBound:
        """A fresh bound (nothing propagated yet) with every setting of this one but the reduction
        length ``n``: the same model applied to a chain of ``n`` reordered additions."""
        return RoundingBound(self.hyper, u=self.u, n=n, working_cast=self.working_cast,
                             grad_roundoff=self.grad_roundoff, grad_floor=self.grad_floor,
                             clip_function=self.clip_function, probe=self.probe)

    # ---- gradient ---------------------------------------------------------------------------------
    def _secant(self, values: StepValues) -> None:
        last = self._last
        if last is None:
            return
        dg = max(float(np.max(np.abs(values.grad[n] - last.grad[n]), initial=0.0)) for n in values.grad)
        dp = max(
            float(np.max(np.abs(values.params_before[n] - last.params_before[n]), initial=0.0))
            for n in values.grad
        )
        if dp > 0:
            self.kappa = max(self.kappa, dg / dp)

    def weight_spread(self, values: StepValues) -> float:
        """max |dw|: the largest possible difference of the working weights this step computes with."""
        if self.dp is None:
            return 0.0
        if self.working_cast is None:
            return max((float(np.max(d, initial=0.0)) for d in self.dp.values()), default=0.0)
        cast = self.working_cast
        spread = 0.0
        for name, d in self.dp.items():
            if not d.size or not np.any(d > 0):
                continue
            p = np.asarray(values.params_before[name], dtype=np.float64)
            lo = (p - d).astype(np.float32)  # a float32 at or below every float32 >= p - dp
            hi = (p + d).astype(np.float32)
            here = np.asarray(cast(p.astype(np.float32)), dtype=np.float64)
            up = np.asarray(cast(hi), dtype=np.float64) - here
            down = here - np.asarray(cast(lo), dtype=np.float64)
            spread = max(spread, float(np.max(np.maximum(up, down))))
        return spread

    def probed_response(self, values: StepValues) -> float:
        """max |g(p + dp s) - g| over two sign patterns s: the gradient's change at two admissible masters,
        every element moved by its whole bound, along its own gradient and in a fixed pseudo-random
        direction (seeded by the step count, so the bound is reproducible)."""
        if self.probe is None or self.dp is None:
            return 0.0
        rng = np.random.default_rng(values.t)
        out = 0.0
        for pattern in ("gradient", "random"):
            master = {}
            for name, d in self.dp.items():
                p = np.asarray(values.params_before[name], dtype=np.float64)
                if pattern == "gradient":
                    sign = np.where(np.asarray(values.grad[name]) >= 0, 1.0, -1.0)
                else:
                    sign = rng.choice([-1.0, 1.0], size=p.shape)
                master[name] = (p + sign * d).astype(np.float32)
            g = self.probe(values, master)
            for name, ref in values.grad.items():
                diff = np.abs(np.asarray(g[name], dtype=np.float64) - np.asarray(ref, dtype=np.float64))
                if np.isnan(diff).any():  # the probe left the finite range: no finite response bound
                    return math.inf
                out = max(out, float(np.max(diff, initial=0.0)))
        return out

    def gradient_bound(self, values: StepValues) -> dict[str, np.ndarray]:
        """dg for every element: reordering of the sums, the response to the accumulated weight
        difference and the 16-bit rounding of the local gradients."""
        self._secant(values)
        spread = self.weight_spread(values)
        response = self.kappa * spread if spread > 0 and self.kappa > 0 else 0.0
        if spread > 0:
            response = max(response, self.probed_response(values))
        ug, fg = self.grad_roundoff, self.grad_floor
        out = {}
        for name, terms in values.grad_terms.items():
            t = np.asarray(terms, dtype=np.float64)
            scale = float(np.max(t)) if t.size else 0.0
            dg = 2 * self.gamma_n * (t + scale) + response
            if ug or fg:
                dg = dg + 2 * ug * (t + response) + fg
            out[name] = dg
        return out

    def clipped_gradient_bound(
        self, values: StepValues, dg: dict[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], float, float]:
        """(bound on the clipped gradient, dnorm, dc)."""
        total = sum(values.grad[n].size for n in values.grad)
        dnorm = math.sqrt(sum(float(np.sum(d * d)) for d in dg.values())) + gamma(total, self.u) * abs(
            values.grad_norm
        )
        coef = self.clip_function
        if coef is None:
            return dg, dnorm, 0.0
        c, norm = values.clip_coef, values.grad_norm
        dc = max(abs(coef(norm + dnorm) - c), abs(coef(max(norm - dnorm, 0.0)) - c))
        binds = c < 1.0 or dc > 0.0
        top = min(c + dc, 1.0)  # the largest factor the other side can apply (a clip factor is <= 1)
        out = {}
        for n in dg:
            g = np.abs(np.asarray(values.grad[n], dtype=np.float64))
            out[n] = top * dg[n] + g * dc + (2 * self.u * top * g if binds else 0.0)
        return out, dnorm, dc

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, values: StepValues) -> StepBounds:
        with np.errstate(all="ignore"):
            return self._step(values)

    def _step(self, values: StepValues) -> StepBounds:
        raw = self.gradient_bound(values)
        dg, dnorm, dc = self.clipped_gradient_bound(values, raw)
        h, u, t = self.hyper, self.u, values.t
        lr, wd = h.lr, h.weight_decay
        dp_prev = self.dp or {n: np.zeros(np.shape(a)) for n, a in values.params.items()}
        coef = values.clip_coef
        gamma2, gamma3, gamma4 = gamma(2, u), gamma(3, u), gamma(4, u)
        dp: dict[str, np.ndarray] = {}
        dstate: dict[str, dict[str, np.ndarray]] = {}
        for name, p_after in values.params.items():
            p = np.abs(np.asarray(p_after, dtype=np.float64))
            p_before = np.asarray(values.params_before[name], dtype=np.float64)
            g = coef * np.asarray(values.grad[name], dtype=np.float64)
            st = values.state.get(name, {})
            prev = self.dstate.get(name, {})
            zeros = np.zeros_like(p)
            if h.name == "sgd":
                mu, tau = h.momentum, h.dampening
                d = g + wd * p_before
                dd = dg[name] + wd * dp_prev[name] + u * (np.abs(g) + wd * np.abs(p_before))
                if mu != 0:
                    buf = np.abs(np.asarray(st.get("momentum_buffer", d), dtype=np.float64))
                    if t == 1:
                        dbuf = dd + 2 * u * buf
                    else:  # rounded at the terms' scale: mu |buf_old| <= |buf| + (1 - tau) |d|
                        terms = buf + 2 * (1 - tau) * np.abs(d)
                        dbuf = mu * prev.get("momentum_buffer", zeros) + (1 - tau) * dd + 2 * gamma3 * terms
                    if h.nesterov:
                        e = np.abs(d) + mu * buf
                        de = dd + mu * dbuf + u * e
                    else:
                        e, de = buf, dbuf
                else:
                    e = np.abs(d)
                    de = dbuf = dd + 2 * u * e
                dp[name] = dp_prev[name] + lr * de + 2 * gamma2 * (np.abs(p_before) + lr * e)
                dstate[name] = {"momentum_buffer": dbuf}
            else:
                b1, b2 = h.betas
                decoupled = h.name == "adamw"
                if decoupled or wd == 0:
                    d, dd, decay = g, dg[name], 1 - lr * wd if decoupled else 1.0
                else:
                    d = g + wd * p_before
                    dd = dg[name] + wd * dp_prev[name] + u * (np.abs(g) + wd * np.abs(p_before))
                    decay = 1.0
                m = np.abs(np.asarray(st["exp_avg"], dtype=np.float64))
                v = np.asarray(st["exp_avg_sq"], dtype=np.float64)
                # each side rounds m at its terms' scale, b1 |m_old| + (1 - b1) |d| <= |m| + 2 (1 - b1) |d|
                # (cancellation leaves |m| far below it), and v at v's (its terms are >= 0)
                # and a beta held in the arithmetic's dtype moves both weights by up to u beta:
                # u b1 (|m_old| + |d|) <= u (|m| + |d|), u b2 (v_old + d^2) <= u (v + d^2)
                terms = m + 2 * (1 - b1) * np.abs(d)
                dm = (b1 * prev.get("exp_avg", zeros) + (1 - b1) * dd + 2 * gamma3 * terms
                      + 2 * u * (m + np.abs(d)))
                dv = (b2 * prev.get("exp_avg_sq", zeros) + (1 - b2) * (2 * np.abs(d) * dd + dd**2)
                      + 2 * gamma4 * v + 2 * u * (v + d**2))
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                s = np.sqrt(v / bc2)
                ds = np.minimum(np.sqrt(dv / bc2), np.where(s > 0, (dv / bc2) / s, np.inf))
                s_low = np.maximum(s - ds, 0.0)
                eps = h.eps
                r = (m / bc1) / (s + eps)
                dr = ((dm / bc1) / (s_low + eps) + (m / bc1) * ds / ((s + eps) * (s_low + eps))
                      + (3 * u + bias_correction_error(b1, t, u) + bias_correction_error(b2, t, u) / 2) * r)
                cap = 2 * adam_direction_bound(b1, b2, t) * (1 + gamma(4 * t + 6, u))
                dr = np.fmin(dr, cap)  # fmin: a 0/0 (eps = 0, nothing moved) is the cap, not NaN
                r = np.fmin(r, cap / 2)
                terms = abs(decay) * np.abs(p_before) + lr * r
                dp[name] = abs(decay) * dp_prev[name] + lr * dr + 2 * gamma3 * terms
                dstate[name] = {"exp_avg": dm, "exp_avg_sq": dv}
        self.dp, self.dstate, self._last = dp, dstate, values
        return StepBounds(dp, dstate, raw, dnorm, dc, dg)
