"""C-ZERO-002 on a monitored run (:mod:`zerosim.monitor`): what can be judged of the optimizer without an
unsharded reference beside it; the part of :func:`zerosim.checks.equivalence.check_step_equivalence`
that reads :class:`~zerosim.values.observe.MonitorObservation`.

Per check (one step), over the ranks' :class:`~zerosim.values.observe.MonitorObservation`:

* ``state_present``: every rank keeps optimizer state for every element it owns;
* ``state_finite``: every state value is finite;
* ``step_counter``: every owned tensor's optimizer step counter is the same, on every rank (the rank
  outside the majority is named; with no majority, as with two ranks, the ranks are said to disagree);
* ``grad_norm``: every rank logged the same global gradient norm (the rank outside the majority is
  named), and the gradient norm each rank logged equals the norm recomputed from the reduced
  gradient's shards (each element counted once: the shards of the ranks whose gradient ranges are
  disjoint, lowest rank first), within :func:`norm_relative_bound` of the logged norm's dtype plus
  that of the recomputation's accumulation (:func:`norm_accumulation`).
  With ``max_norm`` the recomputed norm is that of the clipped gradient, so the logged norm is scaled
  by torch's clip coefficient ``min(1, max_norm / (norm + 1e-6))`` first;
* ``grad_accounting``: the consumed gradient is the mean of the ranks' local gradients times one clip
  coefficient, tensor by tensor (:mod:`zerosim.checks.grad_accounting`);
* ``update``: each rank's step equals its optimizer's formula on sampled elements
  (:mod:`zerosim.checks.update_formula`);
* ``replay``: each rank's contributed local gradient is the one its computation gives again, a
  mismatch classified ``transient`` or ``persistent`` (:mod:`zerosim.checks.replay`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..values.observe import MonitorObservation
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .grad_accounting import accounting_violations
from .replay import replay_violations
from .rounding import UNIT_ROUNDOFF, gamma
from .tolerance import norm_accumulation, norm_relative_bound
from .update_formula import update_violations

CONTRACT = "C-ZERO-002"
CLAUSES = ("state_present", "state_finite", "step_counter", "grad_norm", "grad_accounting", "update",
           "replay")
#: torch's clip_grad_norm_ adds this to the norm before dividing max_norm by it
CLIP_EPS = 1e-6


def norm_contributors(observations: Sequence[MonitorObservation]) -> list[int]:
    """The ranks whose gradient ranges (``grad_ranges``, else the owned ranges) are summed for the
    recomputed norm: lowest rank first, each rank whose ranges meet no earlier contributor's (one
    replica of every shard; every rank where a replicated gradient is split among them)."""
    taken: dict[str, list[tuple[int, int]]] = {}
    out = []
    for obs in sorted(observations, key=lambda o: o.rank):
        summed = obs.grad_ranges if obs.grad_ranges is not None else obs.owned
        if any(a < d and c < b for name, ranges in summed.items() for a, b in ranges
               for c, d in taken.get(name, ())):
            continue
        out.append(obs.rank)
        for name, ranges in summed.items():
            taken.setdefault(name, []).extend(ranges)
    return out


def _monitor_state(observations: Sequence[MonitorObservation]) -> Verdict:
    """C-ZERO-002's live clauses (see the module docstring) on every step the observations hold."""
    out = ViolationCollector(CONTRACT, total=MAX_LISTED)
    by_step: dict[int, list[MonitorObservation]] = {}
    for obs in observations:
        by_step.setdefault(obs.step, []).append(obs)
    checked = 0
    max_error = accounting = update = 0.0
    replayed = 0
    for step in sorted(by_step):
        rows = sorted(by_step[step], key=lambda o: o.rank)
        checked += len(rows)
        for obs in rows:
            count, first = obs.state_missing
            if count:
                out.add("state_present", f"rank {obs.rank} keeps no optimizer state for owned elements "
                        f"of {count} tensor(s)", step=step, ranks=(obs.rank,), tensor=first)
            count, first = obs.state_nonfinite
            if count:
                out.add("state_finite", f"rank {obs.rank} holds non-finite optimizer state in {count} "
                        "tensor(s)", step=step, ranks=(obs.rank,), tensor=first)
        _step_counters(rows, step, out)
        max_error = max(max_error, _grad_norm(rows, step, out))
        accounting = max(accounting, accounting_violations(rows, step, out))
        update = max(update, update_violations(rows, step, out))
        replayed += replay_violations(rows, step, out)
    return out.listed_verdict(checked=checked, steps=len(by_step), max_grad_norm_error=max_error,
                              grad_accounting_ratio=accounting, update_ratio=update, replayed=replayed)


def _step_counters(rows: list[MonitorObservation], step: int, out: ViolationCollector) -> None:
    counted = [o for o in rows if o.step_counters is not None]
    for obs in counted:
        low, high, name = obs.step_counters  # type: ignore[misc]
        if low != high:
            out.add("step_counter", f"rank {obs.rank}'s owned tensors have step counters from {low} to "
                    f"{high}", step=step, ranks=(obs.rank,), tensor=name, expected=high, got=low)
    values: dict[int, list[int]] = {}
    for obs in counted:
        values.setdefault(obs.step_counters[1], []).append(obs.rank)  # type: ignore[index]
    if len(values) < 2:
        return
    sizes = sorted((len(r) for r in values.values()), reverse=True)
    if sizes[0] == sizes[1]:  # no majority: the ranks disagree, none is named
        ranks = sorted(r for members in values.values() for r in members)
        out.add("step_counter", f"ranks {', '.join(map(str, ranks))} disagree on the optimizer step counter ("
                + "; ".join(f"rank(s) {','.join(map(str, m))}: {v}" for v, m in sorted(values.items())) + ")",
                step=step, ranks=tuple(ranks), tensor=counted[0].step_counters[2])  # type: ignore[index]
        return
    majority = max(values, key=lambda v: (len(values[v]), -min(values[v])))
    for value, ranks in sorted(values.items()):
        if value == majority:
            continue
        for rank in ranks:
            name = next(o.step_counters[2] for o in counted if o.rank == rank)  # type: ignore[index]
            out.add("step_counter", f"rank {rank}'s optimizer step counter is {value}, rank(s) "
                    f"{','.join(map(str, values[majority]))} count {majority}",
                    step=step, ranks=(rank,), tensor=name, expected=majority, got=value)


