"""A rounding-error model of one float32 optimizer step, and the check of zerosim.numerics.optim against
torch.optim that uses it (imported by test modules: pytest puts tests/ on sys.path).

Why a model and not a threshold: torch's CPU kernels differ between processors (fused multiply-add
on AVX2 / AVX-512 / arm64 kernels, unfused ``a * b + c`` under ``ATEN_CPU_CAPABILITY=default``; a
vectorised ``sqrt`` that is not correctly rounded), so "at most k% of elements differ" or "measured
<= x" holds on the processor it was tuned on and nowhere else. A bound derived from the arithmetic
holds on every processor.

The model (standard forward error analysis, Higham, *Accuracy and Stability of Numerical
Algorithms*, ch. 2-3). Every elementwise float32 operation on either side returns its exact result
times ``(1 + d)`` with ``|d| <= DELTA = 2u``, ``u = 2**-24``, plus at most ``TINY = 2**-149`` in the
subnormal range. ``2u`` rather than ``u`` so that one bound covers a faithfully rounded (not
correctly rounded) vector ``sqrt``, zerosim's float64-emulated fma (one extra rounding of the
float64 sum: relative ``2**-53``) and an FMA kernel as well as an unfused ``a * b + c`` (the
product's rounding is charged separately, so fused or not is covered). Python-float
hyper-parameters are rounded to float32 by the kernels: relative error ``u`` each.

:class:`Bounded` carries, per element, the exact value ``x`` (evaluated in float64 from the shared
float32 inputs) and a bound ``e`` with ``|x_hat - x| <= e`` for ANY evaluation of the same formula
under that model. Propagation, with ``X = |x| + e`` the largest magnitude a computed value can have:

* ``a + b``:     ``e = e_a + e_b + DELTA * (|a + b| + e_a + e_b) + TINY``
* ``a * b``:     ``e = |a| e_b + |b| e_a + e_a e_b + DELTA * (|ab| + that) + TINY``
* ``a * b + c``: the product's error and rounding (unfused kernels), then the sum's
* ``a / b``:     ``e = (|b| e_a + |a| e_b) / (|b| (|b| - e_b))`` (infinite when ``e_b >= |b|``), + rounding
* ``sqrt(a)``:   ``e = min(sqrt(e_a), e_a / (sqrt(a) + sqrt(max(a - e_a, 0))))``, + rounding

Products and quotients are associative in this model (``(a * b) / c`` and ``a * (b / c)`` get the
same bound), so torch's ``addcdiv`` and zerosim's ``(m * -step_size) / denom`` are both covered.
Each side's result is within ``e`` of the exact value, so the two sides are within ``2 e`` of each
other: that is the per-element bound :func:`check_step` asserts. The float64 evaluation of the model
itself is off by ~``1e-15`` relative; :data:`MODEL_SLACK` covers it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from zerosim.numerics.optim import (
    OptimizerSpec,
    apply_clip_,
    clip_coefficient,
    global_norm_from_sumsq,
    make_optimizer,
)
from zerosim.numerics.xp import numpy_namespace

U = 2.0**-24  # float32 unit roundoff
DELTA = 2.0 * U  # per-operation relative error: faithful rounding
TINY = 2.0**-149  # absolute error of one rounding into float32's subnormal range
MODEL_SLACK = 1.0 + 2.0**-30  # the float64 evaluation of the model itself


def gamma(n: int, unit: float = U) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: relative error bound of n roundings in a product chain,
    and of ANY summation order of n + 1 non-negative terms."""
    return n * unit / (1.0 - n * unit)


