"""The torch.optim optimizer and clipping an adapter applies, built from the protocol's ``optim`` dict.

Every built-in adapter steps the same optimizer the reference uses (:mod:`zerosim.verify.optimizers`:
``torch.optim.SGD`` with momentum, ``Adam``, ``AdamW``, ``Adafactor``, the Muon recipe), so a difference
the contracts find is the peer's sharding, not our optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..optimizers import build_optimizer as build_phase_optimizer
from ..optimizers import is_user_optimizer, optimizer_class


def optimizer_kwargs(optim: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(torch.optim class, its keyword arguments) for the protocol's optim config (C-ZERO-002's step):
    one class for the whole model (sgd, adam, adamw, adafactor; ``ZeroRedundancyOptimizer`` takes one):
    NotImplementedError (the phase is skipped) for muon and a user's factory."""
    name = optim.get("name")
    if name == "muon" or (isinstance(name, str) and is_user_optimizer(name)):
        raise NotImplementedError(f"{name} is not one torch.optim class for every tensor (muon: Muon for 2-D "
                                  "tensors, AdamW for the rest); this adapter takes one class")
    return optimizer_class(optim)


def build_optimizer(params: Iterable[torch.nn.Parameter], optim: dict[str, Any]) -> Any:
    """The phase's optimizer over ``params`` (:func:`zerosim.verify.optimizers.build_optimizer`)."""
    return build_phase_optimizer(params, optim)


def clip_gradients(params: Iterable[torch.nn.Parameter], optim: dict[str, Any]) -> float:
    """``clip_grad_norm_`` on the full averaged gradient when the config asks for it (DTensor grads too);
    returns the total norm before clipping, what ``clip_grad_norm_`` returns and a training loop logs
    (without a clip: ``get_total_norm`` of the same gradients, which it leaves untouched)."""
    params = [p for p in params if p.grad is not None]
    max_norm = optim.get("max_grad_norm")
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, float(max_norm))
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    full = getattr(norm, "full_tensor", None)  # a DTensor norm (FSDP2): its reduced value
    return float(full() if full is not None else norm)


def accumulate_backward(forward: Any, micro_batches: Any, sync: Any, amp: Any = None,
                        scale_loss: Any = None) -> float:
    """Forward and backward of every ``(inputs, targets)`` micro-batch with the loss divided by their
    number K, so the gradients add up to the mean gradient; ``sync(last)`` is called before each
    micro-batch (True only for the last: the framework's switch for reducing gradients). ``amp``: an
    :class:`~zerosim.verify.adapters._mixed.AmpPolicy` (autocast forward, scaled backward);
    ``scale_loss``: applied to each loss before backward (the adapters' own dynamic loss scale, for
    a forward that already computes in the low precision). Returns the mean local loss."""
    batches = list(micro_batches)
    k = len(batches)
    total = 0.0
    for i, (inputs, targets) in enumerate(batches):
        sync(i == k - 1)
        if amp is None:
            loss = forward(inputs, targets)
            (loss if scale_loss is None else scale_loss(loss)).div(k).backward()
        else:
            with amp.autocast():
                loss = forward(inputs, targets)
            amp.backward(loss / k)
        total += float(loss.detach())
    return total / k


def optimizer_state_copy(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """One parameter's torch.optim state as detached copies (per-element buffers and the step counter)."""
    return {key: value.detach().clone() for key, value in state.items() if isinstance(value, torch.Tensor)}