def _same_logged_norm(logged: list[MonitorObservation], step: int, out: ViolationCollector) -> None:
    """Every rank logs the one global norm: within two norms' rounding of the value most ranks logged."""
    values: dict[float, list[int]] = {}
    for obs in logged:
        values.setdefault(float(obs.grad_norm), []).append(obs.rank)  # type: ignore[arg-type]
    if len(values) < 2:
        return
    majority = max(values, key=lambda v: (len(values[v]), -min(values[v])))
    n = max(o.grad_numel for o in logged) * len(logged)
    rel = 2 * norm_relative_bound(n, logged[0].grad_dtype)
    differ = {value: ranks for value, ranks in values.items()
              if not (value == majority or (math.isfinite(value) and math.isfinite(majority) and
                                            abs(value - majority) <= rel * max(abs(value), abs(majority))))}
    if not differ:
        return
    if any(len(ranks) == len(values[majority]) for ranks in differ.values()):  # no majority: none named
        ranks = sorted(r for members in (values[majority], *differ.values()) for r in members)
        shown = "; ".join(f"rank(s) {','.join(map(str, m))}: {v!r}"
                          for v, m in sorted(((majority, values[majority]), *differ.items()),
                                             key=lambda kv: min(kv[1])))
        out.add("grad_norm", f"ranks {', '.join(map(str, ranks))} disagree on the logged gradient norm "
                f"({shown})", step=step, ranks=tuple(ranks))
        return
    for value, ranks in sorted(differ.items(), key=lambda kv: min(kv[1])):
        for rank in ranks:
            out.add("grad_norm", f"rank {rank} logged gradient norm {value!r}, rank(s) "
                    f"{','.join(map(str, values[majority]))} logged {majority!r}",
                    step=step, ranks=(rank,), expected=majority, got=value)


def _grad_norm(rows: list[MonitorObservation], step: int, out: ViolationCollector) -> float:
    """Compare each logged norm with the recomputed one; the largest relative difference seen."""
    logged = [o for o in rows if o.grad_norm is not None]
    if not logged:
        return 0.0
    _same_logged_norm(logged, step, out)
    contributors = set(norm_contributors(rows))
    parts = [o for o in rows if o.rank in contributors]
    if any(o.grad_sq is None for o in parts):
        return 0.0  # a contributing rank held no gradient (freed before the check): nothing to compare
    n = sum(o.grad_numel for o in parts)
    recomputed = math.sqrt(sum(o.grad_sq for o in parts))  # type: ignore[misc]
    # each part's pieces' norms were accumulated in norm_accumulation(its gradient's dtype)
    recomputed_bound = max(norm_relative_bound(n, norm_accumulation(o.grad_dtype)) for o in parts)
    worst = 0.0
    for obs in logged:
        norm = float(obs.grad_norm)  # type: ignore[arg-type]
        u = UNIT_ROUNDOFF.get(obs.grad_dtype, UNIT_ROUNDOFF["float32"])
        rel = (norm_relative_bound(n, obs.grad_dtype) + recomputed_bound
               + gamma(n + len(parts) + 2, UNIT_ROUNDOFF["float64"]))
        expected = norm
        if obs.max_norm is not None and math.isfinite(norm):
            coef = min(1.0, obs.max_norm / (norm + CLIP_EPS))
            if coef < 1.0:
                expected = norm * coef
                rel += 3 * u  # the coefficient's rounding and each element's scaled rounding
        if not (math.isfinite(expected) and math.isfinite(recomputed)):
            if math.isfinite(expected) != math.isfinite(recomputed):
                out.add("grad_norm", f"rank {obs.rank} logged gradient norm {norm!r}, recomputed "
                        f"from the shards {recomputed!r}", step=step, ranks=(obs.rank,),
                        expected=recomputed, got=norm)
            continue
        err = abs(expected - recomputed)
        allowed = rel * max(expected, recomputed)
        worst = max(worst, err / recomputed if recomputed else err)
        if err > allowed:
            out.add("grad_norm", f"rank {obs.rank} logged gradient norm {norm!r}"
                    + (f" (clipped to {expected!r})" if expected != norm else "")
                    + f", recomputed from the shards of ranks {sorted(contributors)} {recomputed!r}"
                    + _likely_cause(norm, recomputed, obs.max_norm),
                    step=step, ranks=(obs.rank,), expected=recomputed, got=expected, error=err,
                    tolerance=allowed)
    return worst


def _likely_cause(logged: float, recomputed: float, max_norm: float | None) -> str:
    """The usual reason a logged norm exceeds the norm of the gradient the optimizer stepped with: the
    loop clips, so the gradient read is the clipped one while the logged norm is the one before clipping,
    and the monitor was given no ``max_norm`` to undo it with. Empty when the figures do not fit that."""
    if max_norm is not None or not logged > recomputed > 0:
        return ""
    return (f"; the logged norm is the larger: if the loop clips (clip_grad_norm_ to about "
            f"{recomputed:.3g}), the logged norm is the pre-clip norm and the gradient the clipped one: pass "
            "the threshold as Monitor(..., max_grad_norm=...)")
