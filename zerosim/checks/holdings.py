"""C-ZERO-004, each rank holds exactly its planned shards and ZeRO-3 never holds more than its bound: one
check, :func:`check_holdings`, for the engine's runs (simulate on numpy, mpi and torch) and for live
trainers (``zerosim verify``). Which one it judges follows from the expectation it is given.

* **The engine's runs** (:class:`~zerosim.values.observe.RankObservation` per rank and an
  :class:`OwnershipExpectation` built from the plan): what each rank holds, measured from its live
  arrays, is exactly the plan's intervals (clause ``intervals``), with the engine's packing padding
  (``padding``), at the right bytes (``bytes``); the memory tracker agrees (``tracker``); transient
  buffers are freed at the end of the step (``transients_freed``); under ZeRO-3 the peak of live
  parameter bytes stays within the shard plus ``(1 + prefetch)`` gathered units (``peak_bound``).
* **Live trainers** (per rank, the bytes of parameters, gradients and optimizer state the trainer
  really keeps, read from tensor storages, and a :class:`ResidentPlan`): the plan of the declared
  strategy is built from the memory model's shard sizes (:func:`zerosim.cost.shard_sizes.shard_sizes`)
  under the trainer's own partition rule, so padding counts as the trainer stores it. The contract is
  an upper bound per rank and per kind of state: a rank that keeps more than its plan (a hidden full
  copy, a strategy declared smaller than what runs) fails, naming rank and kind (clause ``bytes``).
  Holding less than the plan is not a violation: FSDP2 with ``reshard_after_forward=False`` (declared
  ZeRO-2) still frees its unsharded parameters after backward; the verdict's details carry both
  figures per rank.

Diagnostics name contract, clause, step, rank, tensor, flat element range, expected vs got.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..cost.memory_settings import OPTIMIZER_STATES
from ..cost.optimizer_state import is_elementwise, owned_whole_tensors, state_numel
from ..cost.shard_sizes import shard_sizes
from ..errors import ConfigError
from ..partition import get_partitioner
from ..values.flat_buffers import build_unit_plan
from ..values.intervals import first_difference
from ..values.layout import ParamLayout
from ..values.observe import RankObservation
from ..values.strategy import ShardingStrategy
from ..values.verdict import Verdict
from .collect import ViolationCollector
from .judges import judges
from .mismatch import step_clauses, step_verdict, tensor_at

CONTRACT = "C-ZERO-004"
MEMORY_KINDS = ("params", "grads", "optimizer")


@dataclass(frozen=True)
class OwnershipExpectation:
    """What the plan says a rank must hold, and the byte rules of the run (built by the engine's evaluate)."""

    plan: Any                 # zerosim.values.plan.StatePlan
    padding: dict[str, list[int]]  # kind -> per-rank padding the engine's packing stores
    bytes_per_element: dict[str, int]  # kind -> bytes per stored element summed over arrays of that kind
    peak_live_param_bound: list[int] | None = None  # per rank (sharded params only)
    prefetch: int = 0


@dataclass(frozen=True)
class ResidentPlan:
    """What a live trainer declares for its resident bytes to be judged against: its strategy
    (``"ddp"`` | ``"zero1"`` | ``"zero2"`` | ``"zero3"`` | ``"hybrid:<shard group size>"``), its model
    (a :class:`ParamLayout` or a module), the bytes of one element, the world size, its optimizer
    settings (``{"name": "adamw" | "sgd", "momentum": ...}``), its partition rule (None: an even split)
    and whether it keeps a separate master copy (see :func:`planned_bytes`)."""

    declared_strategy: str
    layout: Any
    dtype_bytes: int
    world: int
    optim: Mapping[str, Any] = field(default_factory=dict)
    partitioner: str | None = None
    master_copy: bool = False
    #: the trainer pads every rank's shard of a unit to the group's largest (zerosim's engine packs each
    #: unit so its collectives move equal sizes): the stored shard is the unit plan's, not the rule's own
    packed_shards: bool = False


@judges(CONTRACT)
def check_holdings(
    observations: Sequence[RankObservation] | Sequence[Mapping[str, int]],
    expect: OwnershipExpectation | ResidentPlan,
    *,
    layout: ParamLayout | None = None,
    phase: str | None = None,
    step: int | None = None,
) -> Verdict:
    """C-ZERO-004 (see the module docstring).

    The engine's runs: ``observations`` are :class:`~zerosim.values.observe.RankObservation` per rank and
    ``expect`` an :class:`OwnershipExpectation`; ``layout`` names the tensor of a wrong interval.
    A live trainer: ``observations[r]`` = ``{"params", "grads", "optimizer"}`` bytes rank ``r`` keeps at
    the end of ``step`` (of ``phase``) and ``expect`` its :class:`ResidentPlan`.
    """
    if isinstance(expect, ResidentPlan):
        return _resident_bytes(observations, expect, phase, step)  # type: ignore[arg-type]
    return _engine_holdings(observations, expect, layout)  # type: ignore[arg-type]


def _engine_holdings(observations: Sequence[RankObservation], expect: OwnershipExpectation,
                     layout: ParamLayout | None) -> Verdict:
    """The engine's runs: what each rank holds matches the plan; memory accounting agrees; transients
    freed; the ZeRO-3 peak bound holds."""
    col = step_clauses(CONTRACT)
    checked = 0
    plan = expect.plan
    for obs in observations:
        rs = plan.rank(obs.rank)
        for so in obs.steps:
            for kind in ("params", "grads", "optimizer"):
                h = so.holdings.get(kind)
                if h is None:
                    col.add("intervals", f"rank reports no {kind} holding", step=so.step, ranks=(obs.rank,))
                    continue
                checked += 1
                want = rs.holding(kind)
                diff = first_difference(h.intervals, want.intervals)
                if diff is not None:
                    tensor, _ = tensor_at(layout, diff[0])
                    holds = any(s <= diff[0] < e for s, e in h.intervals)
                    col.add(
                        "intervals",
                        f"{kind}: rank {'holds' if holds else 'is missing'} elements the plan "
                        f"{'does not give it' if holds else 'assigns to it'}",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=tensor,
                        interval=diff,
                        expected=f"{want.numel} elements",
                        got=f"{h.real_numel} elements",
                        context={"kind": kind},
                    )
                exp_pad = expect.padding[kind][obs.rank]
                if h.padding != exp_pad:
                    col.add("padding", f"{kind}: stored padding differs from the packing rule", step=so.step,
                            ranks=(obs.rank,), expected=exp_pad, got=h.padding, context={"kind": kind,
                            "partitioner_padding": want.padding})
                exp_bytes = h.stored_numel * expect.bytes_per_element[kind]
                if h.nbytes != exp_bytes:
                    col.add(
                        "bytes",
                        f"{kind}: live bytes differ from stored elements x bytes per element",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=exp_bytes,
                        got=h.nbytes,
                        context={"kind": kind},
                    )
            mem = so.memory
            if mem is None:
                continue
            live = {c: sum(mem.live_at_end.get(loc, {}).get(c, 0) for loc in mem.live_at_end) for c in
                    ("params", "grads", "optimizer", "gathered", "grad_buffers", "activations")}
            for kind in ("params", "grads", "optimizer"):
                h = so.holdings.get(kind)
                if h is not None and live[kind] != h.nbytes:
                    col.add(
                        "tracker",
                        f"{kind}: the memory tracker reports {live[kind]} live bytes, the live arrays "
                        f"hold {h.nbytes}",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=h.nbytes,
                        got=live[kind],
                    )
            for cat in ("gathered", "grad_buffers", "activations"):
                if live[cat]:
                    buffers = list(getattr(mem, "live_keys_at_end", {}).get(cat, []))
                    col.add(
                        "transients_freed",
                        f"{live[cat]} bytes of {cat} still live at the end of the step "
                        f"({len(buffers)} buffer(s))",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=0,
                        got=live[cat],
                        tensor=buffers[0].split(":")[1] if buffers and ":" in buffers[0] else None,
                        context={"category": cat, "buffers": buffers},
                    )
            if expect.peak_live_param_bound is not None:
                bound = expect.peak_live_param_bound[obs.rank]
                if mem.peak_live_params > bound:
                    col.add(
                        "peak_bound",
                        "peak live parameter bytes (shard + gathered blocks) exceed the plan's "
                        f"bound (shard + {1 + expect.prefetch} largest gathered unit(s))",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=bound,
                        got=mem.peak_live_params,
                    )
    v = step_verdict(col,
        peaks={o.rank: [s.memory.peak_live_params for s in o.steps if s.memory] for o in observations}
    )
    v.checked = checked
    return v


# ---- a live trainer's resident bytes ------------------------------------------------------------


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
    *,
    stored: int | None = None,
    optimizer_state: int | None = None,
) -> dict[str, int]:
    """C-ZERO-004's plan for one rank: bytes of params, grads and optimizer state the strategy lets it keep.

    A sharded kind holds the rank's stored shard (``partitioner``'s rule, padding included, as
    :func:`zerosim.cost.shard_sizes.shard_sizes` gives it), a replicated kind the whole model.
    The optimizer keeps ``states_per_element`` buffers per element; no separate master copy unless the
    trainer declares one (``master_copy = True``: DeepSpeed and zerogpu's ZeRO-1/2 step a master shard
    of their own and gather it into replicated parameters), which adds one buffer to the optimizer.
    ``stored``: the elements the rank stores of a sharded state when the trainer's packing says so
    (default: the partitioner's own sizes); ``optimizer_state``: elements of optimizer state planned
    tensor by tensor (a whole-tensor layout, :func:`whole_tensor_state_numel`) instead of
    ``states_per_element`` buffers per element.
    """
    full = layout.total_numel
    shard = stored_numel(layout, strategy, world, rank, partitioner) if stored is None else stored
    held = shard if strategy.shards_optimizer else full
    if optimizer_state is None:
        optimizer = held * (states_per_element + (1 if master_copy else 0))
    else:
        optimizer = optimizer_state + (held if master_copy else 0)
    return {
        "params": (shard if strategy.shards_params else full) * dtype_bytes,
        "grads": (shard if strategy.shards_grads else full) * dtype_bytes,
        "optimizer": optimizer * dtype_bytes,
    }