@dataclass(frozen=True)
class Bounded:
    """Exact values ``x`` (float64 array) and an absolute error bound ``e`` that holds for every
    float32 evaluation of the same formula under the model in this module's docstring."""

    x: np.ndarray
    e: np.ndarray

    @staticmethod
    def exact(values) -> Bounded:
        """A shared input: both sides start from these exact float32 values."""
        x = np.asarray(values, dtype=np.float64)
        return Bounded(x, np.zeros_like(x))

    @staticmethod
    def const(c: float) -> Bounded:
        """A Python-float hyper-parameter that a kernel rounds to float32 (relative error u)."""
        return Bounded(np.float64(c), np.float64(abs(c) * U))

    @staticmethod
    def rounded(x, e) -> Bounded:
        """A result whose inputs contribute error ``e``, after one more rounding of ``x``."""
        return Bounded(x, e + DELTA * (np.abs(x) + e) + TINY)

    def __add__(self, o: Bounded) -> Bounded:
        return Bounded.rounded(self.x + o.x, self.e + o.e)

    def __sub__(self, o: Bounded) -> Bounded:
        return Bounded.rounded(self.x - o.x, self.e + o.e)

    def __mul__(self, o: Bounded) -> Bounded:
        return Bounded.rounded(self.x * o.x, np.abs(self.x) * o.e + np.abs(o.x) * self.e + self.e * o.e)

    def __truediv__(self, o: Bounded) -> Bounded:
        ob = np.abs(o.x)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(ob > o.e, (ob * self.e + np.abs(self.x) * o.e) / (ob * (ob - o.e)), np.inf)
            return Bounded.rounded(self.x / o.x, e)

    def sqrt(self) -> Bounded:
        r = np.sqrt(self.x)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.minimum(np.sqrt(self.e), self.e / (r + np.sqrt(np.maximum(self.x - self.e, 0.0))))
        return Bounded.rounded(r, np.where(self.e == 0, 0.0, e))

    def clamp_max(self, hi: float) -> Bounded:
        """``min(x, hi)`` with ``hi`` exact: min is 1-Lipschitz, and a value whose whole error interval
        lies above ``hi`` is exactly ``hi`` on both sides."""
        x = np.minimum(self.x, hi)
        return Bounded(x, np.where(self.x - self.e > hi, 0.0, self.e))


def fma(a: Bounded, b: Bounded, c: Bounded) -> Bounded:
    """``a * b + c``, fused or not: the product is charged its own rounding (an unfused kernel), the
    sum its rounding; a fused kernel makes one of them zero."""
    return (a * b) + c


def lerp(start: Bounded, end: Bounded, w: Bounded) -> Bounded:
    """torch's ``lerp(start, end, w)`` with either of its two evaluations (``start + w * (end - start)``
    for ``|w| < 0.5``, ``end - (1 - w) * (end - start)`` otherwise; zerosim reproduces both). The
    exact value is ``start + w * (end - start)``; the bound takes the worse of the two branches:
    ``1 - w`` is exact in float32 for ``w`` in ``[0.5, 1]`` (Sterbenz), its error is ``w``'s."""
    diff = end - start
    k = np.maximum(np.abs(w.x), np.abs(1.0 - w.x))
    prod_e = k * diff.e + np.abs(diff.x) * w.e + w.e * diff.e
    prod = k * np.abs(diff.x)
    prop = np.maximum(start.e, end.e) + prod_e + DELTA * (prod + prod_e) + TINY
    return Bounded.rounded(start.x + w.x * diff.x, prop)


# ---- the optimizers' formulas, in torch's order of operations (torch/optim/sgd.py, adam.py) --------


def sgd_model(spec: OptimizerSpec, p: Bounded, g: Bounded, buf: Bounded | None, t: int) -> dict[str, Bounded]:
    """``_single_tensor_sgd``: ``g += wd * p``; ``buf = g`` at step 1, else ``buf = buf * m + (1 - d) g``;
    ``g += m * buf`` (nesterov) or ``g = buf``; ``p += -lr * g``."""
    out: dict[str, Bounded] = {}
    if spec.weight_decay != 0:
        g = fma(p, Bounded.const(spec.weight_decay), g)
    if spec.momentum != 0:
        if t == 1 or buf is None:
            buf = g
        else:
            buf = fma(g, Bounded.const(1.0 - spec.dampening), buf * Bounded.const(spec.momentum))
        out["momentum_buffer"] = buf
        g = fma(buf, Bounded.const(spec.momentum), g) if spec.nesterov else buf
    out["param"] = fma(g, Bounded.const(-spec.lr), p)
    return out


