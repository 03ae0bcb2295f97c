"""Deliberately broken expert-parallel trainers: each one real-world MoE bug ``zerosim verify`` must catch.

Every class changes one method of the correct example (``examples/expert_parallel_trainer.py``), run
with ``--model moe``: ``zerosim verify tests.verify_trainers.expert_parallel:summed_expert_gradients
--model moe``. ``tests/test_verify_moe.py`` asserts what the harness reports for each.
"""

from __future__ import annotations

import math

import torch

from examples.expert_parallel_trainer import ExpertParallelTrainer


class SummedExpertGradients(ExpertParallelTrainer):
    """Expert gradients left as the exchange summed them, not divided by the world size: every expert's
    update is world times too large, the dense tensors' are right.

    Megatron-LM PR #5956 (Megatron-FSDP v2 with expert parallelism: expert gradients ``ep_size`` times
    too large) and pytorch #160285 (torchtitan-style EP: expert gradients doubled at EP=2)."""

    def average_expert_gradients(self) -> None:
        return None


class RouterGradientNotReduced(ExpertParallelTrainer):
    """The router's gradient is not all-reduced: each rank steps its router with its own tokens' gradient,
    the other dense tensors are averaged. The loss is right, only the router drifts apart across ranks.

    transformers #48687 (the router's gradient under expert parallelism wrong while the loss is right)."""

    def reduce_dense_gradients(self) -> None:
        router = {id(p) for p in self.layer.router.parameters()}
        kept = {id(p): p.grad.clone() for _, p in self.dense if id(p) in router and p.grad is not None}
        super().reduce_dense_gradients()
        for _, p in self.dense:
            if id(p) in kept:
                p.grad = kept[id(p)]


class ExpertsLeftOutOfLoggedNorm(ExpertParallelTrainer):
    """The logged gradient norm counts the replicated tensors only, not the experts; the clip uses the
    right one, so every parameter is right and only the logged norm is too small.

    Megatron-LM PR #5916 (gradient norm undercounted with expert and tensor parallelism: expert
    gradients missing from the norm's reduction)."""

    def global_norm(self) -> float:
        squares = sum(float(p.grad.pow(2).sum()) for _, p in self.dense if p.grad is not None)
        self.dense_norm = math.sqrt(squares)
        return super().global_norm()

    def last_grad_norm(self) -> float:
        return self.dense_norm


def summed_expert_gradients(model: torch.nn.Module, optim: dict) -> ExpertParallelTrainer:
    return SummedExpertGradients(model, optim)


def router_gradient_not_reduced(model: torch.nn.Module, optim: dict) -> ExpertParallelTrainer:
    return RouterGradientNotReduced(model, optim)


def experts_left_out_of_logged_norm(model: torch.nn.Module, optim: dict) -> ExpertParallelTrainer:
    return ExpertsLeftOutOfLoggedNorm(model, optim)
