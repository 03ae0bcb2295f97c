"""C-ZERO-004 on a live trainer: the resident bytes each rank keeps lie within the declared strategy's plan.

A pure function of observation values: per rank, the bytes of parameters, gradients and optimizer state
the trainer really keeps (``zerosim verify`` reads them from tensor storages), and the plan of the
declared strategy, built from the memory model's shard sizes
(:func:`zerosim.cost.shard_sizes.shard_sizes`) under the trainer's own partition rule, so padding counts
as the trainer stores it. The contract is an upper bound per rank and per kind of state: a rank that
keeps more than its plan (a hidden full copy, a strategy declared smaller than what runs) fails, naming
rank and kind (clause ``bytes``). Holding less than the plan is not a violation: FSDP2 with
``reshard_after_forward=False`` (declared ZeRO-2) still frees its unsharded parameters after backward;
the verdict's details carry both figures per rank.

The engine's own runs are judged on exact intervals by :func:`zerosim.checks.step.check_holdings`; this
check is the same contract where only byte counts can be observed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..cost.memory_settings import OPTIMIZER_STATES
from ..cost.shard_sizes import shard_sizes
from ..errors import ConfigError
from ..layout import ParamLayout
from ..strategy import ShardingStrategy
from ..verdict import Verdict
from .collect import ViolationCollector

CONTRACT = "C-ZERO-004"
MEMORY_KINDS = ("params", "grads", "optimizer")


def strategy_from_declared(declared: str) -> ShardingStrategy:
    """``"ddp"`` | ``"zero1"`` | ``"zero2"`` | ``"zero3"`` | ``"hybrid:<shard group size>"`` -> strategy."""
    text = str(declared).strip().lower()
    if text.startswith("hybrid:"):
        text = "hybrid_shard:" + text.split(":", 1)[1]
    if text.split(":")[0] not in ("ddp", "zero1", "zero2", "zero3", "hybrid_shard"):
        raise ConfigError(
            "declared_strategy", declared, "must be ddp, zero1, zero2, zero3 or hybrid:<shard size>"
        )
    return ShardingStrategy.parse(text)


def as_layout(model_or_layout: Any) -> ParamLayout:
    """A :class:`ParamLayout`, or the layout of a module's named parameters."""
    return (
        model_or_layout
        if isinstance(model_or_layout, ParamLayout)
        else ParamLayout.from_module(model_or_layout)
    )


def stored_numel(
    layout: ParamLayout, strategy: ShardingStrategy, world: int, rank: int, partitioner: str | None
) -> int:
    """Elements a rank stores of one sharded state under ``partitioner`` (padding included)."""
    k = strategy.shard_group_size(world)
    if k == 1:
        return layout.total_numel
    sizes = shard_sizes(layout, k, partitioner)
    local = rank % k
    for cls in sizes.classes:
        if any(a <= local < b for a, b in cls.local_ranks):
            return cls.stored_numel
    raise AssertionError(f"local rank {local} in no class of {sizes.rule}")


def planned_bytes(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    world: int,
    rank: int,
    dtype_bytes: int,
    states_per_element: int,
    partitioner: str | None = None,
    master_copy: bool = False,
) -> dict[str, int]:
    """C-ZERO-004's plan for one rank: bytes of params, grads and optimizer state the strategy lets it keep.

    A sharded kind holds the rank's stored shard (``partitioner``'s rule, padding included, as
    :func:`zerosim.cost.shard_sizes.shard_sizes` gives it), a replicated kind the whole model.
    The optimizer keeps ``states_per_element`` buffers per element; no separate master copy unless the
    trainer declares one (``master_copy = True``: DeepSpeed and zerogpu's ZeRO-1/2 step a master shard
    of their own and gather it into replicated parameters), which adds one buffer to the optimizer.
    """
    full = layout.total_numel
    shard = stored_numel(layout, strategy, world, rank, partitioner)
    buffers = states_per_element + (1 if master_copy else 0)
    return {
        "params": (shard if strategy.shards_params else full) * dtype_bytes,
        "grads": (shard if strategy.shards_grads else full) * dtype_bytes,
        "optimizer": (shard if strategy.shards_optimizer else full) * dtype_bytes * buffers,
    }


def states_per_element(optim: Mapping[str, Any]) -> int:
    """Optimizer state buffers per element: AdamW 2 (m, v); SGD 1 with momentum, else 0."""
    if optim.get("name") == "adamw":
        return OPTIMIZER_STATES["adamw"]
    return OPTIMIZER_STATES["sgd-momentum"] if optim.get("momentum") else OPTIMIZER_STATES["sgd"]


def _plan_words(strategy: ShardingStrategy, kind: str) -> str:
    sharded = {
        "params": strategy.shards_params,
        "grads": strategy.shards_grads,
        "optimizer": strategy.shards_optimizer,
    }[kind]
    return "its shard" if sharded else "one full copy"


def check_resident_memory(
    declared_strategy: str,
    layout: Any,
    dtype_bytes: int,
    world: int,
    per_rank_memory: Sequence[Mapping[str, int]],
    *,
    optim: Mapping[str, Any],
    partitioner: str | None = None,
    master_copy: bool = False,
    phase: str | None = None,
    step: int | None = None,
) -> Verdict:
    """C-ZERO-004 on resident bytes: no rank keeps more of any kind of state than the declared plan.

    ``per_rank_memory[r]`` = ``{"params", "grads", "optimizer"}`` bytes rank ``r`` keeps at the end of
    ``step``. Each violation (clause ``bytes``) names the rank and the kind of state (in ``tensor``),
    the planned and the measured bytes. Details: the strategy, partition rule, element size and, per
    rank, the measured and planned bytes (``ranks``).
    """
    strategy = strategy_from_declared(declared_strategy)
    lay = as_layout(layout)
    n_states = states_per_element(optim)
    rule = partitioner or "even split"
    out = ViolationCollector(CONTRACT)
    rows: list[dict[str, Any]] = []
    for rank, measured in enumerate(per_rank_memory):
        plan = planned_bytes(lay, strategy, world, rank, dtype_bytes, n_states, partitioner, master_copy)
        rows.append({"rank": rank, "measured": dict(measured), "planned": plan})
        for kind in MEMORY_KINDS:
            got = int(measured.get(kind, 0))
            if got > plan[kind]:
                out.add(
                    "bytes",
                    f"rank {rank} keeps {got:,} bytes of {kind}, {got - plan[kind]:,} more than the "
                    f"{strategy.name} plan allows ({plan[kind]:,} bytes: {_plan_words(strategy, kind)}, "
                    f"{rule} partition, {dtype_bytes}-byte elements)",
                    phase=phase, step=step, ranks=(rank,), tensor=kind, expected=plan[kind], got=got,
                    error=got - plan[kind], tolerance=0,
                )
    return out.verdict(
        checked=len(rows) * len(MEMORY_KINDS),
        strategy=strategy.name, partitioner=partitioner, dtype_bytes=dtype_bytes, ranks=rows,
    )


def kinds_below_plan(verdict: Verdict) -> list[str]:
    """The kinds of state some rank keeps less of than its plan (from :func:`check_resident_memory`'s
    details): not a violation, a sign the trainer frees or pads less than the model assumes."""
    rows = verdict.details.get("ranks", [])
    return sorted({k for row in rows for k in MEMORY_KINDS if row["measured"].get(k, 0) < row["planned"][k]})
