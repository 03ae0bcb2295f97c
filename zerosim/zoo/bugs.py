"""The zoo's bug trainers: :class:`~zerosim.zoo.trainer.ZooTrainer` with one mechanism of a reported bug.

Each class replaces one step of the correct trainer, and only while ``self.bug`` is set: the same class
with the flag off is the fixed twin. ``zerosim verify zerosim.zoo.bugs:broken_<name>`` runs a bug,
``zerosim.zoo.bugs:fixed_<name>`` its twin (:func:`__getattr__` builds both factories from
:data:`MECHANISMS`). The catalogue (:mod:`zerosim.zoo.catalogue`) says which report each mirrors.

On the built-in GPT a dense model stands in where a report needs a mixture of experts: block 1's MLP
plays the experts (:data:`EXPERT_PARAMS`), block 1's second norm the router (:data:`ROUTER_PARAMS`).
The two mechanisms that exist only inside an expert-parallel exchange run on ``--model moe`` with the
repository's expert-parallel trainer (:mod:`zerosim.zoo.moe_bugs`).
The runs are float64; where a report rounds to bfloat16 the bug rounds to bfloat16 too, which verify's
float64 bound sees as it sees a float32 master rounded to bfloat16.

Why one module of this length: each mechanism is a few lines replacing one step of the same trainer,
and the registry verify's targets are named from (:data:`MECHANISMS`) lists them all in one place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .matrix_bugs import MuonPerMicroBatch
from .trainer import CHECKPOINT_FILE, ZooTrainer

BROKEN_RANK = 1  #: the rank a single-rank fault (a flipped bit, a drifting replica) happens on
FAULT_STEP = 2  #: the optimizer step a bit flips at (the step counter, 1-based)
FLIPPED_GRAD_BIT = 44  #: of a float64's 52 mantissa bits: a relative change of 2^-8 of that element
FLIPPED_WEIGHT_BIT = 30  #: a relative change of 2^-22: far above rounding, far below what a loss shows
NARROW = torch.bfloat16  #: the dtype a precision bug rounds to
EXPERT_PARAMS = ("blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.out.weight", "blocks.1.out.bias")
ROUTER_PARAMS = ("blocks.1.ln2.weight", "blocks.1.ln2.bias")
NORM_PARAMS = ("ln_f.weight", "ln_f.bias")  #: the replicated layer norm of the BLOOM entry
FUSED_PARAM = "blocks.0.attn.qkv.weight"  #: the fused projection the reshard bug reorders


def _mask(trainer: ZooTrainer, names: tuple[str, ...]) -> torch.Tensor:
    """True on the flat elements of ``names`` (the padded flat layout)."""
    mask = torch.zeros(trainer.shard * trainer.shard_ranks, dtype=torch.bool)
    for name in names:
        lo, hi = trainer.span_of(name)
        mask[lo:hi] = True
    return mask


class ReplicatedGradientNorm(ZooTrainer):
    """ZeRO-1 with an all-reduced gradient: every rank holds the whole averaged gradient, so the norm is
    taken from it without a collective of its own (verify then counts exactly ZeRO-1's traffic: one
    gradient all-reduce and one parameter all-gather per step)."""

    declared_strategy = "zero1"

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self._full: torch.Tensor | None = None
        return super().step_accumulated(micro_batches)

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        mean = self.reduce_full(flat_grad)
        self._full = mean.clone() if self._full is None else self._full + mean
        return mean

    def reduce_full(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """The mean over the ranks of the parameters' elements (the padding is not sent)."""
        dist.all_reduce(flat_grad[:self.total])
        return flat_grad / self.world

    def all_sum(self, value: torch.Tensor) -> float:
        assert self._full is not None
        return float((self._full * self._full).sum())


# ---- gradient accumulation -----------------------------------------------------------------------
class LastMicroBatchOnly(ZooTrainer):
    """Every backward is an accumulation boundary, and a boundary resets the accumulator: only the last
    micro-batch's reduced gradient reaches the step."""

    def accumulate(self, accumulated: torch.Tensor | None, reduced: torch.Tensor, index: int) -> torch.Tensor:
        return reduced.clone() if self.bug else super().accumulate(accumulated, reduced, index)


