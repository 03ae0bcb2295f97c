"""The catalogue of deliberately broken engine variants: names, what each breaks, which contracts catch it.

Plain data, so a run configuration can validate ``--fault NAME`` without importing the engine; the
variants themselves (one :class:`~zerosim.engine.zero.ZeroEngine` subclass each) are in
:mod:`zerosim.engine.faults`, looked up by the class name each entry gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..strategy import ShardingStrategy, StrategyKind


@dataclass(frozen=True)
class Fault:
    name: str
    engine: str  # the ZeroEngine subclass in zerosim.engine.faults that has this bug
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


FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        Fault(
            "sum-instead-of-avg",
            "SumInsteadOfAvg",
            "gradients summed, not averaged (bug class 1)",
            _any,
            ("C-ZERO-002",),
        ),
        Fault(
            "no-accum-average",
            "NoAccumulationAverage",
            "micro-batch accumulation not divided by M (bug class 2)",
            lambda s, n: True,
            ("C-ZERO-002",),
        ),
        Fault(
            "local-norm-clip",
            "LocalNormClip",
            "clip with the rank-local norm (bug class 3)",
            _sharded_grads,
            ("C-ZERO-002",),
        ),
        Fault(
            "norm-over-replicas",
            "NormOverReplicas",
            "hybrid norm summed over replicas (bug class 4)",
            _hybrid,
            ("C-ZERO-002",),
        ),
        Fault(
            "skip-replicate-allreduce",
            "SkipReplicateAllReduce",
            "hybrid without the replicate all-reduce (bug class 5)",
            _hybrid,
            ("C-ZERO-002", "C-ZERO-003", "C-ZERO-005"),
        ),
        Fault(
            "stale-params",
            "StaleParams",
            "rank 1 computes with stale parameters (bug class 7)",
            _gathers,
            ("C-ZERO-002", "C-ZERO-003"),
        ),
        Fault("keep-gathered", "KeepGathered", "ZeRO-3 never frees gathered blocks", _zero3, ("C-ZERO-004",)),
        Fault(
            "hidden-full-copy",
            "HiddenFullCopy",
            "rank 0 keeps a full fp32 copy",
            lambda s, n: s.shards_optimizer,
            ("C-ZERO-004",),
        ),
        Fault(
            "extra-all-gather",
            "ExtraAllGather",
            "one all-gather too many per step",
            _gathers,
            ("C-ZERO-005",),
        ),
        Fault(
            "padding-leak",
            "PaddingLeak",
            "gradient padding filled with ones (bug class 8)",
            lambda s, n: s.shards_grads,
            ("C-ZERO-002",),
        ),
    )
}