def adam_model(
    spec: OptimizerSpec, p: Bounded, g: Bounded, m: Bounded, v: Bounded, t: int
) -> dict[str, Bounded]:
    """``_single_tensor_adam``: AdamW ``p *= 1 - lr wd`` / Adam ``g += wd p``; ``m = lerp(m, g, 1 - b1)``;
    ``v = v b2 + (1 - b2) g g``; ``denom = sqrt(v) / sqrt(1 - b2^t) + eps``;
    ``p += (-lr / (1 - b1^t)) m / denom``. Bias corrections are Python floats on both sides."""
    b1, b2 = spec.betas
    if spec.weight_decay != 0:
        if spec.name == "adamw":
            p = p * Bounded.const(1.0 - spec.lr * spec.weight_decay)
        else:
            g = fma(p, Bounded.const(spec.weight_decay), g)
    m = lerp(m, g, Bounded.const(1.0 - b1))
    v = fma(g * Bounded.const(1.0 - b2), g, v * Bounded.const(b2))
    bc1, bc2 = 1.0 - b1 ** float(t), 1.0 - b2 ** float(t)
    denom = v.sqrt() / Bounded.const(bc2**0.5) + Bounded.const(spec.eps)
    step = (m * Bounded.const(-spec.lr / bc1)) / denom
    return {"param": p + step, "exp_avg": m, "exp_avg_sq": v}


def clip_coefficient_model(norm: Bounded, max_norm: float) -> Bounded:
    """torch's clip factor ``min(1, max_norm / (norm + 1e-6))`` in float32, from a norm with its bound."""
    return (Bounded.const(max_norm) / (norm + Bounded.const(1e-6))).clamp_max(1.0)


def norm_model(g: Bounded) -> Bounded:
    """The global 2-norm as torch's ``clip_grad_norm_`` computes it in float32.

    ``|(||g_hat|| - ||g||)| <= ||e_g||_2`` (triangle inequality) for inexact inputs. torch then sums
    the float32 squares in float32 in an order we do not fix: ANY order of n non-negative terms has
    relative error <= gamma_{n-1}, the squares add u each (gamma_n), the root halves that and rounds
    once (2u), and torch's second norm over the per-tensor norms (a square and a root) adds 3u more:
    ``gamma_{n + 8}`` covers the lot. zerosim sums in float64, far inside the same bound."""
    n = int(g.x.size)
    norm = float(np.sqrt(math.fsum(np.square(g.x).ravel())))
    e_g = float(np.sqrt(math.fsum(np.square(g.e).ravel())))
    return Bounded(np.float64(norm), np.float64(e_g + gamma(n + 8) * (norm + e_g)))


def clip_model(g: Bounded, max_norm: float) -> Bounded:
    """The gradient after ``clip_grad_norm_``: ``g`` times the clip factor (one float32 multiply)."""
    return g * clip_coefficient_model(norm_model(g), max_norm)


# ---- one step on each side ----------------------------------------------------------------------------


def torch_optimizer(spec: OptimizerSpec, p):
    """The torch.optim optimizer for ``spec`` on parameter ``p`` (single-tensor path)."""
    import torch

    if spec.name == "sgd":
        return torch.optim.SGD(
            [p],
            lr=spec.lr,
            momentum=spec.momentum,
            dampening=spec.dampening,
            nesterov=spec.nesterov,
            weight_decay=spec.weight_decay,
            foreach=False,
        )
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls([p], lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False)


