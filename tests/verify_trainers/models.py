"""Model factories for ``zerosim verify --model MODULE:FACTORY``: one correct, the rest each wrong in one way.

The protocol: ``factory(seed) -> (model, make_batch)``, ``make_batch(step, rank, world, micro) ->
(inputs, targets)``, ``model(inputs, targets) -> scalar loss``. ``tests/test_verify_model_factory.py``
runs the correct one through a real launch and checks that each wrong one is refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 5, 7, 3, 4


class Regressor(nn.Module):
    """A two-layer MLP with a 1-element output gain: mean squared error over the local batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)])
        self.gain = nn.Parameter(torch.ones(1))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](inputs))
        return ((self.gain * self.layers[1](x) - targets) ** 2).mean()


def _batch(step: int, rank: int, world: int, micro: int,
           rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(((step * 1009 + rank) * 31 + micro) * 7 + world)
    return (torch.randn(rows, IN, generator=gen, dtype=torch.float64),
            torch.randn(rows, OUT, generator=gen, dtype=torch.float64))


def regressor(seed: int) -> tuple[nn.Module, Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Regressor().to(torch.float64), _batch


def raises(seed: int) -> Any:
    raise RuntimeError("no weights here")


def not_a_pair(seed: int) -> Any:
    return Regressor()


def model_not_a_module(seed: int) -> Any:
    return {"w": torch.zeros(3)}, _batch


def batch_not_callable(seed: int) -> Any:
    return Regressor(), [1, 2]


def rank_dependent_shapes(seed: int) -> Any:
    def make_batch(step: int, rank: int, world: int, micro: int) -> Any:
        return _batch(step, rank, world, micro, rows=BATCH + rank)

    return Regressor().to(torch.float64), make_batch


def vector_loss(seed: int) -> Any:
    class VectorLoss(Regressor):
        def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return (self.layers[1](torch.tanh(self.layers[0](inputs))) - targets) ** 2

    return VectorLoss().to(torch.float64), _batch
