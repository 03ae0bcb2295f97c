"""The zoo's correct sharded trainer: a small ZeRO-2 over ``torch.distributed``, serving verify's protocol.

Every reproduced bug (:mod:`zerosim.zoo.bugs`) is this trainer with one step of it replaced, switched on
by one flag (``bug``); with the flag off the same class is the bug's fixed twin, which must pass
``zerosim verify`` (C-ZERO-001..003, C-ZERO-007, C-ZERO-008). Its step, on one flat vector of every
parameter padded to ``world * shard`` elements:

1. forward + backward on this rank's micro-batch(es), each loss divided by the micro-batch count;
2. the flat gradient averaged over the ranks (:meth:`reduce`), each micro-batch's owned slice added
   into a gradient accumulator (:meth:`accumulate`, ZeRO-2 keeps only the owned slice);
3. the norm of the whole gradient (squares of each rank's slice, one all-reduce; :meth:`norm_squares`),
   logged (:meth:`logged_norm`) and used to clip as ``torch.nn.utils.clip_grad_norm_`` does;
4. SGD with momentum or AdamW (``torch.optim``'s formulas) on the owned slice of the master vector;
5. the updated slices all-gathered in rank order into the parameters the next forward reads.

A mesh ``(R, S)`` from ``--mesh`` is served for S = 1 (every rank owns everything, R replicas) or
S = world (one shard group); checkpoints are one file rank 0 writes with the full state, read by every
rank of the loading world (its own slice).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

CHECKPOINT_FILE = "zoo-trainer.pt"


class ZooTrainer:
    """ZeRO-2 over the default group (the trainer protocol of ``zerosim verify``); ``bug`` switches the
    subclass's one mechanism on (False: the fixed twin)."""

    bug: bool = False

    def __init__(self, model: torch.nn.Module, optim: dict, bug: bool = False):
        if optim["name"] not in ("sgd", "adamw"):
            raise NotImplementedError(f"optimizer {optim['name']!r}")
        self.bug = bug
        self.model, self.optim = model, dict(optim)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        mesh = optim.get("mesh")
        shard_ranks = self.world if mesh is None else int(mesh[1])
        if shard_ranks not in (1, self.world):
            raise NotImplementedError(f"mesh {mesh}: this trainer shards over 1 rank or all of them")
        self.shard_ranks = shard_ranks
        self.names = [name for name, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.prepare_model()
        self.spans: list[tuple[int, int]] = []
        for p in self.params:
            lo = self.spans[-1][1] if self.spans else 0
            self.spans.append((lo, lo + p.numel()))
        self.total = self.spans[-1][1]
        self.shard = math.ceil(self.total / shard_ranks)
        index = self.rank % shard_ranks
        self.start, self.stop = index * self.shard, (index + 1) * self.shard
        self.dtype, self.device = self.params[0].dtype, self.params[0].device
        self.master = self.flat(self.params)
        self.steps_taken = 0
        self.norm = 0.0
        shard = torch.zeros(self.stop - self.start, dtype=self.dtype, device=self.device)
        names = ("momentum_buffer",) if optim["name"] == "sgd" else ("exp_avg", "exp_avg_sq")
        self.state = {key: shard.clone() for key in names}

    # ---- the layout ------------------------------------------------------------------------------
    def prepare_model(self) -> None:
        """What a framework does to the module before sharding it (nothing here)."""

    def span_of(self, name: str) -> tuple[int, int]:
        """The flat range of parameter ``name``."""
        return self.spans[self.names.index(name)]

    def flat(self, tensors: list[Any]) -> torch.Tensor:
        """The tensors concatenated in parameter order, zero-padded to shard_ranks * shard elements."""
        out = torch.zeros(self.shard * self.shard_ranks, dtype=self.params[0].dtype,
                          device=self.params[0].device)
        for t, (lo, hi) in zip(tensors, self.spans, strict=True):
            if t is not None:
                out[lo:hi] = t.detach().reshape(-1)
        return out

    # ---- one step --------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        return self.step_accumulated([(inputs, targets)])

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self.steps_taken += 1
        count = len(micro_batches)
        accumulated: torch.Tensor | None = None
        losses = []
        for index, (inputs, targets) in enumerate(micro_batches):
            for p in self.params:
                p.grad = None
            self.before_forward()
            loss = self.model(inputs, targets)
            (loss * self.loss_factor(count)).backward()
            losses.append(float(loss.detach()))
            reduced = self.reduce(self.local_gradient())[self.start:self.stop]
            accumulated = self.accumulate(accumulated, reduced, index)
        assert accumulated is not None
        grad = accumulated.to(self.dtype)
        total = self.all_sum(self.norm_squares(grad))
        self.norm = self.logged_norm(total)
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is not None:
            grad = grad * min(max_norm / (self.clip_norm(total) + 1e-6), 1.0)
        owned = self.master[self.start:self.stop]
        self.update(owned, grad)
        self.after_update()
        self.master = self.all_gather(owned)
        self.load_into_model(self.master)
        return sum(losses) / count

    def before_forward(self) -> None:
        """What runs before each forward (nothing here)."""

    def loss_factor(self, count: int) -> float:
        """Each micro-batch's loss is divided by the micro-batch count: the step's gradient is the mean."""
        return 1.0 / count

    def local_gradient(self) -> torch.Tensor:
        return self.flat([p.grad for p in self.params])

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The gradient averaged over every rank (the replicas of a mesh included)."""
        dist.all_reduce(flat_grad)
        return flat_grad / self.world

    def accumulate(self, accumulated: torch.Tensor | None, reduced: torch.Tensor, index: int) -> torch.Tensor:
        """The micro-batches' reduced slices summed, in the master dtype."""
        return reduced.clone() if accumulated is None else accumulated + reduced

    def norm_squares(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's share of the squared gradient norm (its owned slice; once per shard group)."""
        squares = (grad * grad).sum().reshape(1)
        return squares if self.shard_ranks > 1 or self.rank == 0 else torch.zeros_like(squares)

    def all_sum(self, value: torch.Tensor) -> float:
        dist.all_reduce(value)
        return float(value)

    def logged_norm(self, squares: float) -> float:
        """The total gradient norm before clipping, as the training loop logs it."""
        return math.sqrt(squares)

    def clip_norm(self, squares: float) -> float:
        return math.sqrt(squares)

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """torch.optim.SGD (momentum, L2 weight decay) or AdamW on this rank's slice, in place."""
        o, wd = self.optim, self.optim.get("weight_decay", 0.0)
        if o["name"] == "sgd":
            grad = grad.add(param, alpha=wd) if wd else grad
            buf = self.state["momentum_buffer"]
            buf.copy_(grad) if self.steps_taken == 1 else buf.mul_(o["momentum"]).add_(grad)
            param.add_(buf, alpha=-o["lr"])
            return
        beta1, beta2 = o["betas"]
        param.mul_(1 - o["lr"] * wd)
        m, v = self.state["exp_avg"], self.state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_size = o["lr"] / (1 - beta1**self.steps_taken)
        denom = (v.sqrt() / math.sqrt(1 - beta2**self.steps_taken)).add_(o["eps"])
        param.addcdiv_(m, denom, value=-step_size)

    def after_update(self) -> None:
        """What runs after the optimizer step, before the all-gather (nothing here)."""

    def all_gather(self, owned: torch.Tensor) -> torch.Tensor:
        if self.shard_ranks == 1:
            return owned.clone()
        pieces = [torch.empty_like(owned) for _ in range(self.world)]
        dist.all_gather(pieces, owned.contiguous())
        return torch.cat(pieces)

    def load_into_model(self, flat: torch.Tensor) -> None:
        """The flat vector copied into the parameters the next forward reads."""
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.spans, strict=True):
                p.copy_(flat[lo:hi].view_as(p))

    # ---- what verify reads -------------------------------------------------------------------------
    def last_grad_norm(self) -> float:
        return self.norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: self.master[lo:hi].view_as(p).clone()
                for name, p, (lo, hi) in zip(self.names, self.params, self.spans, strict=True)}

    def full_state_vectors(self) -> dict[str, torch.Tensor]:
        return {key: self.all_gather(shard) for key, shard in self.state.items()}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        full = self.full_state_vectors()
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p, (lo, hi) in zip(self.names, self.params, self.spans, strict=True):
            out[name] = {key: vec[lo:hi].view_as(p).clone() for key, vec in full.items()}
            if self.optim["name"] == "adamw":
                out[name]["step"] = torch.tensor(float(self.steps_taken))
        return out

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        out: dict[str, list[tuple[int, int]]] = {}
        for name, (lo, hi) in zip(self.names, self.spans, strict=True):
            start, stop = max(lo, self.start), min(hi, self.stop)
            out[name] = [(start - lo, stop - lo)] if start < stop else []
        return out

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint_payload(self) -> dict[str, Any]:
        """The full state as rank 0 writes it: parameters by name, optimizer vectors, step counter."""
        full = self.full_state_vectors()
        return {"world": self.world, "steps": self.steps_taken, "params": self.full_parameters(),
                "state": {key: vec[:self.total].clone() for key, vec in full.items()}}

    def save_checkpoint(self, directory: str) -> None:
        payload = self.checkpoint_payload()
        if self.rank == 0:
            os.makedirs(directory, exist_ok=True)
            torch.save(payload, os.path.join(directory, CHECKPOINT_FILE))
        dist.barrier()

    def restore(self, payload: dict[str, Any]) -> None:
        """This rank's state from a loaded payload (the full vectors, its own slices)."""
        self.steps_taken = int(payload["steps"])
        self.master = self.flat([payload["params"][name] for name in self.names])
        for key, vec in payload["state"].items():
            padded = torch.zeros(self.shard * self.shard_ranks, dtype=self.dtype, device=self.device)
            padded[:self.total] = vec
            self.state[key] = padded[self.start:self.stop].clone()
        self.load_into_model(self.master)

    def load_checkpoint(self, directory: str) -> None:
        payload = torch.load(os.path.join(directory, CHECKPOINT_FILE), weights_only=True)
        self.restore(payload)
