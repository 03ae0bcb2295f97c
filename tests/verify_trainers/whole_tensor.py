"""Trainers for matrix optimizers (Muon, Adafactor): one correct whole-tensor layout, two sliced ones.

``WholeTensorTrainer`` is the layout a non-elementwise optimizer needs (ZeRO-2 with whole tensors):
each parameter is owned by one rank (largest first, to the least loaded rank); its gradient is
averaged onto the owner (``reduce`` then a division by the world size), the clip factor comes from
the owners' sums of squares (all-reduced), the owner steps it with the phase's optimizer
(``optim["make_optimizer"]`` over the tensors it owns, its state kept there) and broadcasts it.

``SlicedTrainer`` is the bug of a ZeRO partition that hands the optimizer slices of a matrix
(DeepSpeed #8443: Muon's orthogonalisation ran on ZeRO-3 partitions): every tensor is split among
the ranks, each rank steps its slices as if they were whole tensors and all-gathers them. ``rows``:
each matrix in row blocks (2-D slices, so the Muon recipe gives them to Muon); ``flat``: each tensor's
flattened elements in even slices, a matrix's slice as a one-row matrix. For an elementwise optimizer
both are correct; for Muon and Adafactor they compute another update.

Factories: ``whole_tensor``, ``muon_on_row_blocks``, ``optimizer_on_flat_slices``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def balanced_owners(named: list[tuple[str, torch.Tensor]], world: int) -> dict[str, int]:
    """Each tensor to the rank holding the fewest elements so far, largest tensor first (ties: the lower
    rank): the ranks' element counts end less than the largest tensor apart."""
    load = [0] * world
    owner = {}
    for name, p in sorted(named, key=lambda item: -item[1].numel()):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[name] = rank
        load[rank] += p.numel()
    return owner


class WholeTensorTrainer:
    """Each parameter whole on one rank, with its optimizer state (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any]):
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.named = list(model.named_parameters())
        self.owner = balanced_owners(self.named, self.world)
        self.mine = [p for name, p in self.named if self.owner[name] == self.rank]
        self.optimizer = optim["make_optimizer"](self.mine) if self.mine else None
        self.max_norm = optim.get("max_grad_norm")
        self.norm = 0.0

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        for _, p in self.named:
            p.grad = None
        loss = self.model(inputs, targets)
        loss.backward()
        squares = torch.zeros((), dtype=self.named[0][1].dtype)
        for name, p in self.named:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.reduce(grad, dst=self.owner[name])
            if self.owner[name] == self.rank:
                p.grad = grad.div_(self.world)
                squares += torch.linalg.vector_norm(p.grad) ** 2
        dist.all_reduce(squares)
        self.norm = float(squares.sqrt())
        if self.max_norm is not None:
            coef = min(float(self.max_norm) / (self.norm + 1e-6), 1.0)
            for p in self.mine:
                p.grad.mul_(coef)
        if self.optimizer is not None:
            self.optimizer.step()
        with torch.no_grad():
            for name, p in self.named:
                dist.broadcast(p.data, src=self.owner[name])
        return float(loss.detach())

    def last_grad_norm(self) -> float:
        return self.norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        state = self.optimizer.state if self.optimizer is not None else {}
        for name, p in self.named:
            held = [None]
            if self.owner[name] == self.rank:
                held = [{k: v.detach().clone() for k, v in state.get(p, {}).items() if torch.is_tensor(v)}]
            dist.broadcast_object_list(held, src=self.owner[name])
            out[name] = held[0] or {}
        return out

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        return {name: [(0, p.numel())] if self.owner[name] == self.rank else [] for name, p in self.named}


class SlicedTrainer:
    """Every tensor split among the ranks, each slice stepped as a tensor of its own (module docstring)."""

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any], layout: str):
        self.model = model
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.named = list(model.named_parameters())
        self.max_norm = optim.get("max_grad_norm")
        # per tensor: every rank's (start, stop) of its flattened elements, and this rank's slice
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        self.slices: dict[str, torch.Tensor] = {}
        for name, p in self.named:
            self.ranges[name] = self._split(p, layout)
            start, stop = self.ranges[name][self.rank]
            if stop > start:
                piece = p.detach().reshape(-1)[start:stop].clone()
                if p.ndim == 2:
                    piece = piece.view(-1, p.shape[1]) if layout == "rows" else piece.view(1, -1)
                self.slices[name] = piece.requires_grad_(True)
        self.optimizer = optim["make_optimizer"](list(self.slices.values())) if self.slices else None

    def _split(self, p: torch.Tensor, layout: str) -> list[tuple[int, int]]:
        if layout == "rows" and p.ndim == 2:
            rows, cols = p.shape
            bounds = [rows * r // self.world for r in range(self.world + 1)]
            return [(bounds[r] * cols, bounds[r + 1] * cols) for r in range(self.world)]
        n = p.numel()
        bounds = [n * r // self.world for r in range(self.world + 1)]
        return [(bounds[r], bounds[r + 1]) for r in range(self.world)]

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        for _, p in self.named:
            p.grad = None
        loss = self.model(inputs, targets)
        loss.backward()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.named]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.world)
        coef = 1.0
        if self.max_norm is not None:
            coef = min(float(self.max_norm) / (float(torch.linalg.vector_norm(flat)) + 1e-6), 1.0)
        offset = 0
        for name, p in self.named:
            if name in self.slices:
                start, stop = self.ranges[name][self.rank]
                piece = self.slices[name]
                piece.grad = (flat[offset + start:offset + stop] * coef).view(piece.shape).clone()
            offset += p.numel()
        if self.optimizer is not None:
            self.optimizer.step()
        with torch.no_grad():
            for name, p in self.named:  # gloo gathers equal sizes: every slice padded to the longest
                sizes = [stop - start for start, stop in self.ranges[name]]
                mine = torch.zeros(max(sizes), dtype=p.dtype)
                if name in self.slices:
                    mine[:sizes[self.rank]] = self.slices[name].detach().reshape(-1)
                pieces = [torch.empty_like(mine) for _ in sizes]
                dist.all_gather(pieces, mine)
                p.copy_(torch.cat([piece[:n] for piece, n in zip(pieces, sizes, strict=True)]).view(p.shape))
        return float(loss.detach())

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.named}

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        out = {}
        for name, _ in self.named:
            start, stop = self.ranges[name][self.rank]
            out[name] = [(start, stop)] if stop > start else []
        return out


def whole_tensor(model: torch.nn.Module, optim: dict[str, Any]) -> WholeTensorTrainer:
    return WholeTensorTrainer(model, optim)


def muon_on_row_blocks(model: torch.nn.Module, optim: dict[str, Any]) -> SlicedTrainer:
    return SlicedTrainer(model, optim, "rows")


def optimizer_on_flat_slices(model: torch.nn.Module, optim: dict[str, Any]) -> SlicedTrainer:
    return SlicedTrainer(model, optim, "flat")


def sgd_with_nesterov(params: Any) -> torch.optim.Optimizer:
    """A user's optimizer for ``--optimizers tests.verify_trainers.whole_tensor:sgd_with_nesterov``."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
