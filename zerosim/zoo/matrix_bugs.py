"""The zoo's Muon entry: a replicated trainer whose matrix optimizer runs once per micro-batch.

Muon orthogonalises a whole matrix's momentum (Newton-Schulz), so its step cannot be cut into the
elementwise slices of :class:`~zerosim.zoo.trainer.ZooTrainer`. :class:`MuonPerMicroBatch` keeps every
parameter on every rank (the gradient averaged by one all-reduce), builds the phase's optimizer with
verify's ``optim["make_optimizer"]`` twice, over the matrices (Muon) and over the rest (AdamW), and
steps both once per optimizer step on the accumulated, clipped gradient: the fixed twin. With ``bug``
set the Muon part steps once per micro-batch on that micro-batch's share of the gradient, all taken at
the same weights: momentum advances K times a step and Newton-Schulz orthogonalises each partial
gradient, what DeepSpeed ZeRO-3 did by running Muon inside its per-micro-batch gradient reduce.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class MuonPerMicroBatch:
    """The trainer protocol of ``zerosim verify --optimizers muon`` (replicated; module docstring)."""

    def __init__(self, model: torch.nn.Module, optim: dict, bug: bool = False):
        if optim["name"] != "muon":
            raise NotImplementedError(f"optimizer {optim['name']!r}: this entry is about Muon")
        self.bug, self.model = bug, model
        self.world = dist.get_world_size()
        self.named = list(model.named_parameters())
        self.matrices = [p for _, p in self.named if p.ndim == 2]
        self.others = [p for _, p in self.named if p.ndim != 2]
        self.muon = optim["make_optimizer"](self.matrices)
        self.adamw = optim["make_optimizer"](self.others)
        self.max_norm = optim.get("max_grad_norm")
        self.norm = 0.0

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.step_accumulated([(inputs, targets)])

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        count = len(micro_batches)
        shares: list[list[torch.Tensor]] = []
        losses = []
        for inputs, targets in micro_batches:
            for _, p in self.named:
                p.grad = None
            loss = self.model(inputs, targets)
            (loss / count).backward()
            losses.append(float(loss.detach()))
            flat = torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None else p.grad.reshape(-1)
                              for _, p in self.named])
            dist.all_reduce(flat)
            shares.append(list((flat / self.world).split([p.numel() for _, p in self.named])))
        total = [sum(parts) for parts in zip(*shares, strict=True)]
        self.norm = math.sqrt(sum(float((g * g).sum()) for g in total))
        coefficient = 1.0
        if self.max_norm is not None:
            coefficient = min(float(self.max_norm) / (self.norm + 1e-6), 1.0)
        muon_steps = [[g * coefficient for g in share] for share in shares] if self.bug else \
            [[g * coefficient for g in total]]
        for grads in muon_steps:
            self._set_grads(grads)
            self.muon.step()
        self._set_grads([g * coefficient for g in total])
        self.adamw.step()
        return sum(losses) / count

    def _set_grads(self, grads: list[Any]) -> None:
        for (_, p), g in zip(self.named, grads, strict=True):
            p.grad = g.view_as(p).clone()

    def last_grad_norm(self) -> float:
        return self.norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named}
