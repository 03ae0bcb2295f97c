"""The protocol's mixed-precision policy as the built-in adapters apply it, and dynamic loss scaling.

``optim["mixed_precision"]`` (absent in full precision) is ``{"param_dtype": "bfloat16" | "float16",
"reduce_dtype": "float32" | ..., "loss_scale": {...}}``, ``loss_scale`` only under float16:
``{"init", "growth_factor", "backoff_factor", "growth_interval"}``. The model arrives in float32, the
master dtype; the trainer computes in ``param_dtype``, reduces gradients in ``reduce_dtype`` and keeps
float32 masters and optimizer state.

:class:`DynamicLossScale` is torch.amp.GradScaler's rule, written out so that every rank takes the
same decision from one all-reduce: the loss is multiplied by the scale before backward; the gradients
are multiplied by its reciprocal (a power of two under the protocol's factors, so exactly) before they
are clipped; a step whose gradients hold an inf or a NaN on any rank is skipped and the scale is
multiplied by ``backoff_factor``; after ``growth_interval`` finite steps in a row it is multiplied by
``growth_factor``. Its ``state_dict`` travels in each adapter's checkpoint, so a resumed run continues
with the same scale and growth count.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerosim.errors import ConfigError

POLICY_KEY = "mixed_precision"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class MixedPolicy:
    """What ``optim["mixed_precision"]`` asks for, as torch dtypes (``loss_scale``: None but under fp16)."""

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    loss_scale: dict[str, float] | None

    @property
    def param_name(self) -> str:
        return str(self.param_dtype).replace("torch.", "")

    @property
    def reduce_name(self) -> str:
        return str(self.reduce_dtype).replace("torch.", "")


def mixed_policy(optim: dict[str, Any]) -> MixedPolicy | None:
    """The run's policy, or None in full precision (the key is absent). ConfigError naming the field on
    a dtype the adapters do not know."""
    raw = optim.get(POLICY_KEY)
    if raw is None:
        return None
    dtypes = []
    for field in ("param_dtype", "reduce_dtype"):
        name = raw.get(field, "float32")
        if name not in _DTYPES:
            raise ConfigError(f"mixed_precision.{field}", name, f"must be one of {', '.join(_DTYPES)}")
        dtypes.append(_DTYPES[name])
    scale = raw.get("loss_scale")
    return MixedPolicy(dtypes[0], dtypes[1], dict(scale) if scale is not None else None)


def without_policy(optim: dict[str, Any]) -> dict[str, Any]:
    """``optim`` without the policy key (for code that reads every key as an optimizer option)."""
    return {k: v for k, v in optim.items() if k != POLICY_KEY}


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The rank-local gradient tensor of ``p`` (a DTensor gradient's shard)."""
    g = p.grad
    if g is None:
        return None
    local = getattr(g, "_local_tensor", None)
    return local if local is not None else g


class DynamicLossScale:
    """Dynamic loss scaling with one decision for all ranks (see the module docstring)."""

    def __init__(self, config: dict[str, float], group: Any = None):
        self.scale = float(config["init"])
        self.growth_factor = float(config["growth_factor"])
        self.backoff_factor = float(config["backoff_factor"])
        self.growth_interval = int(config["growth_interval"])
        self.growth_tracker = 0
        self.group = group
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale, in float32 (GradScaler's ``scale``: a float32 factor)."""
        return loss * torch.tensor(self.scale, dtype=torch.float32, device=loss.device)

    @torch.no_grad()
    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Multiply every local gradient by 1 / scale; True when every rank's gradients are finite
        (one all-reduce of a one-element flag: control traffic)."""
        grads = [g for g in (local_grad(p) for p in params) if g is not None]
        inv = 1.0 / self.scale
        bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device if grads else "cpu")
        for g in grads:
            g.mul_(inv)
            if not torch.isfinite(g).all():
                bad.fill_(1.0)
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bool(bad.item() == 0.0)

    def update(self, finite: bool) -> None:
        """Back off after an overflowing step, grow after ``growth_interval`` finite steps in a row."""
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "growth_tracker": float(self.growth_tracker),
                "skipped_steps": float(self.skipped_steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def loss_scale_of(policy: MixedPolicy | None, group: Any = None) -> DynamicLossScale | None:
    """A :class:`DynamicLossScale` when the policy asks for loss scaling (float16), else None."""
    if policy is None or policy.loss_scale is None:
        return None
    return DynamicLossScale(policy.loss_scale, group)


def mixed_optimizer_step(
    params: Iterable[torch.nn.Parameter], optimizer: Any, optim: dict[str, Any],
    loss_scale: DynamicLossScale | None,
) -> float:
    """After backward: unscale and check (under loss scaling), then clip and step unless some rank's
    gradients overflowed, then update the scale. Returns the total gradient norm before clipping,
    unscaled (non-finite on a skipped step, as a training loop would log it)."""
    from ._torch_optim import clip_gradients

    params = list(params)
    finite = loss_scale.unscale_and_check(params) if loss_scale is not None else True
    if finite:
        norm = clip_gradients(params, optim)
        optimizer.step()
    else:
        norm = clip_gradients(params, {**optim, "max_grad_norm": None})
    if loss_scale is not None:
        loss_scale.update(finite)
    return norm
