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

from ._checkpoint import load_full, save_full
from ._torch_optim import optimizer_kwargs, optimizer_state_copy
from .ddp import DDPTrainer


class TorchZeroTrainer(DDPTrainer):
    """DDP's forward, backward and step; ZeroRedundancyOptimizer's owned tensors and state."""

    declared_strategy = "zero1"
    partition_rule = "zero-redundancy"  # whole tensors, largest first, to the least-loaded rank

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any]):
        super().__init__(model, optim)
        self.rank = dist.get_rank()
        owner_of = self.optimizer._param_to_rank  # type: ignore[attr-defined]
        self._owner = {p: owner_of[p] for p in model.parameters()}

    def build_optimizer(self, model: torch.nn.Module, optim: dict[str, Any]) -> torch.optim.Optimizer:
        cls, kwargs = optimizer_kwargs(optim)
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)

    def local_optimizer_state(self) -> dict[Any, dict[str, Any]]:
        """The state of the tensors this rank owns (ZeroRedundancyOptimizer's inner optimizer)."""
        return dict(self.optimizer.optim.state)  # type: ignore[attr-defined]

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        local = self.local_optimizer_state()
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

    def save_checkpoint(self, directory: Any) -> None:
        """The optimizer state consolidated on rank 0 (``consolidate_state_dict(to=0)``), saved there with
        the model's state dict."""
        self.optimizer.consolidate_state_dict(to=0)  # type: ignore[attr-defined]
        state = self.optimizer.state_dict() if self.rank == 0 else None
        save_full(directory, self.model.state_dict(), state)

    def load_checkpoint(self, directory: Any) -> None:
        """Every rank loads the consolidated dict; ZeroRedundancyOptimizer keeps the state of the tensors
        it assigns to this rank at the current world size."""
        saved = load_full(directory)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])


def make_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> TorchZeroTrainer:
    return TorchZeroTrainer(model, optim)