class UnscaledAccumulation(ZooTrainer):
    """Micro-batch losses are not divided by the accumulation count: the step uses K times the mean."""

    def loss_factor(self, count: int) -> float:
        return 1.0 if self.bug else super().loss_factor(count)


class DoubleScaledAccumulation(ZooTrainer):
    """The loss is divided by the accumulation count twice (by the loop and again by the engine)."""

    def loss_factor(self, count: int) -> float:
        return 1.0 / count**2 if self.bug else super().loss_factor(count)


class PartialSumsInReduceDtype(ZooTrainer):
    """The reduced slices of the micro-batches are summed in an accumulator held in the narrow reduce
    dtype: every micro-batch's contribution is rounded into it."""

    def accumulate(self, accumulated: torch.Tensor | None, reduced: torch.Tensor, index: int) -> torch.Tensor:
        if not self.bug:
            return super().accumulate(accumulated, reduced, index)
        narrow = reduced.to(NARROW)
        return narrow if accumulated is None else (accumulated.to(NARROW) + narrow)


class ReducesEveryMicroBatch(ReplicatedGradientNorm):
    """The deferred synchronisation is a no-op: the gradient is all-reduced after every micro-batch
    instead of once per step (right values, K times the traffic). The twin adds the micro-batches'
    gradients locally and reduces once."""

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        self._micro_batches, self._index = len(micro_batches), 0
        self._local_sum: torch.Tensor | None = None
        return super().step_accumulated(micro_batches)

    def reduce_full(self, flat_grad: torch.Tensor) -> torch.Tensor:
        if self.bug:
            return super().reduce_full(flat_grad)
        self._index += 1
        local_sum = flat_grad if self._local_sum is None else self._local_sum + flat_grad
        self._local_sum = local_sum
        if self._index < self._micro_batches:
            return torch.zeros_like(flat_grad)  # nothing reduced yet: the sum arrives with the last one
        return super().reduce_full(local_sum)


# ---- the gradient norm -----------------------------------------------------------------------------
class LocalClipNorm(ZooTrainer):
    """The norm is the one of this rank's gradient shard only (never summed over the ranks): each rank
    clips by, and logs, its own local norm."""

    def all_sum(self, value: torch.Tensor) -> float:
        return float(value) if self.bug else super().all_sum(value)


class LoggedNormOverShards(ZooTrainer):
    """The logged norm is divided by the number of shards (the gradient's averaging divisor applied to the
    norm once more); the clip uses the right one."""

    def logged_norm(self, squares: float) -> float:
        return super().logged_norm(squares) / (self.world if self.bug else 1)


class LoggedNormSquaresAveraged(ZooTrainer):
    """The ranks' squared norms are averaged instead of summed before the root: the logged norm is too low
    by the root of the shard count; the clip uses the right one."""

    def logged_norm(self, squares: float) -> float:
        return super().logged_norm(squares / (self.world if self.bug else 1))


class ExpertsOutOfNorm(ZooTrainer):
    """The experts' gradients are left out of the norm: it clips too little and logs too little."""

    def norm_squares(self, grad: torch.Tensor) -> torch.Tensor:
        if self.bug:
            grad = grad.masked_fill(_mask(self, EXPERT_PARAMS)[self.start:self.stop], 0.0)
        return super().norm_squares(grad)


# ---- the gradient reduction ------------------------------------------------------------------------
class ExpertGradientsSummed(ZooTrainer):
    """The experts' gradients are summed over the ranks, not averaged: world times too large."""

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        mean = super().reduce(flat_grad)
        return torch.where(_mask(self, EXPERT_PARAMS), mean * self.world, mean) if self.bug else mean


class RouterNotReduced(ZooTrainer):
    """The router's gradient is marked replicated and never reduced: every rank updates the router with its
    own micro-batch's gradient, and the replicas drift apart from the first step."""

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        local = flat_grad.clone()
        mean = super().reduce(flat_grad)
        return torch.where(_mask(self, ROUTER_PARAMS), local, mean) if self.bug else mean


