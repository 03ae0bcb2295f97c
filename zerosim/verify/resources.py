"""C-ZERO-004 and C-ZERO-005 on live torch.distributed trainers: resident bytes and counted traffic.

Memory (C-ZERO-004): a built-in adapter reports, per rank, the bytes of parameters, gradients and
optimizer state it really keeps, read from tensor storages (:func:`storage_bytes`: each storage
counted once, so views into one flat buffer, DDP's bucket views and DTensor local shards cost what
they allocate). :func:`check_memory` compares them with the plan of the declared strategy, built
from the memory model's shard sizes (:func:`zerosim.cost.shard_sizes.shard_sizes`) under the
peer's own partition rule, so padding counts as the peer stores it. The contract is an upper
bound per rank and per kind of state: a rank that keeps more than its plan (a hidden full copy, a
strategy declared smaller than what runs) fails, naming rank and kind. Holding less than the plan
is reported in the details, not failed: FSDP2 with ``reshard_after_forward=False`` (declared
ZeRO-2) still frees its unsharded parameters after backward.

Traffic (C-ZERO-005): :class:`zerosim.verify.traffic.TrafficCounter` counts, per rank, what every
data collective of a step moves under the ring attribution. :func:`check_traffic` compares the bytes
each rank *receives* per step with the communication model of the declared strategy
(:func:`zerosim.cost.comm_model.comm_per_step`), split into gradient reduction (all-reduce,
reduce-scatter, reduce to an owner) and parameter exchange (all-gather, broadcast). Received bytes
make a broadcast from each owner (ZeroRedundancyOptimizer) and an all-gather comparable: under both
a rank receives every element it does not own. The expected value is a band: at most the model with
the peer's padding; at least, per gradient reduction, the same collective on the unpadded gradient,
and per parameter gather pass, the elements the rank does not store (a peer that pads less than the
model, or broadcasts whole tensors without padding, moves less). Below the band is a failure too: a
ZeRO-3 that gathers once per step keeps whole parameters alive from forward to backward. Scalars (a
gradient norm, a loss, an overflow flag) are control traffic, counted apart and not judged.

Why one module of this length: the memory plan and the traffic band are built from the same
declared strategy, shard sizes and wire element sizes, and are judged in one pass per phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from zerosim.cost.comm_model import comm_per_step
from zerosim.cost.memory_settings import OPTIMIZER_STATES
from zerosim.cost.shard_sizes import shard_sizes
from zerosim.errors import ConfigError
from zerosim.layout import ParamLayout
from zerosim.strategy import ShardingStrategy, Topology
from zerosim.verdict import Violation

from .outcome import violation_json
from .traffic import TRAFFIC_CLASSES, TrafficCounter, local_tensor

MEMORY_KINDS = ("params", "grads", "optimizer")
__all__ = [
    "TrafficCounter",
    "check_memory",
    "check_traffic",
    "planned_bytes",
    "resource_outcomes",
    "ResourceProbe",
    "PhaseResources",
    "storage_bytes",
    "strategy_from_declared",
]

# ---------------------------------------------------------------------------------------------
# resident bytes
# ---------------------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (C-ZERO-004's measured side).

    Shared storages are counted once (views into one flat buffer, tied weights, DDP bucket views);
    a DTensor counts its local shard's storage; 0-dim tensors (optimizer step counters) are left out:
    the memory model counts per-element state only.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = local_tensor(t)
        if local.dim() == 0:
            continue
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


# ---------------------------------------------------------------------------------------------
# the plans: what the declared strategy lets each rank hold and receive
# ---------------------------------------------------------------------------------------------


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
    return (
        model_or_layout
        if isinstance(model_or_layout, ParamLayout)
        else ParamLayout.from_module(model_or_layout)
    )


def _stored_numel(
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
    shard = _stored_numel(layout, strategy, world, rank, partitioner)
    buffers = states_per_element + (1 if master_copy else 0)
    return {
        "params": (shard if strategy.shards_params else full) * dtype_bytes,
        "grads": (shard if strategy.shards_grads else full) * dtype_bytes,
        "optimizer": (shard if strategy.shards_optimizer else full) * dtype_bytes * buffers,
    }


def states_per_element(optim: dict[str, Any]) -> int:
    """Optimizer state buffers per element: AdamW 2 (m, v); SGD 1 with momentum, else 0."""
    if optim.get("name") == "adamw":
        return OPTIMIZER_STATES["adamw"]
    return OPTIMIZER_STATES["sgd-momentum"] if optim.get("momentum") else OPTIMIZER_STATES["sgd"]


def _rank_violation(
    contract: str,
    phase: str | None,
    step: int | None,
    rank: int,
    kind: str,
    expected: Any,
    got: Any,
    message: str,
) -> dict[str, Any]:
    """A per-rank byte count outside its plan (C-ZERO-004 clause ``bytes``, C-ZERO-005 ``ring_model``),
    rendered for the report: no element range, zero tolerance."""
    error = None if expected is None else got - expected
    clause = "bytes" if contract == "C-ZERO-004" else "ring_model"
    return violation_json(Violation(contract, clause, message, step=step, ranks=(rank,), tensor=kind,
                                    expected=expected, got=got, phase=phase, error=error, tolerance=0))


def check_memory(
    declared_strategy: str,
    layout: Any,
    dtype_bytes: int,
    world: int,
    per_rank_memory: Sequence[dict[str, int]],
    *,
    optim: dict[str, Any],
    partitioner: str | None = None,
    master_copy: bool = False,
    phase: str | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """C-ZERO-004 on resident bytes: no rank keeps more of any kind of state than the declared plan.

    ``per_rank_memory[r]`` = ``{"params", "grads", "optimizer"}`` bytes of rank ``r`` (from
    :func:`storage_bytes`). Returns ``{"status", "reason", "violations", "details"}``; each violation
    names the rank and the kind of state (in ``tensor``), the planned and the measured bytes.
    """
    strategy = strategy_from_declared(declared_strategy)
    lay = as_layout(layout)
    n_states = states_per_element(optim)
    rule = partitioner or "even split"
    violations: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for rank, measured in enumerate(per_rank_memory):
        plan = planned_bytes(lay, strategy, world, rank, dtype_bytes, n_states, partitioner, master_copy)
        rows.append({"rank": rank, "measured": dict(measured), "planned": plan})
        for kind in MEMORY_KINDS:
            got = int(measured.get(kind, 0))
            if got > plan[kind]:
                violations.append(
                    _rank_violation(
                        "C-ZERO-004",
                        phase,
                        step,
                        rank,
                        kind,
                        plan[kind],
                        got,
                        f"rank {rank} keeps {got:,} bytes of {kind}, {got - plan[kind]:,} more than the "
                        f"{strategy.name} plan allows ({plan[kind]:,} bytes: {_plan_words(strategy, kind)}, "
                        f"{rule} partition, {dtype_bytes}-byte elements)",
                    )
                )
    below = sorted({k for row in rows for k in MEMORY_KINDS if row["measured"].get(k, 0) < row["planned"][k]})
    reason = (
        f"resident bytes within the {strategy.name} plan on every rank"
        if not violations
        else f"{violations[0]['message']} ({len(violations)} rank/state pairs above the plan)"
    )
    if below and not violations:
        reason += (
            f"; below the plan for {', '.join(below)} (the peer frees or pads less than the model assumes)"
        )
    return {
        "status": "fail" if violations else "pass",
        "reason": reason,
        "violations": violations,
        "details": {
            "strategy": strategy.name,
            "partitioner": partitioner,
            "dtype_bytes": dtype_bytes,
            "ranks": rows,
        },
    }


def _plan_words(strategy: ShardingStrategy, kind: str) -> str:
    sharded = {
        "params": strategy.shards_params,
        "grads": strategy.shards_grads,
        "optimizer": strategy.shards_optimizer,
    }[kind]
    return "its shard" if sharded else "one full copy"


def _traffic_band(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    world: int,
    rank: int,
    param_bytes: int,
    grad_bytes: int,
    partitioner: str | None,
    zero1_grad_reduce: str,
    micro_batches: int = 1,
) -> dict[str, tuple[Fraction, Fraction]]:
    """(least, most) bytes ``rank`` receives per step in each traffic class (see the module docstring).

    Under accumulation over ``micro_batches`` K the least is the one-micro-batch model's (a trainer
    that accumulates locally and reduces once, FSDP2 without gradient sync) and the most the K-micro-batch
    model's (a reduction per micro-batch into the shard, DeepSpeed ZeRO-2, zerogpu; ZeRO-3 gathering
    for every micro-batch's forward and backward). Replicated-gradient strategies (DDP, ZeRO-1) have
    one reduction per step in both, so their band stays exact."""
    one = _band_of(layout, strategy, world, rank, param_bytes, grad_bytes, partitioner, zero1_grad_reduce, 1)
    if micro_batches == 1:
        return one
    many = _band_of(layout, strategy, world, rank, param_bytes, grad_bytes, partitioner, zero1_grad_reduce,
                    micro_batches)
    return {c: (min(one[c][0], many[c][0]), max(one[c][1], many[c][1])) for c in TRAFFIC_CLASSES}


def _band_of(
    layout: ParamLayout,
    strategy: ShardingStrategy,
    world: int,
    rank: int,
    param_bytes: int,
    grad_bytes: int,
    partitioner: str | None,
    zero1_grad_reduce: str,
    micro_batches: int,
) -> dict[str, tuple[Fraction, Fraction]]:
    """(least, most) of :func:`_traffic_band` for one schedule of ``micro_batches`` micro-batches."""
    est = comm_per_step(
        layout,
        strategy,
        Topology(world),
        partitioner or "fsdp",
        micro_batches=micro_batches,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        zero1_grad_reduce=zero1_grad_reduce,
    )
    psi = layout.total_numel
    stored = _stored_numel(layout, strategy, world, rank, partitioner)
    band: dict[str, tuple[Fraction, Fraction]] = {c: (Fraction(0), Fraction(0)) for c in TRAFFIC_CLASSES}
    for item in est.items:
        if item.group_size <= 1:
            continue
        most = item.bytes_received
        if item.collective == "all_gather":
            # every gather brings the elements this rank does not store; padding may or may not travel.
            # A one-element tensor moved alone (a peer broadcasting whole tensors) is counted as control
            # traffic, indistinguishable from a scalar: the least leaves those elements out
            passes = Fraction(item.payload_elements, est.packed_numel)
            scalars = sum(1 for n in layout.numels() if n == 1)
            least = passes * max(psi - stored - scalars, 0) * param_bytes
            cls = "gather"
        else:
            # a gradient buffer of the real elements only (no padding) is the least a reduction moves
            padded = item.payload_elements % psi != 0
            least = most * Fraction(psi, est.packed_numel) if padded else most
            cls = "reduce"
        lo, hi = band[cls]
        band[cls] = (lo + min(least, most), hi + most)
    return band


def check_traffic(
    declared_strategy: str,
    layout: Any,
    dtype_bytes: int,
    world: int,
    per_rank_traffic: Sequence[Sequence[dict[str, Any]]],
    *,
    grad_bytes: int | None = None,
    partitioner: str | None = None,
    zero1_grad_reduce: str = "all_reduce",
    unobserved: dict[str, str] | None = None,
    phase: str | None = None,
    first_step: int = 1,
    micro_batches: int = 1,
) -> dict[str, Any]:
    """C-ZERO-005 on counted traffic: the bytes every rank receives per step, per traffic class, lie in
    the band of the declared strategy's communication model (see the module docstring).

    ``per_rank_traffic[r][i]`` = :meth:`TrafficCounter.summary` of rank ``r`` at the ``i``-th step of
    the phase (global step ``first_step + i``). ``dtype_bytes``: bytes of a parameter element on the
    wire; ``grad_bytes``: of a gradient element (default the same). ``unobserved``: class -> why the
    counter cannot see it (that class is not judged, and the reason is reported). ``micro_batches``:
    micro-batches per optimizer step (the band of :func:`_traffic_band` under accumulation).
    """
    strategy = strategy_from_declared(declared_strategy)
    lay = as_layout(layout)
    unobserved = dict(unobserved or {})
    violations, rows = [], []
    for rank, steps in enumerate(per_rank_traffic):
        band = _traffic_band(
            lay, strategy, world, rank, dtype_bytes, grad_bytes or dtype_bytes, partitioner,
            zero1_grad_reduce, micro_batches,
        )
        rows.append(
            {
                "rank": rank,
                "band": {c: [float(lo), float(hi)] for c, (lo, hi) in band.items()},
                "received": [
                    {c: float(s[c]["received"]) for c in (*TRAFFIC_CLASSES, "control")} for s in steps
                ],
            }
        )
        for i, summary in enumerate(steps):
            for cls in TRAFFIC_CLASSES:
                if cls in unobserved:
                    continue
                lo, hi = band[cls]
                got = Fraction(summary[cls]["received"])
                if not lo <= got <= hi:
                    what = "gradient reduction" if cls == "reduce" else "parameter exchange"
                    violations.append(
                        {
                            **_rank_violation(
                                "C-ZERO-005",
                                phase,
                                first_step + i,
                                rank,
                                cls,
                                float(hi),
                                float(got),
                                f"rank {rank} received {float(got):,.0f} bytes of {what} "
                                f"in step {first_step + i}; "
                                f"the {strategy.name} ring model allows {float(lo):,.0f} to {float(hi):,.0f}",
                            ),
                            "expected_range": [float(lo), float(hi)],
                        }
                    )
    judged = [c for c in TRAFFIC_CLASSES if c not in unobserved]
    reason = (
        f"received bytes of {', '.join(judged)} within the {strategy.name} ring model on every rank and step"
        if not violations
        else f"{violations[0]['message']} ({len(violations)} rank/step/class triples outside the model)"
    )
    for cls, why in unobserved.items():
        reason += f"; {cls} not judged: {why}"
    return {
        "status": "fail" if violations else "pass",
        "reason": reason,
        "violations": violations,
        "details": {
            "strategy": strategy.name,
            "partitioner": partitioner,
            "param_bytes": dtype_bytes,
            "grad_bytes": grad_bytes or dtype_bytes,
            "zero1_grad_reduce": zero1_grad_reduce,
            "micro_batches": micro_batches,
            "ranks": rows,
        },
    }


# ---------------------------------------------------------------------------------------------
# what a verify run calls: per rank around step(), on rank 0 after the run
# ---------------------------------------------------------------------------------------------


def trainer_resource_info(trainer: Any) -> dict[str, Any]:
    """What a trainer declares for C-ZERO-004/005 (built-in adapters; a user's trainer usually none)."""
    return {
        "declared_strategy": getattr(trainer, "declared_strategy", None),
        "partition_rule": getattr(trainer, "partition_rule", None),
        "master_copy": bool(getattr(trainer, "master_copy", False)),
        "zero1_grad_reduce": getattr(trainer, "zero1_grad_reduce", "all_reduce"),
        "wire_bytes": dict(getattr(trainer, "wire_bytes", {}) or {}),
        "has_resident_bytes": callable(getattr(trainer, "resident_bytes", None)),
        "unobserved_traffic": dict(getattr(trainer, "unobserved_traffic", {}) or {}),
        "memory_unobserved": getattr(trainer, "memory_unobserved", None),
    }


class ResourceProbe:
    """One rank's C-ZERO-004/005 observations of one step: traffic counted around ``step()`` and the
    resident bytes right after it. Does nothing for a trainer that declares no strategy."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.info = trainer_resource_info(trainer)
        self.last: dict[str, Any] | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self.last = None
        if not self.info["declared_strategy"]:
            yield
            return
        with TrafficCounter() as counter:
            yield
        memory = self.trainer.resident_bytes() if self.info["has_resident_bytes"] else None
        self.last = {
            "traffic": counter.summary(),
            "memory": None if memory is None else {k: int(memory.get(k, 0)) for k in MEMORY_KINDS},
        }

    def take(self) -> dict[str, Any] | None:
        """The last step's observation (picklable), for gathering to rank 0."""
        out, self.last = self.last, None
        return out


@dataclass
class PhaseResources:
    """One phase's resource observations on every rank: ``steps[i][r]`` = rank ``r``'s
    :meth:`ResourceProbe.take` at the ``i``-th step of the phase."""

    name: str
    optim: dict[str, Any]
    first_step: int
    info: dict[str, Any]
    steps: list[list[dict[str, Any] | None]]


def resource_outcomes(
    phases: Sequence[PhaseResources], model: Any, dtype_bytes: int, world: int
) -> dict[str, Any]:
    """C-ZERO-004 and C-ZERO-005 over every phase that ran, as ``{"C-ZERO-004": ContractOutcome, ...}``."""
    from .outcome import ContractOutcome

    layout = as_layout(model)
    memory: list[dict[str, Any]] = []
    traffic: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for ph in phases:
        info = ph.info
        strategy = info.get("declared_strategy")
        if not strategy:
            skipped["C-ZERO-004"] = skipped["C-ZERO-005"] = (
                "the trainer declares no strategy (declared_strategy): "
                "no plan to compare memory and traffic with"
            )
            continue
        observed = [[obs for obs in step if obs is not None] for step in ph.steps]
        if any(len(step) != world for step in observed):
            continue
        mem_steps = [[obs["memory"] for obs in step] for step in observed]
        if info.get("has_resident_bytes") and all(m is not None for step in mem_steps for m in step):
            for i, per_rank in enumerate(mem_steps):
                memory.append(
                    check_memory(
                        strategy,
                        layout,
                        dtype_bytes,
                        world,
                        per_rank,
                        optim=ph.optim,
                        partitioner=info.get("partition_rule"),
                        master_copy=bool(info.get("master_copy")),
                        phase=ph.name,
                        step=ph.first_step + i,
                    )
                )
        else:
            skipped["C-ZERO-004"] = info.get("memory_unobserved") or "the trainer reports no resident_bytes()"
        per_rank = [[step[r]["traffic"] for step in observed] for r in range(world)]
        wire = info.get("wire_bytes") or {}
        traffic.append(
            check_traffic(
                strategy,
                layout,
                wire.get("params", dtype_bytes),
                world,
                per_rank,
                grad_bytes=wire.get("grads", dtype_bytes),
                partitioner=info.get("partition_rule"),
                zero1_grad_reduce=info.get("zero1_grad_reduce", "all_reduce"),
                unobserved=info.get("unobserved_traffic"),
                phase=ph.name,
                first_step=ph.first_step,
                micro_batches=int(info.get("micro_batches", 1)),
            )
        )
    out = {}
    for cid, results in (("C-ZERO-004", memory), ("C-ZERO-005", traffic)):
        if not results:
            out[cid] = ContractOutcome("skipped", skipped.get(cid, "no phase ran with a declared strategy"))
            continue
        violations = [v for r in results for v in r["violations"]]
        failed = [r for r in results if r["status"] == "fail"]
        reason = failed[0]["reason"] if failed else results[-1]["reason"]
        out[cid] = ContractOutcome(
            "fail" if violations else "pass",
            reason,
            violations,
            {"checks": [r["details"] for r in results]},
        )
    return out
