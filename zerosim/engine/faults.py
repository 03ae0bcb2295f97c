"""Deliberately broken engine variants: each reproduces one bug class real systems shipped.

A contract that cannot fail is a defect, so every step contract has a test where one of these makes
it fail with a useful diagnostic. They are also a demo: ``zerosim simulate --fault local-norm-clip``
shows what the contracts report. Each variant overrides one hook of :class:`ZeroEngine`; the bug
classes are numbered as in REFERENCES.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..observe import Holding
from ..strategy import ShardingStrategy, StrategyKind
from .flat_buffers import FlatUnit
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


@dataclass(frozen=True)
class Fault:
    name: str
    engine: type[ZeroEngine]
    description: str
    applies: Callable[[ShardingStrategy, int], bool]
    catches: tuple[str, ...]  # contracts expected to fail


def _any(s: ShardingStrategy, n: int) -> bool:
    return n > 1


def _hybrid(s: ShardingStrategy, n: int) -> bool:
    return s.is_hybrid and n // (s.intra_node_size or n) > 1


def _sharded_grads(s: ShardingStrategy, n: int) -> bool:
    return s.shards_grads and n > 1


def _gathers(s: ShardingStrategy, n: int) -> bool:
    return s.kind is not StrategyKind.NO_SHARD and n > 1


def _zero3(s: ShardingStrategy, n: int) -> bool:
    return s.shards_params


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("sum-instead-of-avg", SumInsteadOfAvg, "gradients summed, not averaged (bug class 1)", _any, ("C-ZERO-002",)),
    Fault("no-accum-average", NoAccumulationAverage, "micro-batch accumulation not divided by M (bug class 2)",
          lambda s, n: True, ("C-ZERO-002",)),
    Fault("local-norm-clip", LocalNormClip, "clip with the rank-local norm (bug class 3)", _sharded_grads, ("C-ZERO-002",)),
    Fault("norm-over-replicas", NormOverReplicas, "hybrid norm summed over replicas (bug class 4)", _hybrid,
          ("C-ZERO-002",)),
    Fault("skip-replicate-allreduce", SkipReplicateAllReduce, "hybrid without the replicate all-reduce (bug class 5)",
          _hybrid, ("C-ZERO-002", "C-ZERO-003", "C-ZERO-005")),
    Fault("stale-params", StaleParams, "rank 1 computes with stale parameters (bug class 7)", _gathers,
          ("C-ZERO-002", "C-ZERO-003")),
    Fault("keep-gathered", KeepGathered, "ZeRO-3 never frees gathered blocks", _zero3, ("C-ZERO-004",)),
    Fault("hidden-full-copy", HiddenFullCopy, "rank 0 keeps a full fp32 copy", lambda s, n: s.shards_optimizer,
          ("C-ZERO-004",)),
    Fault("extra-all-gather", ExtraAllGather, "one all-gather too many per step", _gathers, ("C-ZERO-005",)),
    Fault("padding-leak", PaddingLeak, "gradient padding filled with ones (bug class 8)",
          lambda s, n: s.shards_grads, ("C-ZERO-002",)),
)}


def engine_class(fault: str | None) -> type[ZeroEngine]:
    """The engine class for a run: the reference engine, or a broken variant by name."""
    return ZeroEngine if fault is None else FAULTS[fault].engine
