"""C-ZERO-002's tolerances, for every precision and for both the simulator and ``zerosim verify``.

Two kinds, both derived, none fitted to a machine:

* **Per-element derived bounds** (the judge of record). The rounding-error model of
  :mod:`zerosim.checks.rounding` (the derivation is there) propagated step by step from the
  reference's own values, the unit roundoff of the arithmetic dtype (:func:`unit_roundoff`: float64
  2^-53, float32 2^-24, bfloat16 2^-8, float16 2^-11) and the reduction length ``n``. The engine
  builds its bound in :mod:`zerosim.engine.reference`; a live trainer's is :class:`ErrorModel`, over
  verify's float64 torch reference (``torch.optim.SGD`` with momentum and weight decay, or
  ``torch.optim.AdamW``, on the global batch). Its reduction length
  (:func:`reduction_length`) = tokens of the global batch + ranks + 4 (layers + 1) (widest layer)
  bounds the additions on any gradient element's chain of dot products. A trainer that keeps float32
  master weights of a float64 model (every parameter float32-representable after every step, e.g.
  DeepSpeed) is judged with u = 2^-24 and starts from dp = u |p_0|, the rounding of the initial
  weights. Optimizer ``step`` counters must match exactly.
* **The normwise fallback** (:class:`Tolerance`, :data:`EQUIVALENCE_TOLERANCE`) for a reference that
  carries no per-element bounds: ``|got - expected| <= atol_scale * max|expected|`` per state array.
  Values and their justification: contracts/C-ZERO-002.toml (a test keeps them in sync).

The bounds of a gradient norm live here too: :func:`norm_relative_bound` (a monitored run's logged
norms, C-ZERO-002's ``grad_norm``) and :func:`logged_norm_bound` (C-ZERO-008).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..errors import ConfigError
from .rounding import (
    UNIT_ROUNDOFF,
    OptimizerHyper,
    RoundingBound,
    StepBounds,
    StepValues,
    adam_direction_bound,
    gamma,
)

__all__ = ["EQUIVALENCE_TOLERANCE", "ErrorModel", "StepBounds", "Tolerance", "adam_direction_bound",
           "equivalence_tolerance", "gamma", "logged_norm_bound", "norm_relative_bound", "reduction_chain",
           "reduction_length", "unit_roundoff", "SAFETY"]

#: how many times one perturbed twin's distance from the reference a correct run may be off, wherever a
#: bound is estimated from a perturbed twin instead of derived (a matrix optimizer in the engine,
#: :mod:`zerosim.engine.matrix_bound`, and under ``zerosim verify``,
#: :mod:`zerosim.verify.estimated_bound`; the normwise mixed-precision bounds,
#: :mod:`zerosim.checks.mixed_precision`; Muon's orthogonalised update, :mod:`zerosim.checks.update_muon`).
#: One perturbation is one sample of a correct run's spread; 10 scales it to cover the others.
SAFETY = 10.0


# ---- the normwise fallback ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """The normwise fallback for a reference without per-element bounds: elementwise
    ``|got - expected| <= atol_scale * max|expected|`` per state array (the array's own scale:
    parameters are O(1), Adam's second moment O(g^2)); grad norm and clip factor within ``norm_rtol``
    relative. A reference that carries bounds (the engine's ground truth) is judged by them instead.
    Values and their justification: contracts/C-ZERO-002.toml."""

    atol_scale: float
    norm_rtol: float

    def to_json(self) -> dict[str, float]:
        return {"atol_scale": self.atol_scale, "norm_rtol": self.norm_rtol}


# fp32 2e-5 is the worst-case float32 reordering bound (n u, n ~ 300 terms); the 16-bit ones are
# 2.5-4x one 16-bit ulp doubled by Adam's g^2 (bf16 2 * 2^-8, fp16 2 * 2^-11). It cannot cover Adam's
# amplification of a near-zero gradient element's rounding (an O(lr) parameter difference):
# contracts/C-ZERO-002.toml, docs/contracts-and-tolerances.md.
EQUIVALENCE_TOLERANCE = {
    "fp32": Tolerance(atol_scale=2e-5, norm_rtol=1e-6),
    "bf16": Tolerance(atol_scale=2e-2, norm_rtol=2e-3),
    "fp16": Tolerance(atol_scale=4e-3, norm_rtol=2.5e-4),
}


def equivalence_tolerance(precision: str) -> Tolerance:
    """The normwise fallback of a precision policy ("fp32", "bf16", "fp16"; fp32's for any other)."""
    return EQUIVALENCE_TOLERANCE.get(precision, EQUIVALENCE_TOLERANCE["fp32"])


# ---- per-element derived bounds for a live trainer -----------------------------------------------------


def unit_roundoff(dtype: str) -> float:
    """The unit roundoff of an arithmetic dtype; ConfigError (field ``dtype``) for any other."""
    if dtype not in UNIT_ROUNDOFF:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[dtype]


class ModelSizes(Protocol):
    """The sizes of a model that bound its reduction length (verify's ``GPTConfig`` is one)."""

    @property
    def batch(self) -> int: ...  # sequences per rank per step

    @property
    def block(self) -> int: ...  # tokens per sequence

    @property
    def n_layer(self) -> int: ...

    @property
    def widest(self) -> int: ...


class ReferenceValues(Protocol):
    """One step of an unsharded float64 reference, keyed by parameter name (verify's ``ReferenceStep``)."""

    phase_step: int
    params_before: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]
    grad: dict[str, np.ndarray]
    grad_terms: dict[str, np.ndarray]
    grad_norm: float
    clip_coef: float


def reduction_length(cfg: ModelSizes, world: int) -> int:
    """A bound on the number of additions along any gradient element's chain (see the module docstring)."""
    return world * cfg.batch * cfg.block + world + 4 * (cfg.n_layer + 1) * cfg.widest


class ErrorModel:
    """C-ZERO-002's per-element bound for a live trainer: propagates the bound of one optimizer phase,
    step by step, from the reference's steps."""

    def __init__(
        self, optim: dict[str, Any], dtype: str, cfg: ModelSizes, world: int, *, rounded_start: bool = False
    ):
        # the live-trainer reference runs torch.optim.SGD for "sgd", torch.optim.Adam for "adam" (L2 weight
        # decay) and torch.optim.AdamW for "adamw"; matrix optimizers have an estimated bound instead
        name = optim["name"] if optim["name"] in ("sgd", "adam") else "adamw"
        self.optim = optim
        self.dtype = dtype
        self.u = unit_roundoff(dtype)
        self.n = reduction_length(cfg, world)
        self.rounded_start = rounded_start  # the trainer starts from the weights rounded to ``dtype``
        self.bound = RoundingBound(OptimizerHyper.from_mapping(optim, name=name), u=self.u, n=self.n)

    @property
    def kappa(self) -> float:
        """The gradient's secant ratio seen so far (the response to an accumulated difference)."""
        return self.bound.kappa

    def step(self, ref: ReferenceValues) -> StepBounds:
        if self.bound.dp is None and self.rounded_start:  # float32 masters of a float64 model
            self.bound.dp = {n: self.u * np.abs(a) for n, a in ref.params_before.items()}
        return self.bound.step(
            StepValues(
                t=ref.phase_step,
                params_before=ref.params_before,
                params=ref.params,
                state=ref.state,
                grad=ref.grad,
                grad_terms=ref.grad_terms,
                grad_norm=ref.grad_norm,
                clip_coef=ref.clip_coef,
            )
        )


# ---- gradient norms ---------------------------------------------------------------------------------


def reduction_chain(n: int) -> int:
    """The most roundings along any one term's path through a norm of ``n`` squares: one square, the
    additions of a blocked reduction tree (at most 16 additions per level, fan-in at most 16: torch's CPU
    cascade sum and every GPU tree reduction), one per-tensor square root and square, one final root;
    a plain left-to-right sum (``n`` additions) when that is shorter."""
    levels = math.ceil(math.log(max(n, 2), 16)) + 1
    return min(n, 16 * levels) + 8


def norm_relative_bound(n: int, dtype: str) -> float:
    """C-ZERO-002 on a monitored run (clause ``grad_norm``): the relative error bound of a norm of ``n``
    squares computed in ``dtype``: gamma of its reduction chain (a square root halves a relative error,
    so gamma bounds the root too)."""
    return gamma(reduction_chain(n), UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF["float32"]))


def norm_accumulation(dtype: str) -> str:
    """C-ZERO-002 on a monitored run (clause ``grad_norm``): the dtype a rank accumulates the norm of a
    ``dtype`` gradient piece in when it recomputes the norm: float64 for a float64 gradient, float32
    for every other (what ``clip_grad_norm_`` accumulates a float32 or narrower gradient in; one read
    of the gradient, where a float64 accumulation of a float32 tensor costs a conversion per element)."""
    return "float64" if dtype == "float64" else "float32"


def logged_norm_bound(ref_norm: float, grad_bound: Mapping[str, np.ndarray], u: float, world: int) -> float:
    """C-ZERO-008: the most a correct trainer's logged norm may differ from the reference's ``ref_norm``:
    ``||dg||_2 + gamma_(P+W+3)(u) (||g|| + ||dg||_2)`` (derived in :mod:`zerosim.checks.logged_norm`)."""
    dg = math.sqrt(sum(float(np.sum(np.square(np.asarray(b, dtype=np.float64))))
                       for b in grad_bound.values()))
    elements = sum(int(np.asarray(b).size) for b in grad_bound.values())
    return dg + gamma(elements + world + 3, u) * (abs(ref_norm) + dg)
