"""C-ZERO-005, each rank's traffic per step equals the ring model and every gradient reduction moves the
dtype the run's policy names: one check, :func:`check_communication`, for the engine's runs (simulate on
numpy, mpi and torch) and for live trainers (``zerosim verify``). Which one it judges follows from the
observations it is given.

* **The engine's runs** (:class:`~zerosim.values.observe.RankObservation` per rank and the communication
  estimate of :func:`zerosim.cost.comm_model.comm_per_step`): each rank's data traffic per step, per
  group kind and collective (calls, bytes sent, bytes received), equals the ring model exactly (clause
  ``ring_model``); given the policy's reduce dtype, every gradient reduction moved that dtype (clause
  ``reduce_dtype``).
* **Live trainers**: per rank and step, the traffic summary ``zerosim verify`` counts at
  torch.distributed's collectives (bytes sent and received per traffic class under the ring
  attribution, and one record per collective call with its kind, class, group and the element dtype of
  the tensor it moved).

  ``ring_model`` (given a :class:`TrafficModel`): the bytes every rank *receives* per step, per
  traffic class, lie in the band of the declared strategy's communication model
  (:func:`zerosim.cost.comm_model.comm_per_step`), split into gradient reduction (all-reduce,
  reduce-scatter, reduce to an owner) and parameter exchange (all-gather, broadcast). Received bytes
  make a broadcast from each owner (ZeroRedundancyOptimizer) and an all-gather comparable: under both a
  rank receives every element it does not own. The band: at most the model with the trainer's padding;
  at least, per gradient reduction, the same collective on the unpadded gradient, and per parameter
  gather pass, the elements the rank does not store (a trainer that pads less than the model, or
  broadcasts whole tensors without padding, moves less). Below the band is a failure too: a ZeRO-3 that
  gathers once per step keeps whole parameters alive from forward to backward. Scalars (a gradient
  norm, a loss, an overflow flag) are control traffic, counted apart and not judged.

  Under a mixed-precision policy (:meth:`TrafficModel.under_policy`) the two classes have their own
  element sizes: a gradient reduction moves ``reduce_dtype`` elements; the gathers that feed forward and
  backward (ZeRO-3, FSDP) move ``param_dtype`` compute copies; the exchange after the optimizer step
  (ZeRO-1/2) may move the float32 masters (ZeroRedundancyOptimizer) or the ``param_dtype`` copies cast
  from them (DeepSpeed, FSDP2's ZeRO-2, zerogpu): its band spans both. A step the trainer skipped
  (fp16 overflow: the masters did not change) may exchange nothing after it.

  ``reduce_dtype`` (given ``reduce_dtype``): every gradient reduction moves elements of the dtype the
  run's policy names (the run's dtype in full precision; a mixed-precision policy's reduce dtype). A
  reduction in another dtype is a correctness failure, not an efficiency finding: bfloat16 where the
  policy says float32 loses precision that the parameters may not show, only the bytes do.

Why one module of this length: C-ZERO-005 is one check (:func:`check_communication`) whose clauses
share the traffic classes, the model values (:class:`TrafficModel`) and the band arithmetic that turns
them into expected bytes; split, the model values and the bytes they imply would live apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..cost.comm_model import comm_per_step
from ..values.layout import ParamLayout
from ..values.observe import RankObservation, StepObservation
from ..values.strategy import ShardingStrategy, StrategyKind, Topology
from ..values.verdict import Verdict
from .collect import ViolationCollector
from .holdings import as_layout, stored_numel, strategy_from_declared
from .judges import judges
from .mismatch import step_clauses, step_verdict

CONTRACT = "C-ZERO-005"
#: the judged traffic classes: gradient reduction and parameter exchange (``control`` is counted apart)
TRAFFIC_CLASSES = ("reduce", "gather")
REDUCE_COLLECTIVES = ("all_reduce", "reduce_scatter", "reduce")
GATHER_COLLECTIVES = ("all_gather", "broadcast")
#: bytes of one element of each dtype a trainer may move
ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
#: the strategies whose only parameter exchange follows the optimizer step (ZeRO-1/2): the updated
#: parameters, as masters or as compute copies
EXCHANGE_AFTER_STEP = (StrategyKind.SHARD_OPTIMIZER, StrategyKind.SHARD_GRAD_OP,
                       StrategyKind.HYBRID_SHARD_ZERO2)


def traffic_class(kind: str, numel: int) -> str:
    """``reduce`` (gradient reduction), ``gather`` (parameter exchange) or ``control`` (a scalar) for a
    collective of ``kind`` moving ``numel`` elements."""
    if numel <= 1:
        return "control"
    return "reduce" if kind in REDUCE_COLLECTIVES else "gather"


def traffic_band(
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
    """(least, most) of :func:`traffic_band` for one schedule of ``micro_batches`` micro-batches."""
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
    stored = stored_numel(layout, strategy, world, rank, partitioner)
    scalars = sum(1 for n in layout.numels() if n == 1)
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


@dataclass(frozen=True)
class TrafficModel:
    """What a live trainer declares for its counted traffic to be judged against: its strategy (as
    :func:`~zerosim.checks.holdings.strategy_from_declared` reads it), its model (a
    :class:`ParamLayout` or a module), the bytes of a parameter element on the wire (``param_bytes``)
    and of a gradient element (``grad_bytes``, default the same), the world size, its partition rule,
    how its ZeRO-1 reduces gradients, the traffic classes it cannot show (class -> why; not judged)
    and the micro-batches per optimizer step (the band of :func:`traffic_band` under accumulation).
    Under a mixed-precision policy (:meth:`under_policy`): ``master_bytes``, the bytes of a master
    element when the exchange after a ZeRO-1/2 step may move masters instead of ``param_bytes`` compute
    copies (the gather band spans both), and ``skipped_steps``, the global steps the trainer skipped
    (fp16 overflow), after which no exchange is required."""

    declared_strategy: str
    layout: Any
    param_bytes: int
    world: int
    grad_bytes: int | None = None
    partitioner: str | None = None
    zero1_grad_reduce: str = "all_reduce"
    unobserved: Mapping[str, str] | None = None
    micro_batches: int = 1
    master_bytes: int | None = None
    skipped_steps: frozenset[int] = frozenset()

    @classmethod
    def under_policy(
        cls,
        declared_strategy: str,
        layout: Any,
        world: int,
        policy: Mapping[str, Any],
        master_bytes: int = 4,
        *,
        skipped_steps: frozenset[int] = frozenset(),
        **options: Any,
    ) -> TrafficModel:
        """The model of a trainer under a mixed-precision ``policy`` (``{"param_dtype", "reduce_dtype"}``):
        gradient reductions move ``reduce_dtype`` elements, the gathers of ZeRO-3 / FSDP ``param_dtype``
        compute copies, and the exchange after a ZeRO-1/2 step either those or the ``master_bytes``
        masters (``master_bytes`` spans the band); ``skipped_steps``: the global steps the trainer
        skipped (no exchange after them is required)."""
        strategy = strategy_from_declared(declared_strategy)
        after_step = strategy.kind in EXCHANGE_AFTER_STEP
        return cls(declared_strategy, layout, ELEMENT_BYTES[str(policy["param_dtype"])], world,
                   grad_bytes=ELEMENT_BYTES[str(policy["reduce_dtype"])],
                   master_bytes=master_bytes if after_step else None,
                   skipped_steps=frozenset(skipped_steps), **options)


@judges(CONTRACT)
def check_communication(
    observations: Sequence[RankObservation] | Sequence[Sequence[Mapping[str, Any] | None]],
    model: Any = None,
    *,
    reduce_dtype: str | None = None,
    phase: str | None = None,
    first_step: int = 1,
    ranks: Sequence[int] | None = None,
) -> Verdict:
    """C-ZERO-005 (see the module docstring).

    The engine's runs: ``observations`` are :class:`~zerosim.values.observe.RankObservation` per rank and
    ``model`` the run's communication estimate (``ring_model``, exact); with ``reduce_dtype`` every
    gradient reduction must have moved that dtype.

    A live trainer: ``observations[r][i]`` is rank ``r``'s traffic summary at the ``i``-th step of
    ``phase`` (global step ``first_step + i``): ``{"reduce" | "gather" | "control": {"sent",
    "received"}}`` in bytes, with a ``"collectives"`` list of one record per collective call
    (``function``, ``kind``, ``class``, ``dtype``, ``payload_bytes``, ``group``; ``calls`` where one
    record stands for several calls); ``ranks[r]``: the rank the ``r``-th entry observed (default
    ``r``). Given a :class:`TrafficModel` the received bytes are judged against its band
    (``ring_model``; each violation names rank, step and class, in ``tensor``, with the band in
    ``expected_range``); given ``reduce_dtype`` every gradient reduction's dtype (``reduce_dtype``;
    each violation names the collective function, in ``tensor``, step, rank, the expected and the
    moved dtype; one per rank, step, function and dtype, with the number of such calls in ``calls``;
    a summary without records is not judged). Control traffic (scalars) and parameter exchange are
    not gradient reductions.
    """
    if model is not None and not isinstance(model, TrafficModel):
        return _engine_traffic(observations, model, reduce_dtype)  # type: ignore[arg-type]
    if model is None and reduce_dtype is None:
        raise ValueError("counted traffic is judged against a TrafficModel, a reduce dtype, or both")
    summaries: Sequence[Sequence[Mapping[str, Any] | None]] = observations  # type: ignore[assignment]
    verdict = None if model is None else _within_model(summaries, model, phase, first_step)
    if reduce_dtype is not None:
        dtypes = _reduce_dtype(summaries, reduce_dtype, phase=phase, first_step=first_step, ranks=ranks)
        if verdict is None:
            return dtypes
        verdict.extend(dtypes)
        verdict.details.update(dtypes.details)
    assert verdict is not None
    return verdict


def with_reduce_dtype(ring_model: Verdict, reduce_dtype: Sequence[Verdict]) -> Verdict:
    """C-ZERO-005's one verdict on a live trainer's run, from its two clauses judged apart: ``ring_model``
    per phase (``zerosim verify``'s resources, or skipped where no strategy was declared) and
    ``reduce_dtype`` per phase and step (once each phase's arithmetic dtype is known). A gradient
    reduction in another dtype fails the contract, listed first and named in the reason; without one
    the ``ring_model`` verdict stands as it is."""
    wrong = [v for verdict in reduce_dtype for v in verdict.violations]
    if not wrong:
        return ring_model
    note = f"{wrong[0].message} ({len(wrong)} rank/step/collective triples in another dtype)"
    if ring_model.status == "fail":
        note += f"; {ring_model.reason}"
    details = {k: v for k, v in ring_model.details.items() if k != "skipped"}
    return Verdict(CONTRACT, [*wrong, *ring_model.violations],
                   ring_model.checked + sum(v.checked for v in reduce_dtype), details, note=note)


def _within_model(
    per_rank_traffic: Sequence[Sequence[Mapping[str, Any] | None]], model: TrafficModel, phase: str | None,
    first_step: int,
) -> Verdict:
    """``ring_model`` on counted traffic: the bytes every rank receives per step, per traffic class, lie
    in the band of the declared strategy's communication model."""
    declared_strategy, layout, dtype_bytes, world = (model.declared_strategy, model.layout, model.param_bytes,
                                                     model.world)
    grad_bytes, partitioner, zero1_grad_reduce = model.grad_bytes, model.partitioner, model.zero1_grad_reduce
    unobserved, micro_batches = model.unobserved, model.micro_batches
    strategy = strategy_from_declared(declared_strategy)
    lay = as_layout(layout)
    after_step = strategy.kind in EXCHANGE_AFTER_STEP
    skip = dict(unobserved or {})
    out = ViolationCollector(CONTRACT)
    rows: list[dict[str, Any]] = []
    checked = 0
    for rank, steps in enumerate(per_rank_traffic):
        band = traffic_band(
            lay, strategy, world, rank, dtype_bytes, grad_bytes or dtype_bytes, partitioner,
            zero1_grad_reduce, micro_batches,
        )
        if model.master_bytes is not None and model.master_bytes != dtype_bytes:
            # the exchange after the step may move the masters instead of the compute copies
            masters = traffic_band(lay, strategy, world, rank, model.master_bytes, grad_bytes or dtype_bytes,
                                   partitioner, zero1_grad_reduce, micro_batches)["gather"]
            band["gather"] = (min(band["gather"][0], masters[0]), max(band["gather"][1], masters[1]))
        rows.append(
            {
                "rank": rank,
                "band": {c: [float(lo), float(hi)] for c, (lo, hi) in band.items()},
                "received": [
                    {c: float(s[c]["received"]) for c in (*TRAFFIC_CLASSES, "control")}  # type: ignore[index]
                    for s in steps
                ],
            }
        )
        for i, summary in enumerate(steps):
            for cls in TRAFFIC_CLASSES:
                if cls in skip:
                    continue
                checked += 1
                lo, hi = band[cls]
                if cls == "gather" and after_step and first_step + i in model.skipped_steps:
                    lo = Fraction(0)  # a skipped step changed no parameter: nothing to exchange after it
                got = Fraction(summary[cls]["received"])  # type: ignore[index]
                if lo <= got <= hi:
                    continue
                what = "gradient reduction" if cls == "reduce" else "parameter exchange"
                out.add(
                    "ring_model",
                    f"rank {rank} received {float(got):,.0f} bytes of {what} in step {first_step + i}; "
                    f"the {strategy.name} ring model allows {float(lo):,.0f} to {float(hi):,.0f}",
                    {"expected_range": [float(lo), float(hi)]},
                    phase=phase, step=first_step + i, ranks=(rank,), tensor=cls, expected=float(hi),
                    got=float(got), error=float(got) - float(hi), tolerance=0,
                )
    return out.verdict(
        checked=checked,
        strategy=strategy.name,
        partitioner=partitioner,
        param_bytes=dtype_bytes,
        grad_bytes=grad_bytes or dtype_bytes,
        master_bytes=model.master_bytes,
        zero1_grad_reduce=zero1_grad_reduce,
        micro_batches=micro_batches,
        ranks=rows,
    )


def _reduce_dtype(
    per_rank_traffic: Sequence[Sequence[Mapping[str, Any] | None]],
    expected_dtype: str,
    *,
    phase: str | None = None,
    first_step: int = 1,
    ranks: Sequence[int] | None = None,
) -> Verdict:
    """``reduce_dtype``: every gradient reduction of every rank and step moves ``expected_dtype``."""
    out = ViolationCollector(CONTRACT)
    checked = 0
    for index, steps in enumerate(per_rank_traffic):
        rank = index if ranks is None else ranks[index]
        for i, summary in enumerate(steps):
            records = (summary or {}).get("collectives")
            if records is None:
                continue
            wrong: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
            for rec in records:
                if rec.get("class") != "reduce":
                    continue
                checked += int(rec.get("calls", 1))
                if rec.get("dtype") != expected_dtype:
                    key = (str(rec.get("function")), str(rec.get("kind")), str(rec.get("dtype")))
                    wrong.setdefault(key, []).append(rec)
            for (function, kind, dtype), calls in wrong.items():
                count = sum(int(c.get("calls", 1)) for c in calls)
                moved = sum(int(c.get("payload_bytes", 0)) for c in calls)
                size = f", {moved:,} bytes" if moved else ""
                out.add(
                    "reduce_dtype",
                    f"rank {rank} reduced gradients in {dtype} in step {first_step + i} "
                    f"({count} {function} call(s){size}); the run's policy reduces in {expected_dtype}",
                    {"collective": kind, "calls": count, "dtype": dtype},
                    phase=phase, step=first_step + i, ranks=(rank,), tensor=function,
                    expected=expected_dtype, got=dtype,
                )
    return out.verdict(checked=checked, reduce_dtype=expected_dtype)


# ---- the engine's runs ----------------------------------------------------------------------------


def reduction_records(so: StepObservation) -> list[dict[str, Any]]:
    """The gradient reductions of one engine step as the ``reduce_dtype`` clause reads them: one record
    per (group, collective, dtype) of the data channel, with its call count."""
    out = []
    for t in so.data_traffic():
        if t.collective not in REDUCE_COLLECTIVES:
            continue
        for dtype, calls in sorted(t.dtypes.items()):
            out.append({"function": t.collective, "kind": t.collective, "class": "reduce", "dtype": dtype,
                        "calls": calls, "payload_bytes": t.payload_bytes if len(t.dtypes) == 1 else 0,
                        "group": t.group})
    return out


def _engine_traffic(observations: Sequence[RankObservation], estimate: Any,
                    reduce_dtype: str | None) -> Verdict:
    """The engine's runs: each rank's measured data traffic per step equals the ring model, per group
    kind and collective; with ``reduce_dtype``, every gradient reduction moved that dtype."""
    col = step_clauses(CONTRACT, {"strategy": estimate.strategy})
    expected = estimate.expected()
    checked = 0
    for obs in observations:
        for so in obs.steps:
            if reduce_dtype is not None:
                dtypes = _reduce_dtype([[{"collectives": reduction_records(so)}]], reduce_dtype,
                                            first_step=so.step, ranks=[obs.rank])
                checked += dtypes.checked
                for wrong in dtypes.violations:
                    col.add_violation(wrong)
            got = so.traffic_by_collective()
            keys = sorted(set(expected) | set(got))
            checked += max(1, len(keys))  # no traffic expected and none measured is a check too
            for key in keys:
                e = expected.get(key, (0, Fraction(0), Fraction(0)))
                g = got.get(key, (0, Fraction(0), Fraction(0)))
                if e != g:
                    what = "missing" if g[0] == 0 else ("unexpected" if e[0] == 0 else "differs")
                    col.add(
                        "ring_model",
                        f"{key[1]} on the {key[0]} group: traffic {what} (calls {g[0]} vs {e[0]} expected)",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected={"calls": e[0], "bytes_sent": float(e[1]), "bytes_received": float(e[2])},
                        got={"calls": g[0], "bytes_sent": float(g[1]), "bytes_received": float(g[2])},
                        context={"group_kind": key[0], "collective": key[1]},
                    )
    measured_total = [float(s.bytes_sent()) for o in observations[:1] for s in o.steps]
    v = step_verdict(col,
        model_bytes_sent_per_rank=float(estimate.bytes_sent),
        measured_bytes_sent_rank0=measured_total,
        paper_elements_per_rank=float(estimate.paper_elements()),
        padding_elements=estimate.padding,
    )
    v.checked = checked
    return v
