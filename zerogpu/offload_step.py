"""An offloaded :class:`zerogpu.ZeroTrainer`'s optimizer step: the engine's shard stepped by the host tier.

With ``offload=OffloadConfig(...)`` the trainer builds its engine with :class:`HostTierStep` as the
optimizer. The engine keeps calling ``step(master, grad, state)`` once per optimizer step, after the
global-norm clip; this class hands those three (the rank's fp32 master shard, its reduced and
clipped gradient shard, its optimizer state) to a :class:`zerogpu.host_optimizer.HostOptimizer`
built over them with :meth:`HostOptimizer.over` (no copy: the host optimizer steps the engine's own
buffers in place), so the offloaded step runs the host tier's kernel:

- ``"reference"`` (the trainer's ``optimizer_kernel="reference"``, the default, and ``"compiled"``,
  which on the CPU is the same exact reference): zerosim's exact optimizer, so the offloaded step is
  bitwise the step without offload.
- ``"fused"`` (``optimizer_kernel="fused"``): torch's fused CPU kernel, one vectorised pass. Bitwise
  the reference on the elements its vector loop handles where torch's CPU build has FMA; the last
  ``n mod 16`` elements of the shard go through its scalar tail, within C-ZERO-002's one-step bound
  (:mod:`zerogpu.host_optimizer` says why).

The host optimizer is rebuilt whenever the engine passes different buffers (a hybrid step's
replicate all-reduce returns a new gradient shard, a checkpoint load may replace the state dict);
otherwise the one built at the first step is reused.

Why the whole shard in one call, not per unit as :class:`zerogpu.offload_gradients.GradientOffload`
steps it: the engine clips every gradient by the global norm, which is known only once the last
unit's gradient has been reduced, so no unit's piece can be stepped before then. GradientOffload's
per-unit step is the schedule for a run without clipping, and its copies the schedule for a GPU
(the trainer refuses offload there: see ``docs/gpu.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from zerosim.errors import ConfigError
from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.xp import torch_namespace

from .host_optimizer import HOST_KERNELS, HostOptimizer

#: the trainer's ``optimizer_kernel`` -> the host tier's kernel (``"torch"`` keeps torch.optim's
#: single-tensor kernel, which the host tier does not offer: the engine's own optimizer steps then)
HOST_KERNEL_OF = {"reference": "reference", "compiled": "reference", "fused": "fused"}


def host_kernel_for(optimizer_kernel: str) -> str | None:
    """The host tier's kernel for the trainer's ``optimizer_kernel``; None for ``"torch"``."""
    return HOST_KERNEL_OF.get(optimizer_kernel)


class HostTierStep:
    """The engine's optimizer interface (``init_state``, ``step``) over a :class:`HostOptimizer`
    wrapping the buffers the engine passes (see the module docstring). ``host``: the host optimizer
    of the last step (None before the first)."""

    def __init__(self, spec: OptimizerSpec, kernel: str):
        if kernel not in HOST_KERNELS:
            raise ConfigError("offload.host_kernel", kernel, f"must be one of {', '.join(HOST_KERNELS)}")
        self.spec = spec
        self.kernel = kernel
        self._reference = make_optimizer(spec, torch_namespace("cpu"))  # state allocation and checks
        self.host: HostOptimizer | None = None
        self.steps = 0

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        return self._reference.init_state(n, dtype)

    def step(self, param: Any, grad: Any, state: dict[str, Any]) -> None:
        """One step of the master shard ``param`` and ``state`` with ``grad``, in place, on the host."""
        self._reference._check(param, grad, state)
        for field, t in (("master", param), ("grad", grad)):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise ConfigError(f"offload.{field}", getattr(t, "device", type(t).__name__),
                                  "the host tier steps CPU tensors only")
        host = self.host
        if host is None or host.master is not param or host.grad is not grad or host.state is not state:
            host = self.host = HostOptimizer.over(self.spec, param, grad, state, kernel=self.kernel)
        host.step()
        self.steps += 1
