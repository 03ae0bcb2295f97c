"""The verdicts of a monitored run's observations: the same contract checks for the live monitor (every
rank, after each check's all-gather) and for ``zerosim check trace`` (the per-rank files afterwards).

* C-ZERO-001: :func:`zerosim.checks.partition.check_partition_plan` on the owned ranges (an interval
  sweep, each distinct layout judged once);
* C-ZERO-002 (live clauses): :func:`zerosim.checks.equivalence.check_step_equivalence`;
* C-ZERO-003: :func:`zerosim.checks.identity.check_replica_identity` on the held pieces' digests.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..checks.contracts import STEP_CONTRACTS
from ..checks.judges import judge as judge_contract
from ..values.observe import MonitorObservation
from ..values.verdict import Verdict

#: the step contracts a monitored run is judged by: the plan, the values and the replicas (a monitored
#: framework declares no strategy, so memory and traffic have no model to be compared with)
CONTRACTS = STEP_CONTRACTS[:3]


def judge(observations: Sequence[MonitorObservation], layout: Verdict | None = None,
          identity: Verdict | None = None) -> list[Verdict]:
    """The three verdicts, in contract order; ``layout``: C-ZERO-001's verdict already computed for these
    observations' layout (the live monitor judges a layout once, when it first sees it); ``identity``:
    C-ZERO-003's, already computed (the live monitor compares digests vectorised first)."""
    return [layout if layout is not None else judge_contract("C-ZERO-001", observations),
            judge_contract("C-ZERO-002", observations),
            identity if identity is not None else judge_contract("C-ZERO-003", observations)]


def summary_line(step: int | None, verdicts: Sequence[Verdict]) -> str:
    """One line: each contract's outcome and how much it looked at."""
    parts = []
    for v in verdicts:
        count = v.details.get("violation_count", len(v.violations))
        parts.append(f"{v.contract} {v.outcome}" + (f" ({count} violation(s))" if count else "")
                     + f" [{v.checked} checked]")
    where = "" if step is None else f"step {step}: "
    return where + ", ".join(parts)
