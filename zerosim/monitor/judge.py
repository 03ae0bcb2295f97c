"""The verdicts of a monitored run's observations: the same contract checks for the live monitor (every
rank, after each check's all-gather) and for ``zerosim check trace`` (the per-rank files afterwards).

* C-ZERO-001: :func:`zerosim.checks.owned_intervals.check_owned_intervals` on the owned ranges;
* C-ZERO-002 (live clauses): :func:`zerosim.checks.live_state.check_live_state`;
* C-ZERO-003: :func:`zerosim.checks.identity.check_replica_identity` on the held pieces' digests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..checks.collect import MAX_LISTED, ViolationCollector
from ..checks.identity import check_replica_identity
from ..checks.live_state import check_live_state
from ..checks.owned_intervals import check_owned_intervals
from ..observe import MonitorObservation
from ..verdict import Verdict

CONTRACTS = ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003")


def check_layout(observations: Sequence[MonitorObservation]) -> Verdict:
    """C-ZERO-001 on the owned ranges of every step, by interval arithmetic (each distinct layout judged
    once)."""
    by_step: dict[int, list[MonitorObservation]] = {}
    for obs in observations:
        by_step.setdefault(obs.step, []).append(obs)
    numels: dict[str, int] = {}
    for obs in observations:
        numels.update(obs.numels)
    out = ViolationCollector("C-ZERO-001", total=MAX_LISTED)
    seen: set[Any] = set()
    layouts: list[str] = []
    checked: dict[str, int] = {"elements": 0, "ranges": 0}
    for step, rows in sorted(by_step.items()):
        owned = {o.rank: o.owned for o in rows}
        key = tuple((r, tuple((n, tuple(map(tuple, v))) for n, v in sorted(owned[r].items())))
                    for r in sorted(owned))
        if key in seen:
            continue
        seen.add(key)
        verdict, layout = check_owned_intervals(owned, numels, step=step, out=out)
        layouts.append(layout)
        checked = {k: max(checked[k], verdict.details[k]) for k in checked}
    return out.listed_verdict(checked=len(layouts), layouts=layouts, **checked)


def judge(observations: Sequence[MonitorObservation], layout: Verdict | None = None,
          identity: Verdict | None = None) -> list[Verdict]:
    """The three verdicts, in contract order; ``layout``: C-ZERO-001's verdict already computed for these
    observations' layout (the live monitor judges a layout once, when it first sees it); ``identity``:
    C-ZERO-003's, already computed (the live monitor compares digests vectorised first)."""
    return [layout if layout is not None else check_layout(observations),
            check_live_state(observations),
            identity if identity is not None else check_replica_identity(observations)]


def summary_line(step: int | None, verdicts: Sequence[Verdict]) -> str:
    """One line: each contract's outcome and how much it looked at."""
    parts = []
    for v in verdicts:
        count = v.details.get("violation_count", len(v.violations))
        parts.append(f"{v.contract} {v.outcome}" + (f" ({count} violation(s))" if count else "")
                     + f" [{v.checked} checked]")
    where = "" if step is None else f"step {step}: "
    return where + ", ".join(parts)
