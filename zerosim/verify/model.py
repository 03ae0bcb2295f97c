"""The built-in model ``zerosim verify`` trains: a small torch GPT, and each rank's seeded micro-batch.

Causal self-attention, LayerNorm, a GELU MLP, learned position embeddings. The sizes are chosen so
that the parameter count and most tensors are not divisible by 2, 3, 4 or 8 (d_model 25, 5 heads,
vocabulary 37, MLP width 47): a partitioner that splits evenly only when the world size divides the
count, or that drops a remainder, is exercised at every world size. Presets:

* ``gpt``: 2 blocks, separate embedding and head (the head has no bias).
* ``gpt-tied``: 2 blocks, the head's weight *is* the token embedding (one parameter, listed once by
  ``named_parameters()`` under ``wte.weight``; its gradient is the sum of both uses), plus a head bias.
* ``gpt-50m``: the same structure (without the two small tensors below) at 50,291,111 parameters
  (d_model 511 = 7 heads of 73, 8 blocks, MLP width 2047, vocabulary 24571, 65 positions), for
  timing a step (``zerosim bench peers``); its sizes keep the same property.

``gpt`` and ``gpt-tied`` also hold two tensors with fewer elements than the world sizes verify runs
at: ``small.bias`` (3 elements, added to the first three channels of the embedding) and ``small.gain``
(1 element, scaling the logits), last in ``named_parameters()``. Under per-parameter sharding at
world 4 some ranks own nothing of them: an empty shard must not break a trainer's shards, its
checkpoint or the checks.

``forward(inputs, targets)`` returns the mean cross-entropy over the local batch: the loss a trainer's
``step`` minimises. :func:`micro_batch` gives every (rank, step) its own tokens, seeded, so ranks train
on different data and the reference can rebuild every rank's batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from zerosim.errors import ConfigError

from .model_presets import PRESETS, GPTConfig, require_model

__all__ = ["GPT", "PRESETS", "GPTConfig", "build_model", "micro_batch", "parameter_count", "require_model",
           "torch_dtype"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.mask: torch.Tensor
        self.register_buffer(
            "mask", torch.tril(torch.ones(cfg.block, cfg.block, dtype=torch.bool)), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        hd = c // self.n_head
        q, k, v = (z.view(b, t, self.n_head, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.d_mlp)
        self.out = nn.Linear(cfg.d_mlp, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class SmallTensors(nn.Module):
    """A 3-element bias and a 1-element gain (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(3))
        self.gain = nn.Parameter(torch.ones(1))


class GPT(nn.Module):
    """``model(inputs, targets) -> mean loss`` over the local batch (int64 [batch, block] each)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=cfg.tied)
        if cfg.tied:
            self.head.weight = self.wte.weight
        # fewer elements than the world size: some ranks own none of them under per-parameter sharding
        # (a child module registered last, so they come last in named_parameters())
        self.small = SmallTensors() if cfg.small_tensors else None

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = inputs.shape[1]
        pos = torch.arange(t, device=inputs.device)
        x = self.wte(inputs) + self.wpe(pos)
        if self.small is not None:
            x = x + F.pad(self.small.bias, (0, x.shape[-1] - self.small.bias.shape[0]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if self.small is not None:
            logits = logits * self.small.gain
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build_model(name: str = "gpt", dtype: str = "float64", seed: int = 0) -> GPT:
    """The preset ``name`` with seeded weights, in ``dtype``: identical on every rank for the same seed.
    Weights are drawn in float64 and then cast, so a float32 model is the float64 one rounded."""
    cfg = require_model(name)
    gen = torch.Generator().manual_seed(1_000_003 * seed + 17)
    model = GPT(cfg).to(torch.float64)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() == 1:  # LayerNorm gains: near one, not exactly (so every element has a gradient)
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model.to(torch_dtype(dtype))


def torch_dtype(dtype: str) -> torch.dtype:
    if dtype == "float64":
        return torch.float64
    if dtype == "float32":
        return torch.float32
    raise ConfigError("dtype", dtype, "must be float64 or float32")


MICRO_STRIDE = 15_485_863  # a prime above any rank: micro-batch m of rank r seeds apart from every other


def micro_batch(
    rank: int, step: int, seed: int = 0, model: str = "gpt", micro: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, targets) for global step ``step`` (1-based) and micro-batch ``micro``
    (0-based; 0 is the only one without accumulation): int64 [batch, block] on the CPU, a function of
    (seed, rank, step, micro) only."""
    cfg = require_model(model)
    key = (seed * 7919 + step) * 104_729 + rank + micro * MICRO_STRIDE
    gen = torch.Generator().manual_seed(key % (2**62))
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.block + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