class ReplicasNotReduced(ZooTrainer):
    """On an (n, 1) mesh the gradient is reduced within the shard group only, a group of one rank: no
    gradient is reduced at all and every replica trains on its own micro-batch."""

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        return flat_grad.clone() if self.bug and self.shard_ranks == 1 else super().reduce(flat_grad)


class ReducesInNarrowDtype(ReplicatedGradientNorm):
    """The gradient is all-reduced in bfloat16 (the low-precision copy), not in the master dtype's buffer.
    It declares its strategy, so verify sees the dtype of every collective."""

    def reduce_full(self, flat_grad: torch.Tensor) -> torch.Tensor:
        if not self.bug:
            return super().reduce_full(flat_grad)
        narrow = flat_grad[:self.total].to(NARROW)
        dist.all_reduce(narrow)
        flat_grad[:self.total] = narrow.to(flat_grad.dtype)
        return flat_grad / self.world


class StaleGatherInGradBuffer(ZooTrainer):
    """The all-gather's receive buffer doubles as the gradient buffer and is not zeroed after the gather:
    from the second step every gradient is accumulated on top of the last gathered parameters."""

    def local_gradient(self) -> torch.Tensor:
        grad = super().local_gradient()
        return grad + self.master if self.bug and self.steps_taken > 1 else grad


class LayerNormReplicaDrift(ZooTrainer):
    """A replicated layer norm whose reduced gradient reaches one rank through another kernel's precision
    (float32 here): its copy differs from the others' in the last bits, and nothing re-synchronises the
    replicas, which drift apart."""

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        mean = super().reduce(flat_grad)
        if not (self.bug and self.rank == BROKEN_RANK):
            return mean
        rounded = mean.to(torch.float32).to(mean.dtype)
        return torch.where(_mask(self, NORM_PARAMS), rounded, mean)


class GradientBitFlip(ZooTrainer):
    """Silent data corruption: one bit of one element of rank 1's local gradient flips before the
    all-reduce, which spreads the wrong value to every rank alike."""

    def local_gradient(self) -> torch.Tensor:
        grad = super().local_gradient()
        if self.bug and self.rank == BROKEN_RANK and self.steps_taken == FAULT_STEP:
            lo = self.span_of("blocks.0.fc.weight")[0]
            grad[lo:lo + 1].view(torch.int64).bitwise_xor_(1 << FLIPPED_GRAD_BIT)
        return grad


class WeightBitFlip(ZooTrainer):
    """Silent data corruption: one bit of rank 1's copy of a weight flips after the all-gather."""

    def load_into_model(self, flat: torch.Tensor) -> None:
        if self.bug and self.rank == BROKEN_RANK and self.steps_taken == FAULT_STEP:
            lo = self.span_of("blocks.0.fc.weight")[0]
            flat[lo:lo + 1].view(torch.int64).bitwise_xor_(1 << FLIPPED_WEIGHT_BIT)
        super().load_into_model(flat)


# ---- the weights the step reads and writes ---------------------------------------------------------
class ForwardOnPreviousWeights(ZooTrainer):
    """The forward runs before the parameter all-gather of the last step has landed: every forward reads
    the weights of the step before (the masters are right, the gradients are taken at stale weights)."""

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        previous = self.master.clone()
        loss = super().step_accumulated(micro_batches)
        if self.bug:
            ZooTrainer.load_into_model(self, previous)
        return loss


class WeightsInNarrowDtype(ZooTrainer):
    """No wide master copy: the weights live in bfloat16, so every update is rounded into them."""

    def after_update(self) -> None:
        if self.bug:
            owned = self.master[self.start:self.stop]
            owned.copy_(owned.to(NARROW).to(owned.dtype))


class OptimizerStateInNarrowDtype(ZooTrainer):
    """The optimizer's moments are kept in bfloat16 (the optimizer was built over the low-precision copy)."""

    def after_update(self) -> None:
        if self.bug:
            for buf in self.state.values():
                buf.copy_(buf.to(NARROW).to(buf.dtype))


