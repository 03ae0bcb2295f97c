"""Contract checks: pure functions from observations (plans, arrays, counters) to a Verdict.

Each contract's spec file in ``contracts/`` names its check by dotted path
(``zerosim.checks.partition:check_partition_plan`` for C-ZERO-001).
"""

from __future__ import annotations

from .partition import check_partition_plan, check_state_plan

__all__ = ["check_partition_plan", "check_state_plan"]
