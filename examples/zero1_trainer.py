"""A small hand-written ZeRO-1 trainer that passes ``zerosim verify``.

ZeRO-1 shards the optimizer state: every rank keeps the full parameters and computes full gradients,
but only updates its own contiguous slice of one flat, padded parameter vector. One step:

1. forward + backward on this rank's micro-batch (a mean loss, so gradients are per-rank means);
2. all-reduce the flat gradient and divide by the world size: the mean over ranks;
3. clip with the global norm: each rank sums the squares of its own slice, one all-reduce adds them;
4. SGD with momentum or AdamW (torch.optim's formulas) on this rank's slice only;
5. all-gather the updated slices, in rank order, and copy them back into the parameters.

Verify it from the repository root (the current directory is importable on every rank)::

    zerosim verify examples.zero1_trainer:make_trainer --world 3
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


class Zero1Trainer:
    """ZeRO-1 over the default process group; serves the trainer protocol of ``zerosim verify``."""

    def __init__(self, model: torch.nn.Module, optim: dict):
        if optim["name"] not in ("sgd", "adamw"):
            raise NotImplementedError(f"optimizer {optim['name']!r}")
        self.model, self.optim = model, dict(optim)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.names = [name for name, _ in model.named_parameters()]  # a tied weight is listed once
        self.params = [p for _, p in model.named_parameters()]
        self.spans: list[tuple[int, int]] = []  # each parameter's half-open range in the flat vector
        for p in self.params:
            lo = self.spans[-1][1] if self.spans else 0
            self.spans.append((lo, lo + p.numel()))
        self.total = self.spans[-1][1]
        self.shard_size = math.ceil(self.total / self.world)
        self.start, self.stop = self.owned_range()
        self.steps_taken = 0
        shard = torch.zeros(self.stop - self.start, dtype=self.params[0].dtype, device=self.params[0].device)
        self.state = (
            {"momentum_buffer": shard.clone()}
            if optim["name"] == "sgd"
            else {"exp_avg": shard.clone(), "exp_avg_sq": shard.clone()}
        )

    def owned_range(self) -> tuple[int, int]:
        """This rank's half-open slice of the padded flat vector (world * shard_size elements)."""
        return self.rank * self.shard_size, (self.rank + 1) * self.shard_size

    def flat(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        """The tensors concatenated in parameter order, zero-padded to world * shard_size elements."""
        out = torch.zeros(
            self.shard_size * self.world, dtype=self.params[0].dtype, device=self.params[0].device
        )
        for t, (lo, hi) in zip(tensors, self.spans, strict=True):
            if t is not None:
                out[lo:hi] = t.detach().reshape(-1)
        return out

    # ---- one step -------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.zero_gradients()
        loss = self.model(inputs, targets)
        loss.backward()
        grad = self.mean_gradient(self.flat([p.grad for p in self.params]))[self.start : self.stop]
        if self.optim.get("max_grad_norm") is not None:
            grad = grad * self.clip_coefficient(grad)
        self.steps_taken += 1
        param = self.flat(list(self.params))[self.start : self.stop]
        self.update(param, grad)
        self.copy_into_parameters(self.all_gather(param))
        return float(loss.detach())

    def zero_gradients(self) -> None:
        for p in self.params:
            p.grad = None

    def mean_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The gradient averaged over ranks (each rank's loss is a mean over its own micro-batch)."""
        dist.all_reduce(flat_grad)
        return flat_grad / self.world

    def clip_coefficient(self, grad_shard: torch.Tensor) -> float:
        """torch.nn.utils.clip_grad_norm_'s factor, with the norm of the whole gradient over all shards."""
        square_sum = (grad_shard * grad_shard).sum().reshape(1)
        dist.all_reduce(square_sum)
        coefficient = self.optim["max_grad_norm"] / (float(square_sum.sqrt()) + 1e-6)
        return min(coefficient, 1.0)

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """torch.optim.SGD (momentum, L2 weight decay) or torch.optim.AdamW on this rank's slice, in place."""
        o, wd = self.optim, self.optim.get("weight_decay", 0.0)
        if o["name"] == "sgd":
            grad = grad.add(param, alpha=wd) if wd else grad
            buf = self.state["momentum_buffer"]
            if self.steps_taken == 1:
                buf.copy_(grad)
            else:
                buf.mul_(o["momentum"]).add_(grad)
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

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's slice, concatenated in rank order: the full padded flat vector."""
        pieces = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(pieces, shard.contiguous())
        return torch.cat(pieces)

    def copy_into_parameters(self, flat_param: torch.Tensor) -> None:
        with torch.no_grad():
            for p, (lo, hi) in zip(self.params, self.spans, strict=True):
                p.copy_(flat_param[lo:hi].view_as(p))

    # ---- what the harness reads -----------------------------------------------------------------
    def full_parameters(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in zip(self.names, self.params, strict=True)}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        full = {key: self.all_gather(shard) for key, shard in self.state.items()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p, (lo, hi) in zip(self.names, self.params, self.spans, strict=True):
            out[name] = {key: flat[lo:hi].view_as(p).clone() for key, flat in full.items()}
            if self.optim["name"] == "adamw":
                out[name]["step"] = torch.tensor(float(self.steps_taken))
        return out

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        """Per parameter, the element ranges of its flattened view inside this rank's slice."""
        out: dict[str, list[tuple[int, int]]] = {}
        for name, (lo, hi) in zip(self.names, self.spans, strict=True):
            start, stop = max(lo, self.start), min(hi, self.stop)
            out[name] = [(start - lo, stop - lo)] if start < stop else []
        return out


def make_trainer(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """The factory ``zerosim verify examples.zero1_trainer:make_trainer`` calls on every rank."""
    return Zero1Trainer(model, optim)
