"""The unsharded reference C-ZERO-002 compares a trainer against: torch.optim on the global batch, float64.

The reference starts from the trainer's initial model (cast to float64, exactly: float32 values are
float64 values), builds every rank's micro-batch (:class:`zerosim.verify.model_source.ModelSource`:
the built-in model's :func:`zerosim.verify.model.micro_batch`, or the user's ``make_batch``),
concatenates them in rank order and takes one step of the phase's optimizer
(:mod:`zerosim.verify.optimizers`: ``torch.optim.SGD`` / ``Adam`` / ``AdamW`` / ``Adafactor``, the Muon
recipe or a user's factory; ``foreach=False`` where torch offers it) on the mean loss of that global
batch, after ``clip_grad_norm_`` when the phase clips. With equal local batches this is the
protocol's "mean over ranks of the local mean losses".
Under gradient accumulation (``grad_accum`` K) the global batch is all K x world micro-batches, in
(rank, micro-batch) order: the mean gradient over every micro-batch of every rank.

Besides the state after each step it records what the error model needs
(:mod:`zerosim.checks.tolerance`): the averaged gradient, the per-element sum of the ranks' absolute
local gradients (the terms a sharded trainer adds up), the global norm and the clip factor.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .model_source import ModelSource
from .optimizers import build_optimizer


@dataclass
class ReferenceStep:
    """The reference after one step (global, 1-based); arrays are float64, keyed by parameter name."""

    step: int
    phase: str
    phase_step: int  # 1-based within the phase (Adam's step count)
    params_before: dict[str, np.ndarray]
    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]]
    grad: dict[str, np.ndarray]  # mean over the global batch, before clipping
    grad_terms: dict[str, np.ndarray]  # mean over ranks of |local gradient|
    grad_norm: float
    clip_coef: float  # the factor clip_grad_norm_ applied (1.0: the clip did not bind, or no clip)
    losses: list[float] = field(default_factory=list)  # each rank's local loss at the step's start
    # under accumulation: per micro-batch index, the mean over ranks of that micro-batch's gradient
    micro_grads: list[dict[str, np.ndarray]] = field(default_factory=list)

    @property
    def clip_bound(self) -> bool:
        return self.clip_coef < 1.0


def make_optimizer(params: Any, optim: dict[str, Any]) -> Any:
    """The phase's optimizer (:func:`zerosim.verify.optimizers.build_optimizer`, single-tensor code path)."""
    return build_optimizer(params, optim, single_tensor=True)


