"""C-ZERO-002's per-element tolerance for ``zerosim verify``: the rounding-error model of
:mod:`zerosim.checks.rounding` (the derivation is there), applied to verify's float64 torch reference
for the trainer's arithmetic dtype (float64: u = 2^-53; float32: u = 2^-24).

Verify's reference is ``torch.optim.SGD`` (momentum, weight decay) or ``torch.optim.AdamW`` on the
global batch. The reduction length n = (tokens of the global batch) + (ranks) + 4 (layers + 1)
(widest layer) bounds the additions on any gradient element's chain of dot products. The tolerance
of element i at step k is its dp (parameters) or the matching state bound; "step" counters must match
exactly. A trainer that keeps float32 master weights of a float64 model (every parameter
float32-representable after every step, e.g. DeepSpeed) is judged with u = 2^-24 and starts from
dp = u |p_0|, the rounding of the initial weights. Everything is computed from the reference's own
values, the unit roundoff and the sizes: nothing is fitted to a machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zerosim.checks.rounding import (
    OptimizerHyper,
    RoundingBound,
    StepBounds,
    StepValues,
    adam_direction_bound,
    gamma,
)
from zerosim.errors import ConfigError

from .model import GPTConfig
from .reference import ReferenceStep

__all__ = ["ErrorModel", "StepBounds", "adam_direction_bound", "gamma", "reduction_length", "unit_roundoff"]

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24}


def unit_roundoff(dtype: str) -> float:
    if dtype not in UNIT_ROUNDOFF:
        raise ConfigError("dtype", dtype, f"must be one of {', '.join(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[dtype]


def reduction_length(cfg: GPTConfig, world: int) -> int:
    """A bound on the number of additions along any gradient element's chain (see the module docstring)."""
    return world * cfg.batch * cfg.block + world + 4 * (cfg.n_layer + 1) * cfg.widest


class ErrorModel:
    """Propagates the per-element bound of one phase, step by step, from verify's reference steps."""

    def __init__(
        self, optim: dict[str, Any], dtype: str, cfg: GPTConfig, world: int, *, rounded_start: bool = False
    ):
        # verify's reference runs torch.optim.SGD for "sgd" and torch.optim.AdamW for anything else
        name = "sgd" if optim["name"] == "sgd" else "adamw"
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

    def step(self, ref: ReferenceStep) -> StepBounds:
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