def torch_step(
    spec: OptimizerSpec, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray], t: int
) -> dict[str, np.ndarray]:
    """torch.optim's step ``t`` from the given parameter and state (copied in): clip_grad_norm_ first
    when ``spec.max_grad_norm`` is set. Returns the new parameter and state as float32 arrays."""
    import torch

    tp = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch_optimizer(spec, tp)
    if spec.name != "sgd":
        opt.state[tp] = {
            "step": torch.tensor(float(t - 1), dtype=torch.float32),
            **{k: torch.from_numpy(state[k].copy()) for k in spec.state_names},
        }
    elif spec.momentum != 0 and t > 1:  # torch's buffer is None before the first step
        opt.state[tp] = {"momentum_buffer": torch.from_numpy(state["momentum_buffer"].copy())}
    tp.grad = torch.from_numpy(g.copy())
    if spec.max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([tp], spec.max_grad_norm, foreach=False)
    opt.step()
    out = {"param": tp.detach().numpy().copy()}
    for k in spec.state_names:
        out[k] = opt.state[tp][k].numpy().copy()
    return out


def zerosim_step(
    spec: OptimizerSpec,
    p: np.ndarray,
    g: np.ndarray,
    state: dict[str, np.ndarray],
    t: int,
    make: Callable = make_optimizer,
) -> dict[str, np.ndarray]:
    """zerosim's step ``t`` (its global-norm clipping first) from copies of the given parameter and
    state; ``make`` builds the optimizer (the tests pass deliberately wrong ones)."""
    ns = numpy_namespace()
    opt = make(spec, ns)
    p, g = p.copy(), g.copy()
    st = {"step": t - 1, **{k: state[k].copy() for k in spec.state_names}}
    if spec.max_grad_norm is not None:
        apply_clip_(g, clip_coefficient(global_norm_from_sumsq(ns.sum_of_squares(g)), spec.max_grad_norm), ns)
    opt.step(p, g, st)
    return {"param": p, **{k: st[k] for k in spec.state_names}}


def step_model(
    spec: OptimizerSpec, p: Bounded, g: Bounded, state: dict[str, Bounded], t: int
) -> dict[str, Bounded]:
    """The rounding model of step ``t`` (clipping included) from possibly inexact inputs."""
    if spec.max_grad_norm is not None:
        g = clip_model(g, spec.max_grad_norm)
    if spec.name == "sgd":
        return sgd_model(spec, p, g, state.get("momentum_buffer"), t)
    return adam_model(spec, p, g, state["exp_avg"], state["exp_avg_sq"], t)


def violations(
    step: int,
    got: dict[str, np.ndarray],
    want: dict[str, np.ndarray],
    model: dict[str, Bounded],
    limit: int = 3,
) -> list[str]:
    """One line per element where ``|got - want| > 2 e`` (each side is within ``e`` of the exact
    value): the step, the array and element, both values, the difference, the bound, the exact value;
    and one line for elements whose bound is infinite (a divisor the model cannot keep from zero)."""
    lines = []
    for name, b in model.items():
        diff = np.abs(got[name].astype(np.float64) - want[name].astype(np.float64))
        bound = 2.0 * b.e * MODEL_SLACK
        bad = np.flatnonzero(~(diff <= bound))
        for i in bad[:limit]:
            lines.append(
                f"step {step} {name}[{i}]: zerosim={float(got[name][i]):.9g} "
                f"torch={float(want[name][i]):.9g} |diff|={diff[i]:.3e} > bound={bound[i]:.3e} "
                f"(exact {float(b.x[i]):.17g})"
            )
        if bad.size > limit:
            lines.append(f"step {step} {name}: {bad.size - limit} more elements outside the bound")
        if not np.all(np.isfinite(bound)):  # an element the model cannot bound is an element not checked
            lines.append(
                f"step {step} {name}: {int(np.sum(~np.isfinite(bound)))} elements without a finite bound"
            )
    return lines