def packed_stored_numel(layout: ParamLayout, strategy: ShardingStrategy, world: int,
                        partitioner: str | None) -> int:
    """Elements every rank stores of one sharded state when each unit is packed to the shard group's
    largest share (:func:`zerosim.values.flat_buffers.build_unit_plan`'s chunks, padding included)."""
    if strategy.shard_group_size(world) == 1:
        return layout.total_numel
    return build_unit_plan(layout, strategy, partitioner or "fsdp", world).shard_numel


def whole_tensor_state_numel(layout: ParamLayout, strategy: ShardingStrategy, world: int, rank: int,
                             optim: Mapping[str, Any], partitioner: str | None) -> int | None:
    """Elements of optimizer state ``rank`` keeps in a whole-tensor layout: the per-tensor state
    (:func:`zerosim.cost.optimizer_state.state_numel`) of every tensor it owns whole under the
    partitioner's plan (every tensor when the state is replicated); None when the state is unknown."""
    k = strategy.shard_group_size(world)
    if strategy.shards_optimizer and k > 1:
        plan = get_partitioner(partitioner or "zero-redundancy")(layout, k)
        tensors = owned_whole_tensors(layout, plan, rank % k)
    else:
        tensors = list(layout.tensors)
    sizes = [state_numel(optim, tuple(t.shape)) for t in tensors]
    return None if any(n is None for n in sizes) else sum(n or 0 for n in sizes)


