"""The unsharded references' values, step by step (what C-ZERO-002 compares a run with).

:class:`Reference` holds one :class:`ReferenceStep` per step: the full master and optimizer state, the
step counter, loss, grad norm and clip factor, and for the ground truth the per-element bounds;
:func:`reduction_length` is the length of the longest chain of additions behind a gradient element,
which every bound of a reordered reduction starts from. :mod:`zerosim.engine.reference` builds the
references, :mod:`zerosim.engine.matrix_bound` those of the matrix optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .config import ResolvedRun


@dataclass
class ReferenceStep:
    """Full (unsharded) state after step ``step`` (0-based), as float32 numpy arrays."""

    step: int
    master: np.ndarray
    state: dict[str, np.ndarray]
    optimizer_step: int
    loss: float
    grad_norm: float
    clip_coef: float
    grads: np.ndarray | None = None       # the clipped gradient the optimizer consumed (ordered only)
    params: np.ndarray | None = None      # working params after the step (param dtype)
    #: per-element rounding bounds (independent only), flat float64 by kind: "master",
    #: "optimizer.<state name>"; and the bounds of the grad norm and the clip factor
    bounds: dict[str, np.ndarray] | None = None
    grad_norm_bound: float | None = None
    clip_coef_bound: float | None = None


@dataclass
class Reference:
    name: str
    steps: list[ReferenceStep] = field(default_factory=list)
    diverged_at: int | None = None  # the 0-based step at which it went non-finite (no ReferenceStep)


def reduction_length(run: ResolvedRun) -> int:
    """A bound on the additions along any gradient element's chain: the global batch's tokens, the
    local gradients added across ranks and micro-batches, and 4 (layers + 1) dot products of at most
    the widest dimension (vocabulary, width or MLP width) each."""
    cfg = run.model_cfg
    local = run.world_size * run.micro_batches
    widest = max(cfg.vocab_size, cfg.d_model, cfg.d_ff)
    return local * cfg.tokens_per_micro_batch + local + 4 * (cfg.n_layer + 1) * widest
