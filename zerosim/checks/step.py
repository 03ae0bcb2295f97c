"""Step contracts C-ZERO-004 and C-ZERO-005 on the engine's runs: pure functions from observations to
verdicts.

Inputs are plain data: :class:`~zerosim.observe.RankObservation` lists (intervals, holdings, memory
and traffic counters), the plan and the communication estimate. No backend, no live array.
(C-ZERO-002 is :mod:`zerosim.checks.equivalence`, C-ZERO-003 :mod:`zerosim.checks.identity`.)

* C-ZERO-004 holdings (:func:`check_holdings`): what each rank holds (measured from its live
  arrays) is exactly the plan's intervals, with the engine's packing padding, at the right bytes;
  the memory tracker agrees; transient buffers are freed at the end of the step; under ZeRO-3 the
  peak of live parameter bytes stays within the shard plus ``(1 + prefetch)`` gathered units.
* C-ZERO-005 communication (:func:`check_communication`): each rank's data traffic per step, per
  group kind and collective (calls, bytes sent, bytes received), equals the ring model exactly; and,
  given the policy's reduce dtype, every gradient reduction moved that dtype (clause ``reduce_dtype``,
  judged by :func:`zerosim.checks.traffic.check_reduce_dtype`, the function ``zerosim verify`` uses).

Diagnostics name contract, clause, step, rank, tensor, flat element range, expected vs got.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..dtypes import itemsize
from ..intervals import first_difference
from ..layout import ParamLayout
from ..observe import RankObservation, StepObservation
from ..verdict import Verdict
from .mismatch import step_clauses, step_verdict, tensor_at
from .traffic import REDUCE_COLLECTIVES, check_reduce_dtype

# ---------------------------------------------------------------------------------------------------
# C-ZERO-004 holdings
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnershipExpectation:
    """What the plan says a rank must hold, and the byte rules of the run (built by the engine's evaluate)."""

    plan: Any                 # zerosim.plan.StatePlan
    padding: dict[str, list[int]]  # kind -> per-rank padding the engine's packing stores
    bytes_per_element: dict[str, int]  # kind -> bytes per stored element summed over arrays of that kind
    peak_live_param_bound: list[int] | None = None  # per rank (sharded params only)
    prefetch: int = 0


def check_holdings(observations: Sequence[RankObservation], expect: OwnershipExpectation, *,
                   layout: ParamLayout | None = None, contract: str = "C-ZERO-004") -> Verdict:
    """C-ZERO-004: what each rank holds matches the plan; memory accounting agrees; transients freed;
    the ZeRO-3 peak bound holds."""
    col = step_clauses(contract)
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


# ---------------------------------------------------------------------------------------------------
# C-ZERO-005 communication
# ---------------------------------------------------------------------------------------------------


def reduction_records(so: StepObservation) -> list[dict[str, Any]]:
    """The gradient reductions of one engine step as :func:`~zerosim.checks.traffic.check_reduce_dtype`
    reads them: one record per (group, collective, dtype) of the data channel, with its call count."""
    out = []
    for t in so.data_traffic():
        if t.collective not in REDUCE_COLLECTIVES:
            continue
        for dtype, calls in sorted(t.dtypes.items()):
            out.append({"function": t.collective, "kind": t.collective, "class": "reduce", "dtype": dtype,
                        "calls": calls, "payload_bytes": t.payload_bytes if len(t.dtypes) == 1 else 0,
                        "group": t.group})
    return out


def check_communication(observations: Sequence[RankObservation], estimate: Any, *,
                        contract: str = "C-ZERO-005", reduce_dtype: str | None = None) -> Verdict:
    """Each rank's measured data traffic per step equals the ring model, per group kind and collective;
    with ``reduce_dtype``, every gradient reduction moved that dtype."""
    col = step_clauses(contract, {"strategy": estimate.strategy})
    expected = estimate.expected()
    checked = 0
    for obs in observations:
        for so in obs.steps:
            if reduce_dtype is not None:
                dtypes = check_reduce_dtype([[{"collectives": reduction_records(so)}]], reduce_dtype,
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


def itemsizes(precision: Any) -> dict[str, int]:
    """Bytes per element of the working params and of float32 state."""
    return {"params": itemsize(precision.param_dtype), "float32": 4}

