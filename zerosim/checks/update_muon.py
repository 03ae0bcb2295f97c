"""torch.optim.Muon's step recomputed in float64 on a whole matrix, for the update check
(:mod:`zerosim.checks.update_formula`), with a bound on its Newton-Schulz part estimated from twins.

torch's step of a 2-D parameter: ``buf = lerp(buf, g, 1 - mu)``; the iteration's input ``X = lerp(g,
buf, mu)`` (Nesterov) or ``buf``; ``O = NS(X)``, five (``ns_steps``) quintic Newton-Schulz iterations
with coefficients ``(a, b, c)`` on ``X / max(||X||, eps)`` (transposed while it has more rows than
columns); ``p *= 1 - lr wd``; ``p -= lr' O`` with ``lr' = lr sqrt(max(1, A / B))`` (``original``, the
default), ``0.2 lr sqrt(max(A, B))`` (``match_rms_adamw``).

The momentum buffer and the weight decay are elementwise float32 arithmetic, bounded by the running
model of :mod:`zerosim.checks.tracked`. The iteration is not: torch runs it in bfloat16, whose roundings
a float64 recomputation cannot follow, and a GPU's bfloat16 matmuls round in yet another order. Its
bound is estimated as :mod:`zerosim.engine.matrix_bound` and ``zerosim verify`` estimate Muon's: two
bfloat16 twins of the iteration run on the host, one on ``X``, one on ``X`` with every element moved by
half a bfloat16 ulp (seeded signs, which turns about half of the input's roundings the other way), and
every element of ``O`` may be ``SAFETY x max(d_twin, u_bf16 max|O|)`` from the float64 ``O``,
``d_twin`` the twins' largest distance from it (a per-tensor bound: the iteration spreads any
difference over the whole matrix). The estimate is kept with the sample (``ns_spread``, ``d_twin``),
so that a trace judged on another machine uses the run's own estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .rounding import UNIT_ROUNDOFF
from .tolerance import SAFETY
from .tracked import Tracked, blend

#: half a bfloat16 ulp, relative: the twin's perturbation of the iteration's input
BF16_HALF_ULP = 2.0**-9
#: torch's default Newton-Schulz coefficients and iteration count
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5


def newton_schulz(x: Any, coefficients: Any, steps: int, eps: float) -> Any:
    """torch's quintic iteration on the tensor ``x`` in its dtype (float64 for the formula, bfloat16 for
    a twin)."""
    import torch

    a, b, c = (float(k) for k in coefficients)
    o = x.T if x.shape[0] > x.shape[1] else x
    o = o / o.norm().clamp(min=eps)
    for _ in range(int(steps)):
        gram = o @ o.T
        o = torch.addmm(o, torch.addmm(gram, gram, gram, beta=b, alpha=c), o, beta=a)
    return o.T if x.shape[0] > x.shape[1] else o


def adjusted_lr(lr: float, how: str | None, shape: tuple[int, ...]) -> float:
    """Muon's learning rate for a matrix of ``shape`` (torch's ``_adjust_lr``)."""
    rows, cols = shape[:2]
    if how is None or how == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if how == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


def ns_spread(x: np.ndarray, hp: Mapping[str, Any], exact: np.ndarray) -> float:
    """The twins' largest distance from the float64 iteration ``exact`` (see the module docstring)."""
    coefficients = hp.get("ns_coefficients") or NS_COEFFICIENTS
    steps, eps = int(hp.get("ns_steps", NS_STEPS)), float(hp.get("eps", 1e-7))
    import torch

    rng = np.random.default_rng(x.size)
    moved = x * (1 + rng.choice([-BF16_HALF_ULP, BF16_HALF_ULP], size=x.shape))
    far = 0.0
    for twin in (x, moved):
        got = newton_schulz(torch.from_numpy(twin).float().bfloat16(), coefficients, steps, eps)
        far = max(far, float(np.abs(got.double().numpy() - exact).max(initial=0.0)))
    return far


def muon(s: dict[str, Any], u: float) -> dict[str, Tracked]:
    """The parameter and momentum buffer after one Muon step of the whole matrix sample ``s``, each with
    its bound; records the twins' spread in ``s["ns_spread"]`` when it is not there yet."""
    hp = s["hp"]
    shape = tuple(int(n) for n in s["shape"])
    g = Tracked(np.asarray(s["grad"], dtype=np.float64))
    before = s["pre"].get("momentum_buffer")
    mu = float(hp.get("momentum", 0.95))
    buf = blend(Tracked(np.zeros(g.v.shape) if before is None else before), g, mu, u)
    x = blend(g, buf, 1 - mu, u) if hp.get("nesterov", True) else buf
    coefficients = hp.get("ns_coefficients") or NS_COEFFICIENTS
    steps, eps = int(hp.get("ns_steps", NS_STEPS)), float(hp.get("eps", 1e-7))
    import torch

    matrix = x.v.reshape(shape)
    exact = newton_schulz(torch.from_numpy(matrix), coefficients, steps, eps).numpy()
    if s.get("ns_spread") is None:
        s["ns_spread"] = ns_spread(matrix, hp, exact)
    floor = UNIT_ROUNDOFF["bfloat16"] * float(np.abs(exact).max(initial=0.0))
    o = Tracked(exact.reshape(-1), SAFETY * max(float(s["ns_spread"]), floor))
    lr, wd = float(hp["lr"]), float(hp.get("weight_decay", 0.0))
    p = Tracked(np.asarray(s["pre"]["param"], dtype=np.float64))
    if wd:
        p = p.times(1 - lr * wd, u)
    step = adjusted_lr(lr, hp.get("adjust_lr_fn"), shape)
    return {"momentum_buffer": buf, "param": p.plus(o.times(-step, u), u)}