class Reference:
    """Unsharded float64 training of ``model`` (deep-copied) on the global batch of ``world`` ranks."""

    def __init__(
        self,
        model: torch.nn.Module,
        optim: dict[str, Any],
        world: int,
        *,
        model_name: str = "gpt",
        seed: int = 0,
        phase: str = "",
        data_offset: int = 0,
        resume: tuple[int, int] | None = None,
        grad_accum: int = 1,
        source: ModelSource | None = None,
        gradient_perturbation: Callable[[int, dict[str, torch.Tensor], dict[str, np.ndarray]], None]
        | None = None,
    ):
        self.source = source if source is not None else ModelSource(model_name, seed)
        # another valid run's gradient (zerosim.verify.estimated_bound): called with the step, the mean
        # gradients by name (changed in place) and the mean |local gradient| terms, before the clip
        self.gradient_perturbation = gradient_perturbation
        self.data_offset = data_offset
        self.grad_accum = grad_accum
        # (last global step before a resume, the world size after it): later steps average that many
        # ranks' micro-batches
        self.resume = resume
        self.model = copy.deepcopy(model).to(device="cpu", dtype=torch.float64)
        self.optim = dict(optim)
        self.world = world
        self.model_name = model_name
        self.seed = seed
        self.phase = phase or str(optim["name"])
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        self.optimizer = make_optimizer(self.params, self.optim)
        self.phase_step = 0
        self.micro_grads: list[dict[str, np.ndarray]] = []

    def world_at(self, step: int) -> int:
        """The number of ranks whose micro-batches make up global step ``step``'s batch."""
        if self.resume is not None and step > self.resume[0]:
            return self.resume[1]
        return self.world

    def batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every micro-batch of global step ``step``, rank-major: rank r's micro-batch m at r K + m."""
        world = self.world_at(step)
        return [
            self.source.batch(r, step + self.data_offset, m, world)
            for r in range(world)
            for m in range(self.grad_accum)
        ]

    def local_gradients(self, step: int) -> tuple[dict[str, np.ndarray], list[float]]:
        """Mean over micro-batches of |each micro-batch's local gradient| at the current weights, and each
        rank's local loss (under accumulation: the mean over its micro-batches)."""
        terms = {n: np.zeros(tuple(p.shape)) for n, p in zip(self.names, self.params, strict=True)}
        losses = []
        batches = self.batches(step)
        k = self.grad_accum
        micro = [{n: np.zeros(tuple(p.shape)) for n, p in zip(self.names, self.params, strict=True)}
                 for _ in range(k if k > 1 else 0)]
        for i, (inputs, targets) in enumerate(batches):
            self.model.zero_grad(set_to_none=True)
            loss = self.model(inputs, targets)
            loss.backward()
            losses.append(float(loss.detach()))
            for n, p in zip(self.names, self.params, strict=True):
                if p.grad is not None:
                    g = p.grad.numpy()
                    terms[n] += np.abs(g)
                    if micro:
                        micro[i % k][n] += g
        ranks = len(batches) // k
        self.micro_grads = [{n: g / ranks for n, g in m.items()} for m in micro]
        rank_losses = [sum(losses[r * k:(r + 1) * k]) / k for r in range(ranks)]
        return {n: t / len(batches) for n, t in terms.items()}, rank_losses

    def gradient_norm(self, step: int) -> float:
        """The global gradient norm at the current weights for global step ``step`` (no update)."""
        self._global_gradient(step)
        return float(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params if p.grad is not None])
            )
        )

    def _global_gradient(self, step: int) -> None:
        """The mean gradient over the step's micro-batches in ``.grad``: one backward of the built-in
        model on their concatenation (its mean loss over equal micro-batches is the mean of theirs), a
        user's model one backward per micro-batch of its loss divided by their number."""
        batches = self.batches(step)
        self.model.zero_grad(set_to_none=True)
        if self.source.concatenable:
            inputs = torch.cat([b[0] for b in batches])
            targets = torch.cat([b[1] for b in batches])
            self.model(inputs, targets).backward()
            return
        for inputs, targets in batches:
            (self.model(inputs, targets) / len(batches)).backward()

    def step(self, step: int) -> ReferenceStep:
        """One optimizer step on the global batch of global step ``step``; returns what it recorded."""
        before = self.snapshot()
        terms, losses = self.local_gradients(step)
        self._global_gradient(step)
        grad = {
            n: p.grad.numpy().copy()
            for n, p in zip(self.names, self.params, strict=True)
            if p.grad is not None
        }
        if self.gradient_perturbation is not None:
            self.gradient_perturbation(
                step,
                {n: p.grad for n, p in zip(self.names, self.params, strict=True) if p.grad is not None},
                terms,
            )
        max_norm = self.optim.get("max_grad_norm")
        if max_norm is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm, foreach=False))
            coef = min(1.0, float(max_norm) / (norm + 1e-6))
        else:
            norm = float(
                torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(p.grad) for p in self.params if p.grad is not None])
                )
            )
            coef = 1.0
        self.optimizer.step()
        self.phase_step += 1
        for n in self.names:
            grad.setdefault(n, np.zeros(before[n].shape))
        return ReferenceStep(
            step,
            self.phase,
            self.phase_step,
            before,
            self.snapshot(),
            self.state(),
            grad,
            terms,
            norm,
            coef,
            losses,
            self.micro_grads,
        )

    def snapshot(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in zip(self.names, self.params, strict=True)}

    def state(self) -> dict[str, dict[str, np.ndarray]]:
        out: dict[str, dict[str, np.ndarray]] = {}
        for n, p in zip(self.names, self.params, strict=True):
            st = self.optimizer.state.get(p, {})
            out[n] = {
                k: (v.detach().numpy().copy() if torch.is_tensor(v) else np.asarray(v, dtype=np.float64))
                for k, v in st.items()
                if v is not None
            }
        return out


CLIP_DATA_OFFSETS = 8  # batch orders tried before settling for a clip that binds at the phase's first step


def choose_clip(
    model: torch.nn.Module,
    optim: dict[str, Any],
    world: int,
    first_step: int,
    steps: int,
    *,
    model_name: str = "gpt",
    seed: int = 0,
    grad_accum: int = 1,
    source: ModelSource | None = None,
) -> tuple[float, int, int]:
    """A ``max_grad_norm`` for the AdamW phase that binds at some step but not at the phase's first:
    (threshold, the phase step where it first binds, the data offset of the phase's batches).

    Runs the phase unclipped: with n_1 the first step's norm and k the first later step whose norm
    exceeds n_1, the threshold (n_1 + n_k) / 2 leaves steps 1..k-1 unclipped (their norms are at most
    n_1), so the clipped and unclipped runs agree up to step k, where it binds. A divergence that
    starts exactly there points at the clip. When the norms of the phase's batches only fall, the
    next batches (a data offset) are tried; if none rises, 0.9 n_1 binds at step 1.
    """
    for offset in range(CLIP_DATA_OFFSETS):
        ref = Reference(
            model,
            {**optim, "max_grad_norm": None},
            world,
            model_name=model_name,
            seed=seed,
            data_offset=offset * steps,
            grad_accum=grad_accum,
            source=source,
        )
        norms = []
        for k in range(steps):
            norms.append(ref.gradient_norm(first_step + k))
            ref.optimizer.step()
            if k > 0 and norms[-1] > norms[0]:
                middle = (norms[0] + norms[-1]) / 2
                rounded = _round_sig(middle)
                return (rounded if norms[0] < rounded < norms[-1] else middle), k + 1, offset * steps
    ref = Reference(model, {**optim, "max_grad_norm": None}, world, model_name=model_name, seed=seed,
                    grad_accum=grad_accum, source=source)
    return _round_sig(0.9 * ref.gradient_norm(first_step)), 1, 0


def _round_sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits - 1}e}")
