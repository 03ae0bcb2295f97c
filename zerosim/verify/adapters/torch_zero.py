"""``torch-zero``: torch's ZeroRedundancyOptimizer over DDP (strategy "zero1").

ZeroRedundancyOptimizer assigns whole tensors to ranks (largest first, to the least-loaded rank);
each rank keeps the optimizer state of its own tensors only, steps them, and broadcasts them to the
others. Gradients stay full (DDP all-reduces them), as in ZeRO-1. The owned element ranges come
from that assignment: a rank owns all of each of its tensors and nothing of the others.

The full optimizer state is collected by broadcasting each rank's own state from it to every rank,
so every rank returns the same complete dict (``consolidate_state_dict`` would leave it on one rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..resources import storage_bytes
from ._torch_optim import clip_gradients, optimizer_kwargs, optimizer_state_copy
from .ddp import wrap_ddp


class TorchZeroTrainer:
    declared_strategy = "zero1"
    partition_rule = "zero-redundancy"  # whole tensors, largest first, to the least-loaded rank

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any]):
        self.model = model
        self.optim = optim
        self.ddp = wrap_ddp(model)
        cls, kwargs = optimizer_kwargs(optim)
        self.optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)
        self.rank = dist.get_rank()
        owner_of = self.optimizer._param_to_rank  # type: ignore[attr-defined]
        self._owner = {p: owner_of[p] for p in model.parameters()}

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.ddp(inputs, targets)
        loss.backward()
        clip_gradients(self.model.parameters(), self.optim)
        self.optimizer.step()
        return float(loss.detach())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        local = self.optimizer.optim.state
        mine = {name: {k: v.cpu() for k, v in optimizer_state_copy(local[p]).items()}
                for name, p in self.model.named_parameters() if self._owner[p] == self.rank and p in local}
        out: dict[str, dict[str, torch.Tensor]] = {}
        device = next(self.model.parameters()).device
        for owner in range(dist.get_world_size()):
            box: list[Any] = [mine if owner == self.rank else None]
            dist.broadcast_object_list(box, src=owner, device=device if device.type == "cuda" else None)
            out.update({name: {k: v.to(device) for k, v in st.items()} for name, st in box[0].items()})
        return out

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        return {name: [(0, p.numel())] if self._owner[p] == self.rank else []
                for name, p in self.model.named_parameters()}

    def resident_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        state = self.optimizer.optim.state
        return {"params": storage_bytes(params),
                "grads": storage_bytes(p.grad for p in params if p.grad is not None),
                "optimizer": storage_bytes(t for p in params for t in state.get(p, {}).values())}


def make_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> TorchZeroTrainer:
    return TorchZeroTrainer(model, optim)
