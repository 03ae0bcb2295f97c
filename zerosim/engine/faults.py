"""Deliberately broken engine variants: each reproduces one bug class real systems shipped.

A contract that cannot fail is a defect, so every step contract has a test where one of these makes
it fail with a useful diagnostic. They are also a demo: ``zerosim simulate --fault local-norm-clip``
shows what the contracts report, and ``zerosim mutants`` runs them all. Each variant overrides one
hook of :class:`ZeroEngine`; the catalogue (:mod:`zerosim.engine.fault_catalog`) says where each acts
and what it touches. Partitioner faults need no variant: the run's partition rule is mutated instead
(:mod:`zerosim.partition.mutations`). Bug classes are numbered as in docs/references.md.
"""

from __future__ import annotations

from typing import Any

from ..flat_buffers import FlatUnit
from ..observe import Holding
from .fault_catalog import FAULTS, FAULTY_RANK
from .zero import ZeroEngine


def _faulty_rank(engine: ZeroEngine) -> int:
    return min(FAULTY_RANK, engine.comm.world_size - 1)


class SumInsteadOfAvg(ZeroEngine):
    """Bug class 1: gradients summed across ranks instead of averaged (DeepSpeed #6545)."""

    def grad_reduce_op(self) -> str:
        return "sum"


class NoAccumulationAverage(ZeroEngine):
    """Bug class 2: gradients accumulated over micro-batches but never divided by M (DeepSpeed #1488)."""

    def finish_accumulation(self, acc: Any) -> None:
        return None


class LocalNormClip(ZeroEngine):
    """Bug class 3: clipping with the rank-local norm of the shard instead of the global norm."""

    def global_sumsq(self, local: float) -> float:
        return local


class NormOverReplicas(ZeroEngine):
    """Bug class 4: hybrid grad norm summed over the whole world, counting every replica again."""

    def global_sumsq(self, local: float) -> float:
        x = self.xp.asarray([local], dtype=self.xp.dtype("float64"), device=self.xp.device)
        return self.xp.to_float(self.control.all_reduce(x, "sum")[0])


class WrongGroupDivisor(ZeroEngine):
    """Bug class 1, hybrid form: the gradient is averaged over the shard group, then summed (not
    averaged) over the replicate group: divided by the shard group size instead of the world size."""

    def replicate_reduce(self, acc: Any) -> Any:
        assert self.replicate_comm is not None
        return self.replicate_comm.all_reduce(acc, "sum")


class SkipReplicateAllReduce(ZeroEngine):
    """Bug class 5: hybrid sharding that never all-reduces across the replicate group (PyTorch #154888)."""

    def replicate_reduce(self, acc: Any) -> Any:
        return acc


class StaleParams(ZeroEngine):
    """Bug class 7: one rank keeps computing with parameters from before an update (PyTorch #117421).

    ZeRO-1/2: rank 1 ignores the post-step all-gather. ZeRO-3: rank 1 takes part in every all-gather
    but keeps using the blocks it gathered in step 0."""

    def write_gathered_params(self, gathered: Any, unit: FlatUnit) -> None:
        if self.rank != _faulty_rank(self):
            super().write_gathered_params(gathered, unit)

    def use_gathered(self, block: str, views: dict[str, Any], step: int) -> dict[str, Any]:
        if self.rank != _faulty_rank(self):
            return views
        stale = self.__dict__.setdefault("_stale", {})
        if block not in stale:
            stale[block] = {k: self.xp.copy(v) for k, v in views.items()}
        return stale[block]


class PartialAllGather(ZeroEngine):
    """Bug class 7, partial form: the post-step all-gather (ZeRO-1/2) is written back for every rank's
    chunk but the last one's, so that range keeps its values from before the step on every rank."""

    def write_gathered_params(self, gathered: Any, unit: FlatUnit) -> None:
        for segs in unit.segments[:-1]:
            for s in segs:
                self.xp.assign(self.params_full[s.unit_start:s.unit_start + s.length],
                               gathered[s.packed_start:s.packed_start + s.length])


