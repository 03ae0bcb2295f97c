"""``ddp``: DistributedDataParallel + torch.optim, every state replicated (the baseline, strategy "ddp").

Gradients are bucket views (``gradient_as_bucket_view``: DDP's buckets are the gradients, no second
copy) and are averaged by DDP's default all-reduce hook registered from Python, so
:class:`zerosim.verify.traffic.TrafficCounter` sees the reduction the C++ reducer would otherwise
issue out of its reach.

Under ``optim["mixed_precision"]`` (:mod:`._mixed`): the forward runs under ``torch.autocast(param_dtype)``
over the float32 model (its parameters are the float32 masters), gradients are reduced in
``reduce_dtype`` (float32: the plain all-reduce hook; bfloat16 / float16: :func:`cast_reduce_hook`,
which casts each bucket, all-reduces it and writes the mean back into the float32 gradients, as
DDP's compress hooks do; torch's own bf16 hook needs NCCL), and under fp16
a ``torch.amp.GradScaler`` scales the loss, unscales before the clip (``last_grad_norm`` is the
unscaled norm) and skips overflow steps.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ..resources import storage_bytes
from ._checkpoint import load_full, save_full
from ._mixed import AmpPolicy
from ._torch_optim import accumulate_backward, build_optimizer, clip_gradients, optimizer_state_copy


def cast_reduce_hook(dtype: torch.dtype) -> Any:
    """A DDP comm hook that averages each bucket in ``dtype``: cast, divide by the world size, all-reduce
    (``dist.all_reduce``, seen by the traffic counter with its dtype), cast back into the bucket."""

    def hook(state, bucket):  # no annotations: DDP rejects a bucket annotated other than GradBucket
        buffer = bucket.buffer()
        low = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(low, async_op=True).get_future()

        def back(done: Any) -> torch.Tensor:
            buffer.copy_(done.value()[0].to(buffer.dtype))
            return buffer

        return future.then(back)

    return hook


def _reduce_hook(reduce_dtype: torch.dtype | None) -> Any:
    if reduce_dtype is None or reduce_dtype == torch.float32:
        return allreduce_hook
    return cast_reduce_hook(reduce_dtype)


def wrap_ddp(model: torch.nn.Module, reduce_dtype: torch.dtype | None = None) -> DistributedDataParallel:
    """DDP over the default group with Python-visible gradient all-reduces (see the module docstring),
    in ``reduce_dtype`` (None: the gradients' own dtype)."""
    device = next(model.parameters()).device
    ddp = DistributedDataParallel(
        model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True
    )
    ddp.register_comm_hook(dist.group.WORLD, _reduce_hook(reduce_dtype))
    return ddp


class DDPTrainer:
    """Replicated params, grads and optimizer state: every rank owns all (C-ZERO-001, k=world replicas)."""

    declared_strategy = "ddp"

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any]):
        self.model = model
        self.optim = optim
        self.amp = AmpPolicy(optim, next(model.parameters()).device.type)
        self.ddp = wrap_ddp(model, self.amp.reduce_dtype)
        self.optimizer = self.build_optimizer(model, optim)

    def build_optimizer(self, model: torch.nn.Module, optim: dict[str, Any]) -> torch.optim.Optimizer:
        return build_optimizer(model.parameters(), optim)

    def local_optimizer_state(self) -> dict[Any, dict[str, Any]]:
        """The optimizer state this rank keeps, by parameter (all of it, under DDP)."""
        return dict(self.optimizer.state)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with self.amp.autocast():
            loss = self.ddp(inputs, targets)
        self.amp.backward(loss)
        self.amp.unscale(self.optimizer)
        self._grad_norm = clip_gradients(self.model.parameters(), self.optim)
        self.amp.step(self.optimizer)
        return float(loss.detach())

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step on the mean gradient of K micro-batches: DDP's ``no_sync()`` for all but
        the last (gradients accumulate locally; the last backward all-reduces their sum / K)."""
        self.optimizer.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as stack:

            def sync(last: bool) -> None:
                stack.close()
                if not last:
                    stack.enter_context(self.ddp.no_sync())

            loss = accumulate_backward(self.ddp, micro_batches, sync, self.amp)
        self.amp.unscale(self.optimizer)
        self._grad_norm = clip_gradients(self.model.parameters(), self.optim)
        self.amp.step(self.optimizer)
        return loss

    def last_grad_norm(self) -> float:
        """The total gradient norm before clipping of the last step: what ``clip_grad_norm_`` returned."""
        return self._grad_norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return {
            name: optimizer_state_copy(self.optimizer.state[p])
            for name, p in self.model.named_parameters()
            if p in self.optimizer.state
        }

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        return {name: [(0, p.numel())] for name, p in self.model.named_parameters()}

    def save_checkpoint(self, directory: Any) -> None:
        """Rank 0 saves the model's and the optimizer's state dicts (every rank holds all of both)."""
        save_full(directory, self.model.state_dict(), self.optimizer.state_dict())

    def load_checkpoint(self, directory: Any) -> None:
        """Every rank loads the whole file: any world size resumes from any other's checkpoint."""
        saved = load_full(directory)
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])

    def resident_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        state = self.local_optimizer_state()
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": storage_bytes(t for p in params for t in state.get(p, {}).values()),
        }


def make_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> DDPTrainer:
    return DDPTrainer(model, optim)
