"""Modelled device memory over one optimizer step, block by block (the schedule behind the transient).

This is a *model*, labelled as such wherever it is plotted: the persistent model states of
:func:`~zerosim.cost.memory_model.memory_per_rank` plus the buffers the engine's collective schedule
keeps alive at each point of a step (see the team's schedule: FULL_SHARD gathers a block's params
before its forward and again before its backward, frees them after, and reduce-scatters the block's
gradient right after its backward; SHARD_GRAD_OP reduce-scatters the whole flat gradient after the
backward). It serves the ZeRO-3 offload figure when no measured timeline is available, and its peak
never exceeds the closed-form ``peak_device`` (a test checks that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy, Topology
from .memory_model import MemoryEstimate, memory_per_rank
from .memory_settings import MemorySettings


@dataclass(frozen=True)
class TimelinePoint:
    index: int
    phase: str          # "start" | "forward" | "backward" | "reduce" | "step"
    event: str          # e.g. "forward blocks.3"
    device: int         # bytes on the device after the event
    host: int           # bytes in host memory after the event

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "event": self.event,
            "device": self.device,
            "host": self.host,
        }


def modelled_step_timeline(
    layout: ParamLayout,
    strategy: ShardingStrategy | str,
    topology: Topology | int,
    settings: MemorySettings | None = None,
    micro_batches: int = 1,
    partitioner: str | None = None,
    packing: str = "partitioner",
) -> tuple[MemoryEstimate, list[TimelinePoint]]:
    """Device/host bytes of the worst rank after each event of one step (model, not a measurement).

    Follows :func:`~zerosim.cost.memory_model.transient_phases` event by event; its maximum equals
    the estimate's ``peak_device``.
    """
    if not isinstance(layout, ParamLayout):
        raise ConfigError("layout", type(layout).__name__, "the step timeline needs a layout with blocks")
    require_positive_int("micro_batches", micro_batches)
    settings = settings or MemorySettings()
    est = memory_per_rank(layout, strategy, topology, settings, partitioner, packing=packing)
    strat = est.strategy
    pb, gb, d = settings.spec.param_bytes, settings.spec.grad_bytes, settings.prefetch_depth
    cls = est.per_rank
    base = cls.total
    units = est.units
    points: list[TimelinePoint] = []

    def add(phase: str, event: str, extra: int) -> None:
        points.append(TimelinePoint(len(points), phase, event, base.device + extra, base.host))

    add("start", "step begins (persistent model states)", 0)
    gathered = [u.packed_numel * pb + (u.numel * pb if u.unpack_copy else 0) for u in units]
    n = len(units)
    for mb in range(micro_batches):
        tag = f" (micro-batch {mb})" if micro_batches > 1 else ""
        if strat.shards_params:
            for j, u in enumerate(units):
                add("forward", f"forward {u.name}{tag}", sum(gathered[j:min(j + d, n - 1) + 1]))
            for j in range(n - 1, -1, -1):
                u = units[j]
                prefetched = sum(gathered[max(j - d, 0):j])
                add("backward", f"backward {u.name}{tag}", prefetched + gathered[j])
                add("backward", f"grads of {u.name} packed{tag}", prefetched + u.packed_numel * gb)
                add("reduce", f"reduce_scatter {u.name}{tag}", prefetched)
        else:
            add("forward", f"forward{tag}", 0)
            if strat.shards_grads:
                add("backward", f"backward: unsharded grads{tag}", est.total_params * pb)
                add("backward", f"packed flat grad{tag}", cls.transient["backward_end"])
                add("reduce", f"reduce_scatter flat grad{tag}", 0)
            else:
                add("backward", f"backward (grads accumulate in place){tag}", 0)
    if "reduce" in cls.transient:  # ZeRO-1, zero1_grad_reduce="reduce_scatter": packed full grad + own chunk
        add("reduce", "reduce_scatter packed grad into own chunk", cls.transient["reduce"])
    chunk = cls.transient.get("optimizer", 0)
    add("step", "optimizer step" + (" on host" if "optimizer_states" in settings.offloaded else "")
        + (" (own gradient chunk)" if chunk else ""), chunk)
    if "refresh" in cls.transient:
        add("refresh", "all_gather updated params", cls.transient["refresh"])
        add("refresh", "step ends", 0)
    return est, points
