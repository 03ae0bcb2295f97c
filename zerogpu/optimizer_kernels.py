"""``ZeroTrainer(optimizer_kernel=...)``: which kernel steps the engine's flat optimizer shard.

- ``"reference"`` (the default): zerosim's exact optimizer, by the fastest kernel that gives its bits
  on this machine (:mod:`zerogpu.exact_optimizer`);
- ``"torch"`` / ``"fused"``: torch.optim's own kernels (:mod:`zerogpu.torch_kernels`), within
  C-ZERO-002's rounding bound of the reference;
- ``"compiled"``: the reference's operations compiled into one device pass (:mod:`zerogpu.compiled_kernel`;
  the exact reference on a CPU).
"""

from __future__ import annotations

from typing import Any

from zerosim.errors import ConfigError
from zerosim.numerics.optim import OptimizerSpec
from zerosim.numerics.xp import ArrayNamespace

from .compiled_kernel import make_compiled_optimizer
from .exact_optimizer import make_exact_optimizer
from .torch_kernels import TorchKernelOptimizer

#: ``optimizer_kernel`` values: zerosim's exact optimizer, torch.optim's default kernel, torch's fused
#: kernel, the reference's operations compiled into one device pass
OPTIMIZER_KERNELS = ("reference", "torch", "fused", "compiled")


def make_step_optimizer(spec: OptimizerSpec, xp: ArrayNamespace, kernel: str) -> Any:
    """The engine's optimizer for ``optimizer_kernel=kernel`` (see :data:`OPTIMIZER_KERNELS`)."""
    if kernel not in OPTIMIZER_KERNELS:
        raise ConfigError("optimizer_kernel", kernel, f"must be one of {', '.join(OPTIMIZER_KERNELS)}")
    if kernel == "reference":
        return make_exact_optimizer(spec, xp)
    if kernel == "compiled":
        return make_compiled_optimizer(spec, xp)
    return TorchKernelOptimizer(spec, xp, fused=kernel == "fused")
