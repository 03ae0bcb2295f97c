"""Deliberately broken trainers for the regimes of gradient accumulation and logged gradient norms.

Each changes one thing of a correct built-in adapter (``zerosim.verify.adapters``) and mirrors a bug
reported on a public tracker; ``tests/test_verify_accumulation.py`` asserts that ``zerosim verify``
fails each with its bug class named:

* ``last_micro_batch_only``: gradients zeroed before every micro-batch, so the step uses only the
  last micro-batch's gradient (allenai/open-instruct PR #1498, ZeRO-2 with manual accumulation).
* ``summed_micro_batches``: the micro-batch losses are not divided by K, so the step uses the sum of
  the K micro-batch gradients, K times the mean.
* ``local_shard_norm``: FSDP2, correct updates, but the logged gradient norm is the norm of this
  rank's gradient shard only (DeepSpeed #7718: ZeRO-2 logged 1.6 where 4.7 was right).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from zerosim.verify.adapters._torch_optim import clip_gradients
from zerosim.verify.adapters.ddp import DDPTrainer
from zerosim.verify.adapters.fsdp2 import FSDP2Trainer
from zerosim.verify.adapters.fsdp2 import make_trainer as make_fsdp2_trainer


class LastMicroBatchOnly(DDPTrainer):
    """Zeroes the gradients before every micro-batch (not once per optimizer step)."""

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        k = len(micro_batches)
        total = 0.0
        for inputs, targets in micro_batches:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.ddp(inputs, targets)
            (loss / k).backward()
            total += float(loss.detach())
        self._grad_norm = clip_gradients(self.model.parameters(), self.optim)
        self.optimizer.step()
        return total / k


class SummedMicroBatches(DDPTrainer):
    """Accumulates under ``no_sync`` like DDP should, but never divides the loss by K."""

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        k = len(micro_batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i, (inputs, targets) in enumerate(micro_batches):
            ctx = self.ddp.no_sync() if i < k - 1 else contextlib.nullcontext()
            with ctx:
                loss = self.ddp(inputs, targets)
                loss.backward()
            total += float(loss.detach())
        self._grad_norm = clip_gradients(self.model.parameters(), self.optim)
        self.optimizer.step()
        return total / k


class LocalShardNorm(FSDP2Trainer):
    """FSDP2 whose logged norm is taken over this rank's gradient shard (the local DTensor pieces)."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(inputs, targets)
        loss.backward()
        self._grad_norm = self._local_norm()
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), float(max_norm))
        self.optimizer.step()
        return float(loss.detach())

    def _local_norm(self) -> float:
        squares = 0.0
        for p in self.model.parameters():
            if p.grad is not None:
                local: Any = getattr(p.grad, "_local_tensor", p.grad)
                squares += float((local.double() ** 2).sum())
        return squares ** 0.5


def last_micro_batch_only(model: torch.nn.Module, optim: dict) -> DDPTrainer:
    return LastMicroBatchOnly(model, optim)


def summed_micro_batches(model: torch.nn.Module, optim: dict) -> DDPTrainer:
    return SummedMicroBatches(model, optim)


def local_shard_norm(model: torch.nn.Module, optim: dict) -> FSDP2Trainer:
    trainer = make_fsdp2_trainer(model, optim)
    trainer.__class__ = LocalShardNorm
    return trainer

