"""C-ZERO-004 and C-ZERO-005 on live torch.distributed trainers: resident bytes and counted traffic,
measured on every rank and handed to the contracts' checks.

Memory (C-ZERO-004): a built-in adapter reports, per rank, the bytes of parameters, gradients and
optimizer state it really keeps, read from tensor storages (:func:`storage_bytes`: each storage
counted once, so views into one flat buffer, DDP's bucket views and DTensor local shards cost what
they allocate). :func:`zerosim.checks.holdings.check_holdings` judges them against the
declared strategy's plan (:class:`~zerosim.checks.holdings.ResidentPlan`).

Traffic (C-ZERO-005): :class:`zerosim.verify.traffic.TrafficCounter` counts, per rank, what every
data collective of a step moves under the ring attribution, with each call's element dtype.
:func:`zerosim.checks.traffic.check_communication` judges the received bytes against the
declared strategy's communication model (:class:`~zerosim.checks.traffic.TrafficModel`); the dtype of
every gradient reduction is judged by the same check once the run's arithmetic dtype is known
(:mod:`zerosim.verify.evaluate`).

This module measures (:class:`ResourceProbe`, around ``step()`` on every rank) and hands the
observations to the checks (:func:`zerosim.checks.judges.judge`) on rank 0, one verdict per contract over
every phase (:func:`resource_outcomes`); it judges nothing itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from zerosim.checks.holdings import MEMORY_KINDS, ResidentPlan, as_layout, kinds_below_plan
from zerosim.checks.judges import judge
from zerosim.checks.traffic import TRAFFIC_CLASSES, TrafficModel
from zerosim.values.verdict import Verdict

from .traffic import TrafficCounter, local_tensor

__all__ = [
    "TrafficCounter",
    "resource_outcomes",
    "ResourceProbe",
    "PhaseResources",
    "storage_bytes",
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
# what a verify run calls: per rank around step(), on rank 0 after the run
# ---------------------------------------------------------------------------------------------


def trainer_resource_info(trainer: Any) -> dict[str, Any]:
    """What a trainer declares for C-ZERO-004/005 (built-in adapters; a user's trainer usually none)."""
    return {
        "declared_strategy": getattr(trainer, "declared_strategy", None),
        "partition_rule": getattr(trainer, "partition_rule", None),
        "master_copy": bool(getattr(trainer, "master_copy", False)),
        "packed_shards": bool(getattr(trainer, "packed_shards", False)),
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


def memory_result(verdict: Verdict) -> Verdict:
    """C-ZERO-004's verdict for one step with the line the report shows: the first rank above its plan,
    or the kinds held below it."""
    strategy = verdict.details["strategy"]
    if verdict.violations:
        verdict.note = (f"{verdict.violations[0].message} ({len(verdict.violations)} rank/state pairs above "
                        "the plan)")
        return verdict
    verdict.note = f"resident bytes within the {strategy} plan on every rank"
    below = kinds_below_plan(verdict)
    if below:
        verdict.note += (f"; below the plan for {', '.join(below)} "
                         "(the peer frees or pads less than the model assumes)")
    return verdict


def traffic_result(verdict: Verdict, unobserved: dict[str, str] | None = None) -> Verdict:
    """C-ZERO-005's ``ring_model`` verdict for one phase with the line the report shows (see
    :func:`memory_result`); a class in ``unobserved`` is named with the reason it was not judged."""
    unobserved = dict(unobserved or {})
    strategy = verdict.details["strategy"]
    judged = [c for c in TRAFFIC_CLASSES if c not in unobserved]
    verdict.note = (
        f"received bytes of {', '.join(judged)} within the {strategy} ring model on every rank and step"
        if not verdict.violations
        else f"{verdict.violations[0].message} ({len(verdict.violations)} rank/step/class triples outside "
        "the model)"
    )
    for cls, why in unobserved.items():
        verdict.note += f"; {cls} not judged: {why}"
    return verdict


def skipped_steps(steps: Sequence[int], masters: Mapping[int, Mapping[str, Any]],
                  initial: Mapping[str, Any]) -> frozenset[int]:
    """The steps among ``steps`` (consecutive, one phase) whose masters (``masters[step]``, rank 0's
    after the step) are bitwise those before it (``initial`` before the first): steps a loss-scaling
    trainer skipped. A step without masters is not counted as skipped."""
    out = set()
    before: Mapping[str, Any] | None = initial
    for step in steps:
        after = masters.get(step)
        if after is not None and before is not None and set(after) == set(before) and all(
            np.array_equal(np.asarray(after[n], np.float32), np.asarray(before[n], np.float32))
            for n in after
        ):
            out.add(step)
        before = after
    return frozenset(out)


def resource_outcomes(
    phases: Sequence[PhaseResources], model: Any, dtype_bytes: int, world: int,
    policy: Mapping[str, Any] | None = None, overflowed: frozenset[int] = frozenset(),
) -> dict[str, Verdict]:
    """C-ZERO-004 and C-ZERO-005 (``ring_model``) over every phase that ran, one verdict each:
    ``{"C-ZERO-004": Verdict, "C-ZERO-005": Verdict}``. Under a mixed-precision
    ``policy`` the traffic model takes its element sizes from the policy
    (:meth:`~zerosim.checks.traffic.TrafficModel.under_policy`; ``dtype_bytes`` is the masters'), with
    ``overflowed`` the steps the trainer skipped; what a trainer declares in ``wire_bytes`` still wins."""
    layout = as_layout(model)
    memory: list[Verdict] = []
    traffic: list[Verdict] = []
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
                memory.append(memory_result(
                    judge(
                        "C-ZERO-004",
                        per_rank,
                        ResidentPlan(
                            strategy,
                            layout,
                            dtype_bytes,
                            world,
                            optim=ph.optim,
                            partitioner=info.get("partition_rule"),
                            master_copy=bool(info.get("master_copy")),
                            packed_shards=bool(info.get("packed_shards")),
                        ),
                        phase=ph.name,
                        step=ph.first_step + i,
                    )
                ))
        else:
            skipped["C-ZERO-004"] = info.get("memory_unobserved") or "the trainer reports no resident_bytes()"
        per_rank = [[step[r]["traffic"] for step in observed] for r in range(world)]
        wire = info.get("wire_bytes") or {}
        options: dict[str, Any] = dict(
            partitioner=info.get("partition_rule"),
            zero1_grad_reduce=info.get("zero1_grad_reduce", "all_reduce"),
            unobserved=info.get("unobserved_traffic"),
            micro_batches=int(info.get("micro_batches", 1)),
        )
        if policy is None:
            traffic_model = TrafficModel(strategy, layout, wire.get("params", dtype_bytes), world,
                                         grad_bytes=wire.get("grads", dtype_bytes), **options)
        else:
            traffic_model = TrafficModel.under_policy(strategy, layout, world, policy, dtype_bytes,
                                                      skipped_steps=overflowed, **options)
            if wire:  # the trainer's own declaration of what it moves is exact
                traffic_model = replace(
                    traffic_model, param_bytes=wire.get("params", traffic_model.param_bytes),
                    grad_bytes=wire.get("grads", traffic_model.grad_bytes),
                    master_bytes=None if "params" in wire else traffic_model.master_bytes)
        traffic.append(traffic_result(
            judge("C-ZERO-005", per_rank, traffic_model, phase=ph.name, first_step=ph.first_step),
            info.get("unobserved_traffic"),
        ))
    out = {}
    for cid, results in (("C-ZERO-004", memory), ("C-ZERO-005", traffic)):
        if not results:
            out[cid] = Verdict.skipped(cid, skipped.get(cid, "no phase ran with a declared strategy"))
            continue
        failed = [r for r in results if r.violations]
        out[cid] = Verdict(cid, [v for r in results for v in r.violations], sum(r.checked for r in results),
                           {"checks": [dict(r.details) for r in results]},
                           note=failed[0].note if failed else results[-1].note)
    return out
