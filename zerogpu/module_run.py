"""What the engine reads of a run over a torch module: :class:`ModuleRun` and the module's initial flat.

:class:`ModuleRun` gives :class:`zerosim.engine.rank_state.RankState` the fields of
:class:`zerosim.engine.engine_run.EngineRun` for a user's model (the simulator's ``ResolvedRun`` gives
them for a preset); :class:`ModuleFlat` reads the module's current parameters as the engine's flat
initial parameters, a slice at a time, so each rank copies only what it keeps (C-ZERO-004).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from zerosim.numerics.optim import OptimizerSpec
from zerosim.numerics.precision import Precision
from zerosim.values.flat_buffers import UnitPlan
from zerosim.values.layout import ParamLayout
from zerosim.values.strategy import ShardingStrategy


@dataclass(frozen=True)
class EngineOptions:
    """The run options a :class:`~zerosim.engine.rank_state.RankState` reads from ``run.cfg`` that a
    module run fixes."""

    offload: bool = False
    load: str = "seed"
    reshard_at: int | None = None


@dataclass
class ModuleRun:
    """What a :class:`~zerosim.engine.rank_state.RankState` needs of a run, for a torch module instead
    of a simulator preset."""

    layout: ParamLayout
    unit_plan: UnitPlan
    strategy: ShardingStrategy
    world_size: int
    precision: Precision
    spec: OptimizerSpec
    partitioner: str
    prefetch: int = 1
    optimizer_kernel: str = "reference"  # see zerogpu.optimizer_kernels.OPTIMIZER_KERNELS
    zero1_reduce_scatter: bool = False
    steps: int = 1
    micro_batches: int = 1
    seed: int = 0
    inject_nan: Any = None
    fault: Any = None
    model_cfg: Any = None
    observe_values: bool = False
    observe_full: bool = False
    observe_gathered: bool = False
    cfg: EngineOptions = field(default_factory=EngineOptions)

    @property
    def k(self) -> int:
        return self.strategy.shard_group_size(self.world_size)

    @property
    def replicas(self) -> int:
        return self.world_size // self.k


class ModuleFlat:
    """A module's parameters seen as one flat host array (read-only): ``flat[a:b]`` copies just the
    elements ``[a, b)`` out of the tensors they lie in; ``numpy.asarray(flat)`` builds the whole."""

    def __init__(self, tensors: list[torch.Tensor], offsets: tuple[int, ...], total: int, dtype: torch.dtype):
        self.tensors, self.offsets, self.total, self.dtype = tensors, offsets, total, dtype
        self.shape = (total,)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self.total)
        if step != 1:
            raise IndexError("ModuleFlat supports contiguous slices only")
        parts = []
        for t, off in zip(self.tensors, self.offsets, strict=True):
            lo, hi = max(start, off), min(stop, off + t.numel())
            if lo < hi:
                parts.append(t.detach().reshape(-1)[lo - off:hi - off].to(device="cpu", dtype=self.dtype))
        if not parts:
            return torch.zeros(0, dtype=self.dtype).numpy()
        return torch.cat(parts).numpy()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        full = self[0:self.total]
        return full if dtype is None else full.astype(dtype)
