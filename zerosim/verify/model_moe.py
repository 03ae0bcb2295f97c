"""The built-in mixture-of-experts model ``zerosim verify --model moe`` trains: top-k routed experts.

One residual dense MLP and one residual mixture-of-experts layer between a token + position embedding
and a language-model head. The MoE layer's router (a linear map with a bias) scores each token for
every expert; the token goes to its ``top_k`` highest-scoring experts, and its output is the sum of
those experts' outputs weighted by the softmax of their scores (the gates). Every expert is a GELU
MLP of its own. The router learns through the gates.

Deterministic, so that an expert-parallel trainer can match the unsharded float64 reference:

* ties between scores are broken by the lower expert index (a stable descending sort, not
  ``torch.topk``, whose order among equal values is unspecified);
* no capacity: every token reaches all of its ``top_k`` experts, none is dropped;
* every expert runs in every step, on the rows routed to it, none at all included: an expert no
  token reached has a zero gradient (not ``None``), so the optimizer steps it (weight decay, momentum)
  in the reference as in any trainer, the way a grouped expert matmul treats it. A trainer that
  leaves such an expert's gradient ``None`` skips its step and drifts from the reference.

Sizes: d_model 13, expert width 23, 7 experts, top 2, vocabulary 37, 7 positions, dense MLP width 17:
the parameter count (6,139) and every tensor's element count are divisible by none of 2, 3, 4 or 8 (7 experts
spread over 2, 3, 4 or 8 expert-parallel ranks leave some rank with one expert more than another).

The layer computes each (token, slot) pair's expert output through :attr:`MoELayer.expert_runner`:
``None`` runs every expert here (the unsharded model); an expert-parallel trainer sets it to a
callable ``runner(layer, rows, experts) -> outputs`` that dispatches the rows to the ranks owning
their experts and brings the outputs back in the same order (``examples/expert_parallel_trainer.py``).
The weighted sum over a token's slots is the layer's own, the same code on every path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MOE_CONFIG", "MoEConfig", "MoELayer", "MoEModel", "moe_factory", "route"]

ExpertRunner = Callable[["MoELayer", torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MoEConfig:
    vocab: int = 37
    block: int = 7
    d_model: int = 13
    d_dense: int = 17
    d_expert: int = 23
    n_expert: int = 7
    top_k: int = 2
    batch: int = 2  # sequences per rank per step
    n_layer: int = 2  # the dense MLP and the MoE layer (for the rounding model's depth)

    @property
    def widest(self) -> int:
        """The longest dot product in one layer (for :mod:`zerosim.checks.tolerance`'s rounding model)."""
        return max(self.d_model, self.d_dense, self.d_expert, self.vocab, self.block, self.n_expert)


MOE_CONFIG = MoEConfig()


class Expert(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_expert)
        self.out = nn.Linear(cfg.d_expert, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


def route(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert indices [tokens, top_k], gates [tokens, top_k]) from router scores [tokens, experts]:
    the ``top_k`` highest scores, ties to the lower index, gates the softmax over the chosen scores."""
    order = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    return order, torch.gather(scores, 1, order).softmax(dim=-1)


class MoELayer(nn.Module):
    """Router + experts; ``forward(h [tokens, d_model]) -> [tokens, d_model]`` (module docstring)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_expert)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.n_expert))
        self.expert_runner: ExpertRunner | None = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        chosen, gates = route(self.router(h), self.top_k)
        rows = h.repeat_interleave(self.top_k, dim=0)  # (token, slot) pairs, token-major
        experts = chosen.reshape(-1)
        runner = self.expert_runner if self.expert_runner is not None else run_every_expert
        outputs = runner(self, rows, experts).view(h.shape[0], self.top_k, h.shape[1])
        return (gates.unsqueeze(-1) * outputs).sum(dim=1)


def run_every_expert(layer: MoELayer, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Each row through its expert, here: the unsharded path (an expert with no row runs on none)."""
    out = rows.new_zeros(rows.shape)
    for e, expert in enumerate(layer.experts):
        picked = torch.nonzero(experts == e).reshape(-1)
        out = out.index_copy(0, picked, expert(rows.index_select(0, picked)))
    return out


class MoEModel(nn.Module):
    """``model(inputs, targets) -> mean loss`` over the local batch (int64 [batch, block] each)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block, cfg.d_model)
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_dense)
        self.out = nn.Linear(cfg.d_dense, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoELayer(cfg)
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        b, t = inputs.shape
        x = self.wte(inputs) + self.wpe(torch.arange(t, device=inputs.device))
        x = x + self.out(F.gelu(self.fc(self.ln1(x))))
        x = x + self.moe(self.ln2(x).reshape(b * t, -1)).view(b, t, -1)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def moe_factory(seed: int) -> tuple[nn.Module, Callable[..., Any]]:
    """The ``--model moe`` factory: the model with weights drawn from ``seed`` (float64, identical on
    every call) and ``make_batch(step, rank, world, micro)``, seeded per (seed, rank, step, micro) as
    :func:`zerosim.verify.model.micro_batch` draws the GPT's."""
    from .model import MICRO_STRIDE

    cfg = MOE_CONFIG
    gen = torch.Generator().manual_seed(1_000_003 * seed + 41)
    model = MoEModel(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() == 1:  # LayerNorm gains near one
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))

    def make_batch(step: int, rank: int, world: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (seed * 7919 + step) * 104_729 + rank + micro * MICRO_STRIDE
        batch_gen = torch.Generator().manual_seed(key % 2**62)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.block + 1), generator=batch_gen)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return model, make_batch