def check_step(
    spec: OptimizerSpec,
    p: np.ndarray,
    g: np.ndarray,
    state: dict[str, np.ndarray],
    t: int,
    make: Callable = make_optimizer,
) -> tuple[list[str], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Teacher-forced comparison of step ``t``: zerosim and torch each take ONE step from the same
    float32 parameter, gradient and state; every element of the parameter and of each state must lie
    within ``2 e`` of torch's (:func:`violations`). Returns (violation lines, zerosim's result,
    torch's result)."""
    ours = zerosim_step(spec, p, g, state, t, make)
    theirs = torch_step(spec, p, g, state, t)
    model = step_model(
        spec, Bounded.exact(p), Bounded.exact(g), {k: Bounded.exact(state[k]) for k in spec.state_names}, t
    )
    return violations(t, ours, theirs, model), ours, theirs


def gradient(rng: np.random.Generator, p: np.ndarray) -> np.ndarray:
    """A training-like float32 gradient for parameters ``p``: a quadratic pull plus noise, each element
    scaled by 10**U(-4, 0) so that magnitudes from 1e-5 to 1 occur (small ones make ``eps`` matter)."""
    n = p.size
    noise = rng.standard_normal(n)
    scale = 10.0 ** rng.uniform(-4, 0, n)
    return ((0.5 * p.astype(np.float64) + noise) * scale).astype(np.float32)


def teacher_forced_run(
    spec: OptimizerSpec, n: int, steps: int, seed: int, make: Callable = make_optimizer
) -> list[str]:
    """``steps`` teacher-forced steps (torch's result is the next step's shared input) on ``n``
    elements; returns every violation line (empty: zerosim matches torch within the model at every
    step)."""
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n).astype(np.float32)
    state = {k: np.zeros(n, np.float32) for k in spec.state_names}
    lines: list[str] = []
    for t in range(1, steps + 1):
        bad, _, theirs = check_step(spec, p, gradient(rng, p), state, t, make)
        lines += bad
        p = theirs["param"]
        state = {k: theirs[k] for k in spec.state_names}
    return lines


def free_running_run(
    spec: OptimizerSpec, n: int, steps: int, seed: int, make: Callable = make_optimizer
) -> list[str]:
    """``steps`` steps in which each side keeps its OWN parameters and state (zerosim's ``state`` dict
    carries its step counter and buffers as in training) and computes its gradient from its own
    parameters, so differences feed back. The model runs alongside on the exact values: each step's
    bound starts from the previous step's (inputs inexact by ``e``), and the gradient
    ``f32((0.5 p + noise) * scale)`` adds ``0.5 scale e_p`` plus its own rounding. Returns the
    violation lines of every step; catches what a teacher-forced step cannot see, such as state that
    is not carried from one step to the next."""
    import torch

    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(n).astype(np.float32)
    ns = numpy_namespace()
    opt = make(spec, ns)
    ours, state = p0.copy(), opt.init_state(n)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = torch_optimizer(spec, tp)
    mp = Bounded.exact(p0)
    mstate = {k: Bounded.exact(np.zeros(n, np.float32)) for k in spec.state_names}
    lines: list[str] = []
    for t in range(1, steps + 1):
        noise = rng.standard_normal(n)
        scale = 10.0 ** rng.uniform(-4, 0, n)
        g_ours = ((0.5 * ours.astype(np.float64) + noise) * scale).astype(np.float32)
        g_torch = ((0.5 * tp.detach().numpy().astype(np.float64) + noise) * scale).astype(np.float32)
        gx = (0.5 * mp.x + noise) * scale
        mg = Bounded.rounded(gx, 0.5 * scale * mp.e)  # 2u also covers the float64 evaluation
        if spec.max_grad_norm is not None:
            norm = global_norm_from_sumsq(ns.sum_of_squares(g_ours))
            apply_clip_(g_ours, clip_coefficient(norm, spec.max_grad_norm), ns)
        opt.step(ours, g_ours, state)
        tp.grad = torch.from_numpy(g_torch)
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([tp], spec.max_grad_norm, foreach=False)
        topt.step()
        model = step_model(spec, mp, mg, mstate, t)
        got = {"param": ours, **{k: state[k] for k in spec.state_names}}
        want = {"param": tp.detach().numpy(), **{k: topt.state[tp][k].numpy() for k in spec.state_names}}
        lines += violations(t, got, want, model)
        mp, mstate = model["param"], {k: model[k] for k in spec.state_names}
    return lines
