"""The zoo's mixture-of-experts entries: the repository's expert-parallel trainer with one mechanism each.

Both classes are :class:`examples.expert_parallel_trainer.ExpertParallelTrainer` (experts owned by
ranks, tokens dispatched with ``all_to_all_single`` on gloo, run by ``zerosim verify --model moe``)
with one step replaced while ``bug`` is set; the same class with the flag off is the fixed twin:

* :class:`ExpertDivideFactorSkipped`: the all-to-all's backward hands each expert the sum of every
  expert-parallel rank's tokens' gradients, and the expert-data-parallel reduce that follows divides
  by its gradient divide factor (the world size). With EP equal to the world that group is one rank,
  and the bug skips its reduce together with the divide factor: every expert gradient comes out EP
  times too large, every other gradient is right.
* :class:`TokenGatherWithoutReduceScatter`: no all-to-all; every rank's tokens are all-gathered
  across the EP ranks, each rank runs its own experts on all of them, and the outputs are summed
  back to the rank each token came from (a reduce-scatter). The all-gather's backward must
  reduce-scatter the tokens' gradients (each token's gradient sums the contributions of the experts
  on every rank); the bug returns this rank's slice of its own gradient only, the backward a
  replicated gradient placement gives. The expert gradients are right; every parameter below the
  experts gets a gradient that misses the other ranks' experts.

The trainer lives in ``examples/`` (it is the user's trainer verify's docs walk through); a source
checkout's root is put on ``sys.path`` when the current folder is not it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from examples.expert_parallel_trainer import ExpertParallelTrainer
except ImportError:  # run from outside the checkout: its root holds examples/
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from examples.expert_parallel_trainer import ExpertParallelTrainer


class SwitchedExpertParallel(ExpertParallelTrainer):
    """The expert-parallel trainer with a ``bug`` flag (False: the fixed twin)."""

    def __init__(self, model: torch.nn.Module, optim: dict, bug: bool = False):
        self.bug = bug
        super().__init__(model, optim)


class ExpertDivideFactorSkipped(SwitchedExpertParallel):
    """The expert-data-parallel group has one rank (EP = world): its reduce is skipped, and the gradient
    divide factor with it, so the experts keep the sum the all-to-all's backward made."""

    def average_expert_gradients(self) -> None:
        if not self.bug:
            super().average_expert_gradients()


def _gather_rows(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's rows (``counts[r]`` of them on rank r) concatenated in rank order, on every rank."""
    padded = rows.new_zeros((max(counts), *rows.shape[1:]))
    padded[:len(rows)] = rows
    pieces = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(pieces, padded)
    return torch.cat([piece[:n] for piece, n in zip(pieces, counts, strict=True)])


class GatherTokens(torch.autograd.Function):
    """All-gather of the ranks' token rows. Backward: each rank's slice of the gradient summed over the
    ranks (all-reduce, then this rank's rows: a reduce-scatter); with ``local_only`` this rank's slice of
    its own gradient alone."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, counts: list[int], rank: int, local_only: bool) -> torch.Tensor:
        ctx.span = (sum(counts[:rank]), sum(counts[:rank + 1]))
        ctx.local_only = local_only
        return _gather_rows(rows, counts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        lo, hi = ctx.span
        if not ctx.local_only:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad)
        return grad[lo:hi].clone(), None, None, None


class SumToOwners(torch.autograd.Function):
    """The ranks' output rows summed (each row is nonzero on the rank that ran its expert only), this
    rank's rows kept: a reduce-scatter. Backward: the rows' gradients all-gathered."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, counts: list[int], rank: int) -> torch.Tensor:
        ctx.counts = counts
        total = out.contiguous().clone()
        dist.all_reduce(total)
        return total[sum(counts[:rank]):sum(counts[:rank + 1])].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_rows(grad.contiguous(), ctx.counts), None, None


class TokenGatherWithoutReduceScatter(SwitchedExpertParallel):
    """Tokens all-gathered across the EP ranks instead of dispatched; the gather's backward without its
    reduce-scatter while ``bug`` is set (module docstring)."""

    def dispatch(self, layer: torch.nn.Module, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        size = torch.tensor([len(rows)])
        sizes = [torch.empty_like(size) for _ in range(self.world)]
        dist.all_gather(sizes, size)
        counts = [int(s) for s in sizes]
        gathered = GatherTokens.apply(rows, counts, self.rank, self.bug)
        gathered_experts = _gather_rows(experts, counts)
        out = gathered * 0.0  # every rank's graph holds both collectives' backward
        experts_here: Any = layer.experts
        for e in self.mine:
            picked = torch.nonzero(gathered_experts == e).reshape(-1)
            out = out.index_copy(0, picked, experts_here[e](gathered.index_select(0, picked)))
        return SumToOwners.apply(out, counts, self.rank)


def runner_only(cls: type[SwitchedExpertParallel], model: torch.nn.Module,
                bug: bool) -> SwitchedExpertParallel:
    """``cls`` on ``model`` for its expert dispatch alone (no optimizer): the live loop keeps every expert
    on every rank and steps them itself, while each expert runs on its owner only."""
    return cls(model, {"make_optimizer": lambda params: None}, bug=bug)
