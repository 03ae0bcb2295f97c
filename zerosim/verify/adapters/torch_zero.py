"""``torch-zero``: torch's ZeroRedundancyOptimizer over DDP (strategy "zero1").

ZeroRedundancyOptimizer assigns whole tensors to ranks (largest first, to the least-loaded rank);
each rank keeps the optimizer state of its own tensors only, steps them, and broadcasts them to the
others. Gradients stay full (DDP all-reduces them), as in ZeRO-1. The owned element ranges come
from that assignment: a rank owns all of each of its tensors and nothing of the others.

The full optimizer state is collected by broadcasting each rank's own state from it to every rank,
so every rank returns the same complete dict (``consolidate_state_dict`` would leave it on one rank).

Mixed precision (``optim["mixed_precision"]``): ZeroRedundancyOptimizer steps the float32 model it was
given (the masters); forward and backward run on a ``param_dtype`` copy under DDP
(:class:`~zerosim.verify.adapters._compute_copy.ComputeCopy`), whose comm hook all-reduces the
gradients in ``reduce_dtype`` onto the masters in float32; accumulation over micro-batches is in
float32. Under float16, :class:`~zerosim.verify.adapters._mixed_precision.DynamicLossScale` scales
the loss, unscales before clipping and skips an overflowing step; its state is in the checkpoint.
Without the key the trainer is exactly the full-precision one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..resources import storage_bytes
from ._checkpoint import load_full, save_full
from ._compute_copy import ComputeCopy
from ._mixed_precision import loss_scale_of, mixed_optimizer_step, mixed_policy
from ._torch_optim import accumulate_backward, optimizer_kwargs, optimizer_state_copy
from .ddp import DDPTrainer


class TorchZeroTrainer(DDPTrainer):
    """DDP's forward, backward and step; ZeroRedundancyOptimizer's owned tensors and state."""

    declared_strategy = "zero1"
    partition_rule = "zero-redundancy"  # whole tensors, largest first, to the least-loaded rank

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any]):
        self.policy = mixed_policy(optim)
        self.compute: ComputeCopy | None = None
        self.loss_scale = loss_scale_of(self.policy)
        if self.policy is None:
            super().__init__(model, optim)
        else:  # the float32 model holds the masters; DDP runs the param_dtype copy
            self.model = model
            self.optim = optim
            self.compute = ComputeCopy(model, self.policy)
            self.ddp = self.compute.ddp
            self.optimizer = self.build_optimizer(model, optim)
        self.rank = dist.get_rank()
        owner_of = self.optimizer._param_to_rank  # type: ignore[attr-defined]
        self._owner = {p: owner_of[p] for p in model.parameters()}

    def build_optimizer(self, model: torch.nn.Module, optim: dict[str, Any]) -> torch.optim.Optimizer:
        cls, kwargs = optimizer_kwargs(optim)
        return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls, **kwargs)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.compute is None:
            return super().step(inputs, targets)
        return self.step_accumulated([(inputs, targets)])

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Full precision: DDP's ``no_sync`` accumulation (:class:`DDPTrainer`). Mixed precision: the copy's
        micro-batches under ``no_sync`` but the last, each one's gradients held on the masters in
        float32; the last backward all-reduces the float32 sum in ``reduce_dtype``; then unscale, clip
        and step the masters (skipped when a gradient overflowed) and cast them into the copy."""
        compute = self.compute
        if compute is None:
            return super().step_accumulated(micro_batches)
        compute.zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        started = [False]
        with contextlib.ExitStack() as stack:

            def sync(last: bool) -> None:
                stack.close()
                if started[0]:
                    compute.hold_local()
                started[0] = True
                if not last:
                    stack.enter_context(compute.ddp.no_sync())

            scale = self.loss_scale.scale_loss if self.loss_scale is not None else None
            loss = accumulate_backward(compute.ddp, micro_batches, sync, scale_loss=scale)
        self._grad_norm = mixed_optimizer_step(self.model.parameters(), self.optimizer, self.optim,
                                               self.loss_scale)
        compute.refresh()
        return loss

    def resident_bytes(self) -> dict[str, int]:
        held = super().resident_bytes()
        if self.compute is not None:  # the param_dtype copy and its gradient buckets
            copy_params = list(self.compute.module.parameters())
            held["params"] += storage_bytes(copy_params)
            held["grads"] += storage_bytes(p.grad for p in copy_params if p.grad is not None)
        return held

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
        scale = self.loss_scale.state_dict() if self.loss_scale is not None else None
        save_full(directory, self.model.state_dict(), state, scale)

    def load_checkpoint(self, directory: Any) -> None:
        """Every rank loads the consolidated dict; ZeroRedundancyOptimizer keeps the state of the tensors
        it assigns to this rank at the current world size."""
        saved = load_full(directory)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(saved["loss_scale"])
        if self.compute is not None:
            self.compute.refresh()


def make_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> TorchZeroTrainer:
    return TorchZeroTrainer(model, optim)
