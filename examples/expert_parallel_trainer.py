"""A hand-written expert-parallel trainer for a mixture-of-experts model that passes ``zerosim verify``.

Expert parallelism: each expert lives on one rank (expert ``e`` on rank ``e % world``, so 7 experts on
2 ranks are 4 + 3); everything else (embeddings, the dense MLP, the router, the norms and the head) is
replicated. One step on every rank:

1. forward on this rank's micro-batch. The router picks each token's experts here; the MoE layer's
   (token, slot) rows are sorted by the rank that owns their expert and sent there with one
   ``all_to_all_single`` (the dispatch); each rank runs its own experts on the rows it received, and
   a second ``all_to_all_single`` sends the outputs back (the combine). Both exchanges are
   differentiable: their backward is the opposite exchange, so a row's gradient returns to the rank
   its token came from and each expert's gradient collects every rank's tokens.
2. backward of the local mean loss. An expert's gradient is now the *sum* over ranks of their
   losses' gradients; the dense gradients are this rank's alone.
3. dense gradients (the router's included): all-reduce and divide by the world size. Expert
   gradients: divide by the world size, without a collective (the exchange already summed them).
   Both are then the gradient of the mean loss over all ranks' micro-batches.
4. the global gradient norm: the dense part (identical on every rank after step 3) plus one
   all-reduce of the squares of the experts each rank owns; clip with it when the phase clips.
5. the phase's optimizer (``optim["make_optimizer"]``) on the dense parameters and this rank's
   experts. Every tensor is whole on the ranks that step it, so any optimizer works: SGD, AdamW,
   Adafactor, Muon.

gloo's list ``all_to_all`` (torch 2.13) needs tensors of one size per peer; ``all_to_all_single`` with
split sizes carries the uneven counts a router produces, so that is the one used here.

Verify it from the repository root (the current directory is importable on every rank)::

    zerosim verify examples.expert_parallel_trainer:make_trainer --model moe --world 2
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class Exchange(torch.autograd.Function):
    """``all_to_all_single`` of the rows of a 2-D tensor with uneven split sizes, differentiable: the
    backward sends the gradient rows back along the same pairs of ranks."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        ctx.counts = (send_counts, recv_counts)
        out = rows.new_empty((sum(recv_counts), rows.shape[1]))
        dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        send_counts, recv_counts = ctx.counts
        back = grad.new_empty((sum(send_counts), grad.shape[1]))
        dist.all_to_all_single(back, grad.contiguous(), send_counts, recv_counts)
        return back, None, None


