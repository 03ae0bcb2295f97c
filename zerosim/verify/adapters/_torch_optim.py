"""The torch.optim optimizer and clipping an adapter applies, built from the protocol's ``optim`` dict.

Every built-in adapter steps the same optimizer the reference uses (``torch.optim.SGD`` with momentum,
``torch.optim.AdamW``), so a difference the contracts find is the peer's sharding, not our optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerosim.errors import ConfigError


def optimizer_kwargs(optim: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(torch.optim class, its keyword arguments) for the protocol's optim config (C-ZERO-002's step)."""
    name = optim.get("name")
    if name == "sgd":
        return torch.optim.SGD, {
            "lr": optim["lr"],
            "momentum": optim.get("momentum", 0.0),
            "weight_decay": optim.get("weight_decay", 0.0),
        }
    if name == "adamw":
        return torch.optim.AdamW, {
            "lr": optim["lr"],
            "betas": tuple(optim.get("betas", (0.9, 0.999))),
            "eps": optim.get("eps", 1e-8),
            "weight_decay": optim.get("weight_decay", 0.0),
        }
    raise ConfigError("optim.name", name, "the built-in adapters support 'sgd' and 'adamw'")


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: dict[str, Any]) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_kwargs(optim)
    return cls(params, **kwargs)


def clip_gradients(params: Iterable[torch.nn.Parameter], optim: dict[str, Any]) -> None:
    """``clip_grad_norm_`` on the full averaged gradient when the config asks for it (DTensor grads too)."""
    max_norm = optim.get("max_grad_norm")
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(params), float(max_norm))


def optimizer_state_copy(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's torch.optim state as detached copies (per-element buffers and the step counter)."""
    return {key: value.detach().clone() for key, value in state.items() if isinstance(value, torch.Tensor)}