def states_per_element(optim: Mapping[str, Any]) -> int:
    """Optimizer state buffers per element: Adam and AdamW 2 (m, v); SGD 1 with momentum, else 0."""
    if optim.get("name") in ("adam", "adamw"):
        return OPTIMIZER_STATES[str(optim.get("name"))]
    return OPTIMIZER_STATES["sgd-momentum"] if optim.get("momentum") else OPTIMIZER_STATES["sgd"]


def _plan_words(strategy: ShardingStrategy, kind: str) -> str:
    sharded = {
        "params": strategy.shards_params,
        "grads": strategy.shards_grads,
        "optimizer": strategy.shards_optimizer,
    }[kind]
    return "its shard" if sharded else "one full copy"


def _resident_bytes(per_rank_memory: Sequence[Mapping[str, int]], resident: ResidentPlan,
                    phase: str | None, step: int | None) -> Verdict:
    """A live trainer's resident bytes: no rank keeps more of any kind of state than the declared plan.

    ``per_rank_memory[r]`` = ``{"params", "grads", "optimizer"}`` bytes rank ``r`` keeps at the end of
    ``step``. Each violation (clause ``bytes``) names the rank and the kind of state (in ``tensor``),
    the planned and the measured bytes. Details: the strategy, partition rule, element size and, per
    rank, the measured and planned bytes (``ranks``).
    """
    strategy = strategy_from_declared(resident.declared_strategy)
    lay = as_layout(resident.layout)
    n_states = states_per_element(resident.optim)
    partitioner, dtype_bytes, world = resident.partitioner, resident.dtype_bytes, resident.world
    master_copy = resident.master_copy
    rule = partitioner or "even split"
    whole = not is_elementwise(resident.optim) and bool(resident.optim)
    stored = packed_stored_numel(lay, strategy, world, partitioner) if resident.packed_shards else None
    out = ViolationCollector(CONTRACT)
    rows: list[dict[str, Any]] = []
    unjudged: list[str] = []
    for rank, measured in enumerate(per_rank_memory):
        state = (whole_tensor_state_numel(lay, strategy, world, rank, resident.optim, partitioner)
                 if whole else None)
        plan = planned_bytes(lay, strategy, world, rank, dtype_bytes, n_states, partitioner, master_copy,
                             stored=stored, optimizer_state=state)
        rows.append({"rank": rank, "measured": dict(measured), "planned": plan})
        for kind in MEMORY_KINDS:
            if kind == "optimizer" and whole and state is None:
                unjudged = [f"optimizer: the state of {resident.optim.get('name')} is not known"]
                continue
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
        optimizer_layout="whole-tensor" if whole else "flat", unjudged=unjudged,
    )


def kinds_below_plan(verdict: Verdict) -> list[str]:
    """The kinds of state some rank keeps less of than its plan (from a live trainer's :func:`check_holdings`
    details): not a violation, a sign the trainer frees or pads less than the model assumes."""
    rows = verdict.details.get("ranks", [])
    return sorted({k for row in rows for k in MEMORY_KINDS if row["measured"].get(k, 0) < row["planned"][k]})