class ExpertParallelTrainer:
    """Expert parallelism over the default process group; serves ``zerosim verify``'s trainer protocol.

    Needs a model whose ``moe`` attribute is a mixture-of-experts layer with ``experts`` (a module
    list), a router and an ``expert_runner`` hook (``zerosim.verify.model_moe.MoELayer``)."""

    def __init__(self, model: torch.nn.Module, optim: dict):
        layer = getattr(model, "moe", None)
        if layer is None or not hasattr(layer, "experts") or not hasattr(layer, "expert_runner"):
            raise NotImplementedError("expert parallelism needs a mixture-of-experts model (--model moe)")
        self.model, self.layer, self.optim = model, layer, dict(optim)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.n_expert = len(layer.experts)
        self.owner = [e % self.world for e in range(self.n_expert)]
        expert_of = {id(p): e for e, ex in enumerate(layer.experts) for p in ex.parameters()}
        self.names = [name for name, _ in model.named_parameters()]
        self.dense = [(n, p) for n, p in model.named_parameters() if id(p) not in expert_of]
        self.experts: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(self.n_expert)]
        for n, p in model.named_parameters():
            if id(p) in expert_of:
                self.experts[expert_of[id(p)]].append((n, p))
        self.mine = [e for e in range(self.n_expert) if self.owner[e] == self.rank]
        self.stepped = [p for _, p in self.dense] + [p for e in self.mine for _, p in self.experts[e]]
        self.optimizer = optim["make_optimizer"](self.stepped)
        self.grad_norm = float("nan")
        layer.expert_runner = self.dispatch

    # ---- the expert-parallel forward ------------------------------------------------------------
    def dispatch(self, layer: torch.nn.Module, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) row through its expert on the expert's owner; the outputs in ``rows``' order."""
        owners = experts % self.world
        order = torch.argsort(owners * self.n_expert + experts, stable=True)
        send_counts = torch.bincount(owners, minlength=self.world)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        arrived_experts = experts.new_empty(sum(recv))
        dist.all_to_all_single(arrived_experts, experts[order].contiguous(), recv, send)
        arrived = Exchange.apply(rows[order], send, recv)
        # start from arrived * 0: the dispatch stays in the autograd graph on a rank that owns no expert
        # (world > 7), so every rank's backward runs both exchanges (they are collectives)
        out = arrived * 0.0
        experts_here: Any = layer.experts
        for e in self.mine:  # every own expert runs, on no row too: its gradient is then zeros, not None
            picked = torch.nonzero(arrived_experts == e).reshape(-1)
            out = out.index_copy(0, picked, experts_here[e](arrived.index_select(0, picked)))
        returned = Exchange.apply(out, recv, send)
        return returned.index_select(0, torch.argsort(order))

    # ---- one step ---------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        for p in self.model.parameters():
            p.grad = None
        loss = self.model(inputs, targets)
        loss.backward()
        self.reduce_dense_gradients()
        self.average_expert_gradients()
        self.grad_norm = self.global_norm()
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is not None:
            coefficient = min(1.0, max_norm / (self.grad_norm + 1e-6))
            for p in self.stepped:
                if p.grad is not None:
                    p.grad.mul_(coefficient)
        self.optimizer.step()
        return float(loss.detach())

    def reduce_dense_gradients(self) -> None:
        """The replicated tensors' gradients averaged over ranks: one all-reduce of their concatenation."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.dense]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for _, p in self.dense:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def average_expert_gradients(self) -> None:
        """This rank's experts: their gradient already sums every rank's tokens; divide by the world."""
        for e in self.mine:
            for _, p in self.experts[e]:
                if p.grad is not None:
                    p.grad /= self.world

    def global_norm(self) -> float:
        """The norm of the whole averaged gradient: dense (replicated) plus every rank's own experts."""
        dense = sum(float(p.grad.pow(2).sum()) for _, p in self.dense if p.grad is not None)
        own = torch.tensor([sum(float(p.grad.pow(2).sum()) for e in self.mine for _, p in self.experts[e]
                                if p.grad is not None)], dtype=torch.float64)
        dist.all_reduce(own)
        return math.sqrt(dense + float(own))

    # ---- what the harness reads -------------------------------------------------------------------
    def last_grad_norm(self) -> float:
        return self.grad_norm

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Dense tensors as held here; each expert broadcast from its owner (one flat tensor per expert)."""
        out = {n: p.detach().clone() for n, p in self.dense}
        for e, params in enumerate(self.experts):
            flat = torch.cat([p.detach().reshape(-1) for _, p in params])
            dist.broadcast(flat, src=self.owner[e])
            offset = 0
            for n, p in params:
                out[n] = flat[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return {n: out[n] for n in self.names}

    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """torch.optim's state of every tensor: the dense ones' from here, each expert's from its owner."""
        index = {id(p): n for n, p in self.model.named_parameters()}
        mine = {index[id(p)]: {k: v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
                for p, st in self.optimizer.state.items()}
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, {n: s for n, s in mine.items() if n not in dict(self.dense)})
        out = {n: s for n, s in mine.items() if n in dict(self.dense)}
        for per_rank in gathered:
            out.update(per_rank)
        return out

    def close(self) -> None:
        self.layer.expert_runner = None


def make_trainer(model: torch.nn.Module, optim: dict) -> ExpertParallelTrainer:
    """The factory ``zerosim verify examples.expert_parallel_trainer:make_trainer --model moe`` calls."""
    return ExpertParallelTrainer(model, optim)
