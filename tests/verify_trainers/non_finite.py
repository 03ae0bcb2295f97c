"""A trainer whose weights go non-finite while the float64 reference stays finite, and its correct twin.

``inf_at_step``: the correct ZeRO-1 example trainer, except that after its second optimizer step every
rank writes -inf into one element of one weight (what DeepSpeed ZeRO-3 with Adafactor returns in
``wte.weight``). ``zerosim verify`` must judge it a C-ZERO-002 failure naming the tensor, the element
and the step (``tests/test_verify_diagnosis_non_finite.py``), not a harness error. ``finite_twin``:
the same class with the write switched off, which passes.
"""

from __future__ import annotations

import torch

from examples.zero1_trainer import Zero1Trainer

BROKEN_STEP = 2  # the trainer's own step count (within each phase) after which the weight holds -inf
BROKEN_TENSOR = "wte.weight"
BROKEN_ELEMENT = 3


class InfAfterStep(Zero1Trainer):
    """Zero1Trainer that writes -inf into ``BROKEN_TENSOR[BROKEN_ELEMENT]`` after step ``BROKEN_STEP``
    when ``broken``; otherwise exactly Zero1Trainer."""

    def __init__(self, model: torch.nn.Module, optim: dict, broken: bool):
        super().__init__(model, optim)
        self.broken = broken

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss = super().step(inputs, targets)
        if self.broken and self.steps_taken == BROKEN_STEP:
            weight = dict(zip(self.names, self.params, strict=True))[BROKEN_TENSOR]
            with torch.no_grad():
                weight.view(-1)[BROKEN_ELEMENT] = float("-inf")
        return loss


def inf_at_step(model: torch.nn.Module, optim: dict) -> InfAfterStep:
    return InfAfterStep(model, optim, broken=True)


def finite_twin(model: torch.nn.Module, optim: dict) -> InfAfterStep:
    return InfAfterStep(model, optim, broken=False)