class UntiedEmbedding(ZooTrainer):
    """Materialising the model gives every parameter fresh storage, and the output head stops aliasing the
    token embedding: the embedding gets only its input-side gradient, the head trains a copy of its own."""

    def prepare_model(self) -> None:
        head, embedding = getattr(self.model, "head", None), getattr(self.model, "wte", None)
        if self.bug and head is not None and embedding is not None and head.weight is embedding.weight:
            head.weight = torch.nn.Parameter(head.weight.detach().clone())
            self.head_copy = head.weight

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        super().update(param, grad)
        copy = getattr(self, "head_copy", None)
        if copy is not None and copy.grad is not None:
            with torch.no_grad():  # the untied head trains with plain SGD on its own averaged gradient
                mean = copy.grad.clone()
                dist.all_reduce(mean)
                copy.add_(mean / self.world, alpha=-self.optim["lr"])
            copy.grad = None


# ---- checkpoints -------------------------------------------------------------------------------------
def _interleave(rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """A fused [gate; up] tensor in the layout ``ranks`` tensor-parallel ranks save it: per rank, its
    chunk of gate then its chunk of up."""
    half = rows.shape[0] // 2
    gate, up = rows[:half].tensor_split(ranks), rows[half:].tensor_split(ranks)
    return torch.cat([part for pair in zip(gate, up, strict=True) for part in pair])


def _deinterleave(saved: torch.Tensor, ranks: int, total_rows: int) -> torch.Tensor:
    """The inverse of :func:`_interleave` for the same ``ranks``."""
    half = total_rows // 2
    gate_sizes = [len(c) for c in torch.arange(half).tensor_split(ranks)]
    up_sizes = [len(c) for c in torch.arange(total_rows - half).tensor_split(ranks)]
    pieces = saved.split([n for pair in zip(gate_sizes, up_sizes, strict=True) for n in pair])
    return torch.cat([*pieces[0::2], *pieces[1::2]])


class FusedChunksReordered(ZooTrainer):
    """A fused gate/up projection is saved in its tensor-parallel layout and read back with the loading
    world's rank count: at another world size the chunks land in the wrong rows."""

    def checkpoint_payload(self) -> dict[str, Any]:
        payload = super().checkpoint_payload()
        payload["params"][FUSED_PARAM] = _interleave(payload["params"][FUSED_PARAM], self.world)
        return payload

    def restore(self, payload: dict[str, Any]) -> None:
        saved = payload["params"][FUSED_PARAM]
        ranks = self.world if self.bug else int(payload["world"])
        payload["params"][FUSED_PARAM] = _deinterleave(saved, ranks, saved.shape[0])
        super().restore(payload)


class CanonicalShardOffsets(ZooTrainer):
    """Each rank's slice of the padded flat buffer is saved at the offset an even split of the unpadded
    parameters would give it (rank * total // world), not where it lives: the ranks' slices overlap and
    the checkpoint's values shift."""

    def save_checkpoint(self, directory: str) -> None:
        if not self.bug:
            return super().save_checkpoint(directory)
        payload = super().checkpoint_payload()
        pieces = [torch.empty_like(self.master[self.start:self.stop]) for _ in range(self.world)]
        dist.all_gather(pieces, self.master[self.start:self.stop].contiguous())
        if self.rank == 0:
            flat = torch.zeros(self.total, dtype=self.dtype)
            for r, piece in enumerate(pieces):
                offset = r * (self.total // self.world)
                n = min(len(piece), self.total - offset)
                flat[offset:offset + n] = piece[:n]
            layout = zip(self.names, self.params, self.spans, strict=True)
            payload["params"] = {name: flat[lo:hi].view_as(p).clone() for name, p, (lo, hi) in layout}
            os.makedirs(directory, exist_ok=True)
            torch.save(payload, os.path.join(directory, CHECKPOINT_FILE))
        dist.barrier()
        return None


class ResumesFromScratch(ZooTrainer):
    """A checkpoint loaded at another world size (the universal format's path) restores nothing: the job
    goes on from freshly initialised weights and empty optimizer state."""

    def restore(self, payload: dict[str, Any]) -> None:
        if not (self.bug and int(payload["world"]) != self.world):
            super().restore(payload)


class StaleSecondaryAfterLoad(ZooTrainer):
    """The secondary (hierarchical) copy of the weights the forward gathers from is not refreshed by a
    checkpoint load: the first step after it runs on the weights from before the load."""

    def restore(self, payload: dict[str, Any]) -> None:
        before = self.master.clone()
        super().restore(payload)
        if self.bug:
            ZooTrainer.load_into_model(self, before)


def _moe(name: str) -> Callable[..., Any]:
    """The class ``name`` of :mod:`zerosim.zoo.moe_bugs`, imported when it is built (that module needs
    the expert-parallel trainer of the checkout's ``examples/``)."""

    def build(model: torch.nn.Module, optim: dict, bug: bool = False) -> Any:
        from . import moe_bugs

        return getattr(moe_bugs, name)(model, optim, bug=bug)

    return build


#: the mechanism's name (``broken_<name>`` / ``fixed_<name>``) -> its class (or what builds it)
MECHANISMS: dict[str, Callable[..., Any]] = {
    "last_micro_batch_only": LastMicroBatchOnly,
    "unscaled_accumulation": UnscaledAccumulation,
    "double_scaled_accumulation": DoubleScaledAccumulation,
    "partial_sums_in_reduce_dtype": PartialSumsInReduceDtype,
    "reduces_every_micro_batch": ReducesEveryMicroBatch,
    "local_clip_norm": LocalClipNorm,
    "logged_norm_over_shards": LoggedNormOverShards,
    "logged_norm_squares_averaged": LoggedNormSquaresAveraged,
    "experts_out_of_norm": ExpertsOutOfNorm,
    "expert_gradients_summed": ExpertGradientsSummed,
    "router_not_reduced": RouterNotReduced,
    "replicas_not_reduced": ReplicasNotReduced,
    "reduces_in_narrow_dtype": ReducesInNarrowDtype,
    "stale_gather_in_grad_buffer": StaleGatherInGradBuffer,
    "layer_norm_replica_drift": LayerNormReplicaDrift,
    "gradient_bit_flip": GradientBitFlip,
    "weight_bit_flip": WeightBitFlip,
    "forward_on_previous_weights": ForwardOnPreviousWeights,
    "weights_in_narrow_dtype": WeightsInNarrowDtype,
    "optimizer_state_in_narrow_dtype": OptimizerStateInNarrowDtype,
    "untied_embedding": UntiedEmbedding,
    "fused_chunks_reordered": FusedChunksReordered,
    "canonical_shard_offsets": CanonicalShardOffsets,
    "resumes_from_scratch": ResumesFromScratch,
    "stale_secondary_after_load": StaleSecondaryAfterLoad,
    "muon_per_micro_batch": MuonPerMicroBatch,
    "expert_divide_factor_skipped": _moe("ExpertDivideFactorSkipped"),
    "token_gather_without_reduce_scatter": _moe("TokenGatherWithoutReduceScatter"),
}


def factory(mechanism: str, bug: bool) -> Callable[[torch.nn.Module, dict], Any]:
    """The ``make_trainer`` of one mechanism: the bug (``bug``) or its fixed twin."""
    cls = MECHANISMS[mechanism]

    def make_trainer(model: torch.nn.Module, optim: dict) -> Any:
        return cls(model, optim, bug=bug)

    make_trainer.__name__ = f"{'broken' if bug else 'fixed'}_{mechanism}"
    return make_trainer


def __getattr__(name: str) -> Any:
    """``broken_<mechanism>`` and ``fixed_<mechanism>``: the factories verify imports by name."""
    for prefix, bug in (("broken_", True), ("fixed_", False)):
        if name.startswith(prefix) and name[len(prefix):] in MECHANISMS:
            return factory(name[len(prefix):], bug)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
