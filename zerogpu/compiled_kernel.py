"""``optimizer_kernel="compiled"``: the reference's update as one fused device pass (torch.compile).

zerosim's reference optimizer (:mod:`zerosim.numerics.optim`) emulates each float32 operation of torch's
single-tensor kernel exactly, which on a GPU costs several passes over the shard (float64
temporaries for the emulated fused multiply-adds). This kernel writes the same operations, in the
same order and with the same float32-rounded coefficients, as one elementwise function of
``(param, grad, state)`` and lets torch.compile (Inductor; Triton on CUDA) fuse it into one pass that
reads each element's parameter, gradient and state once and writes them once, in place.

**On the CPU the exact reference runs** (:func:`make_compiled_optimizer` returns it for a CPU
namespace): the CPU keeps the bits every other kernel there is compared with.

Coefficients that change every step (the bias corrections) are passed as 0-d float32 tensors, so
one compiled graph serves every step (a Python float would be a new constant, a recompilation).

Rounding against the reference, operation by operation (AdamW; Adam adds ``g + wd p``, SGD its
multiply-adds in the same way):

- ``p * (1 - lr wd)``, ``g - m``, ``v * b2``, ``g * (1 - b2)``, ``m * (-step_size)``, ``+ eps``:
  single IEEE float32 operations on both sides: the same bits.
- the two multiply-adds (``lerp`` of ``m``; ``v + ((1 - b2) g) g``): the reference rounds each once
  (a fused multiply-add). Triton contracts ``a * b + c`` into an FMA by default, the same single
  rounding; where a backend does not contract, the product is rounded first: one more faithful
  rounding (``|error| <= u``, u = 2^-24) in each.
- ``sqrt(v)`` and the two divisions: the reference rounds each correctly; a device may use an
  approximate square root or division (a few ulps, e.g. CUDA's ``div.full.f32``: 2 ulp).

C-ZERO-002's one-step bound (:mod:`zerosim.checks.rounding`) is derived from every float32 operation
being faithful with the multiply-adds counted as a product and a sum, and it is taken at the scale
of the terms each update adds: an extra rounding of a multiply-add is inside it, and an operation
off by a few ulps of its own result is inside it as long as that stays below the slack the model
gives that operation (the ``gamma_k`` terms of the square root and the divisions). That last point
is what tests/test_zerogpu_compiled_kernel.py measures on a GPU (and ``zerosim gpu-check``'s kernel
step, which checks every kernel against the bound); on a CPU the test checks the same function run
eagerly in float32 (every multiply-add rounded twice) against the bound.
"""

from __future__ import annotations

from typing import Any

import torch

from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.xp import ArrayNamespace

from .triton_kernel import adam_coefficients


def adam_update_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, c: torch.Tensor,
                 decay: str, lerp_low: bool) -> None:
    """One Adam/AdamW step in place, the reference's operations in its order.

    ``c``: float32 coefficients ``[1 - lr wd or wd, lerp weight, beta2, 1 - beta2, sqrt(bc2), eps,
    -step_size]`` (the lerp weight already ``w - 1`` when ``lerp_low`` is False, as torch's lerp);
    ``decay``: ``"decoupled"`` (AdamW), ``"l2"`` (Adam with weight decay) or ``"none"``."""
    wd, w, b2, omb2, bc2s, eps, neg_step = (c[i] for i in range(7))
    if decay == "decoupled":
        p.copy_(p * wd)
    elif decay == "l2":
        g = p * wd + g  # Adam's L2 term (the reference: fma(p, wd, g))
    d = g - m
    m.copy_(d * w + m if lerp_low else d * w + g)
    v.copy_((g * omb2) * g + v * b2)
    denom = torch.sqrt(v) / bc2s + eps
    p.copy_(p + (m * neg_step) / denom)


class CompiledOptimizer:
    """The engine's optimizer interface (``init_state``, ``step``) over :func:`adam_update_` compiled
    for the device; SGD runs the reference (its update is one multiply-add per operand already)."""

    def __init__(self, spec: OptimizerSpec, xp: ArrayNamespace, *, compile: bool = True):
        self.spec = spec
        self.xp = xp
        self._reference = make_optimizer(spec, xp)
        self._fn: Any = (torch.compile(adam_update_, dynamic=False, fullgraph=True) if compile
                         else adam_update_)

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        return self._reference.init_state(n, dtype)

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        s = self.spec
        if s.name == "sgd" or param.dtype != torch.float32:
            self._reference.step(param, grad, state)
            return
        self._reference._check(param, grad, state)
        t = int(state["step"]) + 1
        decay, lerp_low, coeffs = adam_coefficients(s, t)
        c = torch.tensor(coeffs, dtype=torch.float32, device=param.device)
        self._fn(param, grad, state["exp_avg"], state["exp_avg_sq"], c, decay, lerp_low)
        state["step"] = t


def make_compiled_optimizer(spec: OptimizerSpec, xp: ArrayNamespace) -> Any:
    """``optimizer_kernel="compiled"``: the exact reference on the CPU, the compiled pass on a device."""
    if xp.backend != "torch" or xp.device in ("cpu", None):
        return make_optimizer(spec, xp)
    return CompiledOptimizer(spec, xp)
