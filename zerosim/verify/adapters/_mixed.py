"""A built-in adapter's side of ``optim["mixed_precision"]``: autocast compute, the reduction hook, the
loss scaler (:mod:`zerosim.verify.mixed_precision` defines the policy).

:class:`AmpPolicy` turns the policy into torch's own tools: ``torch.autocast(param_dtype)`` over the
float32 model (float32 masters and optimizer state stay the model's own parameters and torch.optim's
state; autocast keeps the ops it lists, e.g. the loss, in float32), and for fp16 a
``torch.amp.GradScaler`` configured from ``loss_scale`` (scale the loss, unscale before the clip, skip
a step with non-finite gradients, back off, grow). Without a policy every method is the plain
full-precision path, so an adapter can use it unconditionally.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AmpPolicy:
    """``optim["mixed_precision"]`` (or its absence) for a trainer on ``device_type`` ("cpu" / "cuda")."""

    def __init__(self, optim: dict[str, Any], device_type: str):
        policy = optim.get("mixed_precision")
        self.device_type = device_type
        self.enabled = policy is not None
        self.param_dtype = TORCH_DTYPES[policy["param_dtype"]] if policy else None
        self.reduce_dtype = TORCH_DTYPES[policy["reduce_dtype"]] if policy else None
        scaling = (policy or {}).get("loss_scale")
        self.scaler = None
        if scaling:
            self.scaler = torch.amp.GradScaler(
                device_type, init_scale=float(scaling["init"]),
                growth_factor=float(scaling["growth_factor"]),
                backoff_factor=float(scaling["backoff_factor"]),
                growth_interval=int(scaling["growth_interval"]),
            )

    def autocast(self) -> Any:
        """The forward's context: autocast to ``param_dtype`` under a policy, nothing otherwise."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.param_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, of the scaled loss under fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (fp16; before the clip and the logged norm)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()``; under fp16 the scaler's (skipped when a gradient is not finite) and its
        scale update."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state(self) -> dict[str, Any]:
        """The scaler's state (empty without one): what a checkpoint keeps besides the masters."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
