"""Deliberately broken ZeRO-1 trainers: each one real-world bug that ``zerosim verify`` must catch.

Every class changes one method of the correct example (``examples/zero1_trainer.py``), or, for the
resume bug, of zerogpu's ZeroTrainer (the example cannot save or load), and every
factory below builds one of them: ``zerosim verify tests.verify_trainers.broken:summed_gradient``.
The docstrings name the bug each mirrors; ``tests/test_verify_broken.py`` asserts the contract, the
first failing step, the rank / tensor / element range and the bug class the harness reports.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from examples.zero1_trainer import Zero1Trainer
from zerogpu.trainer import ZeroTrainer

BROKEN_RANK = 1  # the rank that misbehaves in the single-rank bugs
STOPS_AFTER_STEPS = 2  # the stopping rank's last real update, counted within one optimizer phase
STOPS_LATE_AFTER_STEPS = 4  # the late variant: rank 1 stops from the 5th step of each phase
OVERLAP_ELEMENTS = 7  # how far rank 0 reaches into rank 1's slice


class SummedGradient(Zero1Trainer):
    """All-reduce with SUM and no division by the world size: every SGD update is world times too big.

    The classic hand-written data-parallel bug (and DeepSpeed's ``gradient_predivide_factor``
    misused); Adam normalises it away, which is why the suite runs an SGD phase."""

    def mean_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flat_grad)
        return flat_grad


class LocalClipNorm(Zero1Trainer):
    """The clip norm is taken over this rank's gradient shard only, not over the whole gradient.

    What ``torch.nn.utils.clip_grad_norm_`` does when called on sharded gradients (FSDP1 users had
    to call ``model.clip_grad_norm_`` instead): each rank scales by a different, too small norm."""

    def clip_coefficient(self, grad_shard: torch.Tensor) -> float:
        local_norm = float((grad_shard * grad_shard).sum().sqrt())
        return min(self.optim["max_grad_norm"] / (local_norm + 1e-6), 1.0)


class UnownedRemainder(Zero1Trainer):
    """Slices of ``total // world`` elements: the last ``total % world`` elements have no owner.

    An integer division without the remainder (what the seed's "last shard absorbs the remainder"
    comment promised but the code never did): those elements are never updated."""

    def owned_range(self) -> tuple[int, int]:
        base = self.total // self.world
        return self.rank * base, (self.rank + 1) * base

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        gathered = super().all_gather(shard)
        padding = torch.zeros(self.shard_size * self.world - gathered.numel(), dtype=shard.dtype,
                              device=shard.device)
        return torch.cat([gathered, padding])

    def copy_into_parameters(self, flat_param: torch.Tensor) -> None:
        owned = (self.total // self.world) * self.world
        flat_param[owned:] = self.flat(list(self.params))[owned:]  # nobody updated these: keep them
        super().copy_into_parameters(flat_param)


class OverlappingShards(Zero1Trainer):
    """Rank 0's slice runs into rank 1's: two ranks hold optimizer state for the same elements.

    An off-by-some end index in a partitioner. Both ranks compute the same update for the shared
    elements and the all-gather keeps rank 1's, so the values stay right: only ``local_shards``
    shows the double ownership (memory spent twice, and state that would drift under a
    non-deterministic reduction)."""

    def owned_range(self) -> tuple[int, int]:
        start, stop = super().owned_range()
        if self.rank == 0:
            stop = min(stop + OVERLAP_ELEMENTS, self.shard_size * self.world)
        return start, stop

    def clip_coefficient(self, grad_shard: torch.Tensor) -> float:
        return super().clip_coefficient(grad_shard[:self.shard_size])

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        return super().all_gather(shard[:self.shard_size])


class RankStopsUpdating(Zero1Trainer):
    """Rank 1 skips its optimizer step after a few steps (a rank that took an early-exit path,
    e.g. a skipped step on a local overflow flag that the other ranks never saw)."""

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.rank == BROKEN_RANK and self.steps_taken > STOPS_AFTER_STEPS:
            return
        super().update(param, grad)


class WrongGatherOrder(Zero1Trainer):
    """The all-gathered slices are concatenated in reverse rank order (a rank list built backwards,
    or a ring all-gather whose output is not rotated back): right values, wrong places."""

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(shard) for _ in range(self.world)]
        dist.all_gather(pieces, shard.contiguous())
        return torch.cat(pieces[::-1])


class StaleParameters(Zero1Trainer):
    """Rank 1 all-gathers the new slices but never copies them into its parameters (the gather went
    into a buffer that is no longer the parameters' storage): it keeps training on stale weights."""

    def copy_into_parameters(self, flat_param: torch.Tensor) -> None:
        if self.rank != BROKEN_RANK:
            super().copy_into_parameters(flat_param)


class DoubleWeightDecay(Zero1Trainer):
    """Weight decay applied twice: once by hand before the optimizer, once inside it (a trainer that
    adds L2 to the loss or the gradient and also passes ``weight_decay`` to the optimizer)."""

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        wd = self.optim.get("weight_decay", 0.0)
        if self.optim["name"] == "sgd":
            grad = grad.add(param, alpha=wd)
        else:
            param.mul_(1 - self.optim["lr"] * wd)
        super().update(param, grad)


class AdamStepOffByOne(Zero1Trainer):
    """Adam's step counter starts at 1 instead of 0, so the first bias correction uses t = 2
    (a counter restored from a checkpoint and incremented again, or incremented before use twice)."""

    def __init__(self, model: torch.nn.Module, optim: dict):
        super().__init__(model, optim)
        if optim["name"] == "adamw":
            self.steps_taken = 1


class GradientsNeverZeroed(Zero1Trainer):
    """``.grad`` is never reset, so every backward adds to the previous gradients: step 1 is right,
    every later step uses the running sum (a missing ``zero_grad`` / ``set_to_none``)."""

    def zero_gradients(self) -> None:
        return None


class HybridZero1(Zero1Trainer):
    """ZeRO-1 on a 2-D layout: shard groups of ``shard_group_size`` consecutive ranks, replicas across
    them (ranks r and r + shard_group_size own the same slice). Correct: the gradient is averaged over
    the whole world, the clip norm summed within one shard group, the slices gathered within it."""

    def __init__(self, model: torch.nn.Module, optim: dict, shard_group_size: int = 2):
        super().__init__(model, optim)
        if self.world % shard_group_size:
            raise ValueError(f"world {self.world} is not a multiple of shard_group_size {shard_group_size}")
        self.group_size = shard_group_size
        groups = [dist.new_group(list(range(first, first + shard_group_size)))
                  for first in range(0, self.world, shard_group_size)]  # every rank creates every group
        self.shard_group = groups[self.rank // shard_group_size]
        self.shard_size = math.ceil(self.total / shard_group_size)
        self.start, self.stop = self.owned_range()
        self.state = {key: torch.zeros(self.stop - self.start, dtype=buf.dtype, device=buf.device)
                      for key, buf in self.state.items()}

    def owned_range(self) -> tuple[int, int]:
        if not hasattr(self, "group_size"):  # the base class's first call, before the groups exist
            return super().owned_range()
        index = self.rank % self.group_size
        return index * self.shard_size, (index + 1) * self.shard_size

    def clip_coefficient(self, grad_shard: torch.Tensor) -> float:
        square_sum = (grad_shard * grad_shard).sum().reshape(1)
        dist.all_reduce(square_sum, group=self.shard_group)
        return min(self.optim["max_grad_norm"] / (float(square_sum.sqrt()) + 1e-6), 1.0)

    def all_gather(self, shard: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(shard) for _ in range(self.group_size)]
        dist.all_gather(pieces, shard.contiguous(), group=self.shard_group)
        return torch.cat(pieces)


class HybridReplicasDrift(HybridZero1):
    """The replicate all-reduce is skipped: the gradient is averaged within each shard group only,
    so each replica trains on its own half of the batch and the replicas drift apart (an HSDP
    setup whose replicate process group was never passed to the reduction)."""

    def mean_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(flat_grad, group=self.shard_group)
        return flat_grad / self.group_size


class ReducesInFloat32(Zero1Trainer):
    """The gradient is all-reduced in float32 whatever the model's dtype, then cast back: half the bytes
    on the wire, and every reduction rounded to float32 while the weights stay float64.

    A reduction in another dtype than the one the run's policy names (DeepSpeed PR #5170 all-reduced the
    bf16 gradients instead of the fp32 buffer; a mixed-precision policy's ``reduce_dtype`` ignored). It
    declares its strategy, so verify counts its traffic and sees the dtype of every collective."""

    declared_strategy = "zero1"

    def mean_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        reduced = flat_grad.to(torch.float32)
        dist.all_reduce(reduced)
        return (reduced / self.world).to(flat_grad.dtype)


class RankStopsUpdatingLate(RankStopsUpdating):
    """Rank 1 stops updating from the 5th step of each phase: invisible in 4-step phases, caught under
    the default 12 steps per phase."""

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        if self.rank == BROKEN_RANK and self.steps_taken > STOPS_LATE_AFTER_STEPS:
            return
        Zero1Trainer.update(self, param, grad)


class NeverClips(Zero1Trainer):
    """``max_grad_norm`` is accepted and ignored: the update always uses the unclipped gradient."""

    def clip_coefficient(self, grad_shard: torch.Tensor) -> float:
        return 1.0


def _mesh_shard_size(optim: dict) -> int:
    mesh = optim.get("mesh")
    if mesh is None:
        raise ValueError("this trainer needs --mesh RxS (optim['mesh'])")
    return int(mesh[1])


class HybridSkipsReplicaReduce(HybridZero1):
    """HSDP on ``optim["mesh"]`` whose step reduces the gradient within the shard group only: on an
    (n, 1) mesh the shard group is one rank, so no gradient is reduced at all and every rank trains on
    its own micro-batch (pytorch #154888: FSDP HYBRID_SHARD on an (n, 1) mesh drops the cross-replica
    all-reduce)."""

    def mean_gradient(self, flat_grad: torch.Tensor) -> torch.Tensor:
        if self.group_size > 1:
            dist.all_reduce(flat_grad, group=self.shard_group)
        return flat_grad / self.group_size


def hybrid_mesh_zero1(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """The correct hybrid ZeRO-1 on ``optim["mesh"]`` (the baseline of the next one)."""
    return HybridZero1(model, optim, shard_group_size=_mesh_shard_size(optim))


def hybrid_skips_replica_reduce(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return HybridSkipsReplicaReduce(model, optim, shard_group_size=_mesh_shard_size(optim))


def rank_stops_updating_late(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return RankStopsUpdatingLate(model, optim)


def never_clips(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return NeverClips(model, optim)


def summed_gradient(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return SummedGradient(model, optim)


def local_clip_norm(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return LocalClipNorm(model, optim)


def unowned_remainder(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return UnownedRemainder(model, optim)


def overlapping_shards(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return OverlappingShards(model, optim)


def rank_stops_updating(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return RankStopsUpdating(model, optim)


def wrong_gather_order(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return WrongGatherOrder(model, optim)


def stale_parameters(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return StaleParameters(model, optim)


def double_weight_decay(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return DoubleWeightDecay(model, optim)


def adam_step_off_by_one(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return AdamStepOffByOne(model, optim)


def gradients_never_zeroed(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return GradientsNeverZeroed(model, optim)


def hybrid_zero1(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """The correct 2x2 hybrid (passes at world 4): the baseline of ``hybrid_replicas_drift``."""
    return HybridZero1(model, optim)


def hybrid_replicas_drift(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return HybridReplicasDrift(model, optim)


class OptimizerStateDroppedOnLoad(ZeroTrainer):
    """``load_checkpoint`` restores the weights but leaves the optimizer as freshly built: momentum and
    Adam's moments zero, the step counter back at 0.

    The resume bug of a checkpoint that holds only the model's state dict (or a loader that builds
    the optimizer after loading and never loads its state): training goes on from the right weights,
    so the loss looks fine, but every update after the resume is wrong. Only a resume shows it."""

    def __init__(self, model: torch.nn.Module, optim: dict):
        super().__init__(model, optim, "zero1")

    def load_checkpoint(self, directory: object, *, strict: bool = True) -> object:
        result = super().load_checkpoint(directory, strict=strict)
        for name in self.state.run.spec.state_names:
            self.state.opt_state[name].zero_()
        self.state.opt_state["step"] = 0
        self._steps = 0
        return result


def reduces_in_float32(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return ReducesInFloat32(model, optim)


def optimizer_state_dropped_on_load(model: torch.nn.Module, optim: dict) -> ZeroTrainer:
    """Runs correctly until resumed (``zerosim verify ... --resume-at K``): not in MUTANTS below, whose
    runs never resume."""
    return OptimizerStateDroppedOnLoad(model, optim)


#: every broken trainer above with the world size it runs at (``zerosim mutants --trainers``)
MUTANTS = {
    "summed_gradient": 2, "local_clip_norm": 2, "unowned_remainder": 2, "overlapping_shards": 2,
    "rank_stops_updating": 2, "wrong_gather_order": 2, "stale_parameters": 2, "double_weight_decay": 2,
    "adam_step_off_by_one": 2, "gradients_never_zeroed": 2, "hybrid_replicas_drift": 4,
}


def loss_scale_restarts_on_load(model: torch.nn.Module, optim: dict):
    """The torch-zero adapter whose load_checkpoint restores masters and optimizer state but starts the
    fp16 loss scale over at its initial value (the scaler's state is not carried across a resume)."""
    from zerosim.verify.adapters.torch_zero import make_trainer

    trainer = make_trainer(model, optim)
    load = trainer.load_checkpoint

    def load_without_scale(directory):
        load(directory)
        if trainer.loss_scale is not None:
            trainer.loss_scale.scale = float(optim["mixed_precision"]["loss_scale"]["init"])
            trainer.loss_scale.growth_tracker = 0

    trainer.load_checkpoint = load_without_scale
    return trainer
