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
from ..layout import ParamLayout
from ..strategy import ShardingStrategy, Topology
from .memory_model import MemoryEstimate, MemorySettings, memory_per_rank


@dataclass(frozen=True)
class TimelinePoint:
    index: int
    phase: str          # "start" | "forward" | "backward" | "reduce" | "step"
    event: str          # e.g. "forward blocks.3"
    device: int         # bytes on the device after the event
    host: int           # bytes in host memory after the event

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "phase": self.phase, "event": self.event, "device": self.device, "host": self.host}


def modelled_step_timeline(
    layout: ParamLayout,
    strategy: ShardingStrategy | str,
    topology: Topology | int,
    settings: MemorySettings | None = None,
    micro_batches: int = 1,
    partitioner: str | None = None,
) -> tuple[MemoryEstimate, list[TimelinePoint]]:
    """Device/host bytes of the worst rank after each event of one step (model, not a measurement)."""
    if not isinstance(layout, ParamLayout):
        raise ConfigError("layout", type(layout).__name__, "the step timeline needs a layout with blocks")
    require_positive_int("micro_batches", micro_batches)
    settings = settings or MemorySettings()
    est = memory_per_rank(layout, strategy, topology, settings, partitioner)
    strat, k = est.strategy, est.shard_group_size
    pb, gb = settings.spec.param_bytes, settings.spec.grad_bytes
    base = est.per_rank.total
    blocks = [(b.name, -(-layout.block_numel(b) // k) * k) for b in layout.blocks]
    n, depth = len(blocks), settings.prefetch_depth
    points: list[TimelinePoint] = []

    def add(phase: str, event: str, extra: int) -> None:
        points.append(TimelinePoint(len(points), phase, event, base.device + extra, base.host))

    add("start", "step begins (persistent model states)", 0)
    for mb in range(micro_batches):
        tag = f" (micro-batch {mb})" if micro_batches > 1 else ""
        if strat.shards_params:
            for j, (name, _) in enumerate(blocks):
                live = sum(g for _, g in blocks[j:min(j + depth, n - 1) + 1])
                add("forward", f"forward {name}{tag}", pb * live)
            for j in range(n - 1, -1, -1):
                name, g = blocks[j]
                live = sum(g2 for _, g2 in blocks[max(j - depth, 0):j + 1])
                add("backward", f"backward {name}{tag}", pb * live + gb * g)
                add("reduce", f"reduce_scatter grads of {name}{tag}", 0)
        else:
            add("forward", f"forward{tag}", 0)
            if strat.shards_grads:
                add("backward", f"backward: unsharded flat grad{tag}", est.per_rank.transient["unsharded_grads"])
                add("reduce", f"reduce_scatter flat grad{tag}", 0)
            else:
                add("backward", f"backward (grads accumulate in place){tag}", 0)
    add("step", "optimizer step" + (" on host" if "optimizer_states" in settings.offloaded else ""), 0)
    return est, points
