"""In-process rank-0 loads on the simulator, and the C-ZERO-006 check of what every rank kept.

:func:`load_on_ranks` builds the engines of a run (``zerosim.comm.sim.run_spmd``), has rank 0 load a
full state dict and broadcast it (:func:`zerosim.checkpoint.broadcast.broadcast_and_shard_state_dict`)
and returns what each rank holds afterwards; :func:`check_load` turns that into C-ZERO-006's verdict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.broadcast import BroadcastLoadResult, broadcast_and_shard_state_dict
from ..checks.judges import judge
from ..comm.sim import run_spmd
from ..engine.config import ResolvedRun, RunConfig
from ..engine.fault_catalog import engine_fault
from ..engine.faults import EngineFault
from ..engine.observation import full_params_view
from ..engine.rank_state import RankState
from ..numerics.xp import numpy_namespace
from ..values.layout import ParamLayout
from ..values.observe import ShardValues
from ..values.verdict import Verdict


@dataclass
class RankLoad:
    """One rank after a rank-0 load: its master shard with its pieces, its full working parameters
    (gathered the way the forward would see them) and what the load did."""

    rank: int
    shard: ShardValues
    params: np.ndarray
    result: BroadcastLoadResult


def random_state_dict(layout: ParamLayout, seed: int = 7) -> dict[str, np.ndarray]:
    """A full state dict for ``layout`` (one array per tensor, in its dtype) unlike any seed's weights."""
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32).astype(_np_dtype(t.dtype))
            for t in layout.tensors}


def _np_dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def full_flat(layout: ParamLayout, state: Mapping[str, Any], dtype: str = "float32") -> np.ndarray:
    """The state dict as one flat array in layout order and ``dtype`` (tied weights: the tensor's own name
    or its first alias present)."""
    by_target: dict[str, str] = {}
    for alias, target in layout.aliases.items():
        by_target.setdefault(target, alias)
    parts = []
    for t in layout.tensors:
        key = t.name if t.name in state else by_target.get(t.name, t.name)
        parts.append(np.asarray(state[key]).astype(dtype).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def load_on_ranks(
    cfg: RunConfig | ResolvedRun,
    state: Mapping[str, Any] | str,
    *,
    strict: bool = True,
    bucket_bytes: int = 0,
    engine_cls: type[RankState] = RankState,
    fault: EngineFault | None = None,
    other_source: Any = None,
) -> list[RankLoad]:
    """Fresh engines for ``cfg``; rank 0 loads ``state`` (a mapping or a file path), every other rank
    passes ``other_source``; per rank what it holds afterwards. The engines are handed ``fault``, or
    the run's catalogued fault when none is given."""
    run = cfg if isinstance(cfg, ResolvedRun) else cfg.resolve()
    fault = fault if fault is not None else engine_fault(run)

    def program(comm: Any) -> RankLoad:
        engine = engine_cls(comm, run, numpy_namespace(), fault=fault)
        source = state if comm.rank == 0 else other_source
        result = broadcast_and_shard_state_dict(engine, source, strict=strict, bucket_bytes=bucket_bytes)
        shard = ShardValues(tuple(engine.owned_pieces), engine.xp.to_numpy(engine.master, copy=True))
        return RankLoad(comm.rank, shard, full_params_view(engine), result)

    return run_spmd(run.world_size, program, timeout_s=run.cfg.timeout_s)


def plan_pieces(run: ResolvedRun) -> dict[int, tuple[tuple[int, int, int], ...]]:
    """What the plan gives each world rank of ``run``: its shard group rank's pieces, or everything."""
    k, total = run.k, run.layout.total_numel
    if not run.strategy.shards_optimizer:
        return {r: ((0, total, 0),) for r in range(run.world_size)}
    return {r: tuple(run.unit_plan.owned_global(r % k)) for r in range(run.world_size)}


def check_load(run: ResolvedRun, state: Mapping[str, Any], loads: list[RankLoad],
               context: dict[str, Any] | None = None) -> Verdict:
    """C-ZERO-006 on the ranks of ``run`` after loading ``state``."""
    full = full_flat(run.layout, state, run.precision.master_dtype)
    return judge(
        "C-ZERO-006",
        full, run.layout, {ld.rank: ld.shard for ld in loads}, plan_pieces(run),
        {ld.rank: ld.params for ld in loads}, context,
    )