class OffloadCopyBackSkipped(ZeroEngine):
    """ZeRO-3 CPU offload: rank 1 steps its host master but never copies the updated shard back to
    the device, so every rank gathers rank 1's old values (C-ZERO-003 names the range)."""

    def refresh_params(self) -> None:
        if self.rank != _faulty_rank(self):
            super().refresh_params()
        else:  # the copy is accounted for as if it happened: only its effect is missing
            self._moved["host_to_device"] += self.xp.nbytes(self.param_shard)


class StepCounterDrift(ZeroEngine):
    """Per-shard optimizer step counters drift: rank 1's advances twice on the first step, so its
    shard's bias correction (Adam) is computed for the wrong step from then on."""

    def optimizer_step(self, grad: Any) -> None:
        super().optimizer_step(grad)
        if self.rank == _faulty_rank(self) and self.opt_state["step"] == 1:
            self.opt_state["step"] += 1


class LoadBroadcastMissesGroup(ZeroEngine):
    """Rank-0 load whose broadcast goes over rank 0's shard group only: every other replica group
    broadcasts from its own first rank, which loaded nothing (zeros)."""

    def load_comm(self) -> Any:
        return self.shard_comm if self.shard_comm is not None else self.comm


class ReshardWrongOrder(ZeroEngine):
    """Full-state-dict round trip that assembles the all-gathered shards in reverse rank order: every
    rank reloads the shard of its mirror rank."""

    def gathered_chunk_index(self, local_rank: int) -> int:
        return self.k - 1 - local_rank


class KeepGathered(ZeroEngine):
    """ZeRO-3 memory bug: gathered blocks are never freed (a hidden full copy builds up on every rank)."""

    def release(self, block: str) -> None:
        item = self._gathered.pop(block, None)
        if item is None:
            return
        leaked = self.__dict__.setdefault("_leaked", [])
        leaked.append(item)
        nbytes = self.tracker.live_keys("gathered")[f"gathered:{block}"][2]
        self.tracker.free(f"gathered:{block}")
        self.tracker.alloc(f"leaked:{block}:{len(leaked)}", "gathered", nbytes)


class HiddenFullCopy(ZeroEngine):
    """Ownership bug: rank 0 keeps a full float32 copy of the model next to its optimizer shard."""

    def _track_state(self) -> None:
        super()._track_state()
        if self.rank == 0:
            self._hidden = self.xp.zeros(self.total, "float32")
            self.tracker.alloc("hidden", "optimizer", self.xp.nbytes(self._hidden))

    def holdings(self) -> dict[str, Holding]:
        h = super().holdings()
        if self.rank == 0:
            o = h["optimizer"]
            h["optimizer"] = Holding("optimizer", ((0, self.total),), o.stored_numel + self.total,
                                     o.nbytes + self.xp.nbytes(self._hidden), o.dtype, o.location)
        return h


class ExtraAllGather(ZeroEngine):
    """Communication bug: one all-gather of the parameter shards too many per step."""

    def extra_step_collectives(self, step: int) -> None:
        assert self.shard_comm is not None
        self.shard_comm.all_gather(self.master)


class PaddingLeak(ZeroEngine):
    """Bug class 8: padding of the packed gradient filled with ones, so it leaks into the state."""

    def pad_value(self) -> float:
        return 1.0


#: every variant by class name (the catalogue in :mod:`zerosim.engine.fault_catalog` names them)
VARIANTS: dict[str, type[ZeroEngine]] = {cls.__name__: cls for cls in (
    SumInsteadOfAvg, WrongGroupDivisor, NoAccumulationAverage, LocalNormClip, NormOverReplicas,
    SkipReplicateAllReduce, StaleParams, PartialAllGather, OffloadCopyBackSkipped, KeepGathered,
    HiddenFullCopy, ExtraAllGather, PaddingLeak, StepCounterDrift, LoadBroadcastMissesGroup,
    ReshardWrongOrder)}


def engine_class(fault: str | None) -> type[ZeroEngine]:
    """The engine class for a run: the reference engine, or a broken variant by its catalogue name
    (a partitioner fault runs the reference engine on the mutated plan)."""
    if fault is None or FAULTS[fault].where == "partitioner":
        return ZeroEngine
    return VARIANTS[FAULTS[fault].implementation]
