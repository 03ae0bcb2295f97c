"""Deliberately broken engine variants: each reproduces one bug class real systems shipped.

A contract that cannot fail is a defect, so every step contract has a test where one of these makes
it fail with a useful diagnostic. They are also a demo: ``zerosim simulate --fault local-norm-clip``
shows what the contracts report. Each variant overrides one hook of :class:`ZeroEngine`; the bug
classes are numbered as in docs/references.md.
"""

from __future__ import annotations

from typing import Any

from ..flat_buffers import FlatUnit
from ..observe import Holding
from .fault_catalog import FAULTS
from .zero import ZeroEngine

FAULTY_RANK = 1  # the rank that misbehaves in single-rank faults (rank 0 when the world has one rank)


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
    SumInsteadOfAvg, NoAccumulationAverage, LocalNormClip, NormOverReplicas, SkipReplicateAllReduce,
    StaleParams, KeepGathered, HiddenFullCopy, ExtraAllGather, PaddingLeak)}


def engine_class(fault: str | None) -> type[ZeroEngine]:
    """The engine class for a run: the reference engine, or a broken variant by its catalogue name."""
    return ZeroEngine if fault is None else VARIANTS[FAULTS[fault].engine]
