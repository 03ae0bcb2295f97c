"""The one violation collector every contract check fills: it builds each
:class:`~zerosim.values.verdict.Violation`, keeps at most ``per_clause`` of each clause and at most ``total``
in all, and counts the rest, so a check that finds a million bad elements still returns a verdict a person can
read.

Every check in :mod:`zerosim.checks` (C-ZERO-001..007) reports through it; what a verdict does not
list is counted in its details (:meth:`ViolationCollector.not_listed_by_clause`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..values.verdict import Verdict, Violation

#: violations a live trainer's verdict lists in all (``zerosim verify``); the rest are counted in its details
MAX_LISTED = 64


class ViolationCollector:
    """Collects one contract's violations, with ``context`` attached to each (a call's own context is
    merged over it). ``per_clause`` caps the violations kept of one clause, ``total`` those kept in all,
    ``per_rank`` those kept of one clause naming the same first rank (None: no cap); ``count`` and
    ``per_clause_count`` count every finding, kept or not."""

    def __init__(self, contract: str, context: dict[str, Any] | None = None, *,
                 per_clause: int | None = None, total: int | None = None, per_rank: int | None = None):
        self.contract = contract
        self.context = dict(context or {})
        self.per_clause = per_clause
        self.total = total
        self.per_rank = per_rank
        self.violations: list[Violation] = []
        self.per_clause_count: dict[str, int] = {}
        self.per_rank_count: dict[tuple[int | None, str], int] = {}
        self.count = 0

    def _keeps(self, clause: str) -> bool:
        seen = self.per_clause_count.get(clause, 0)
        kept_of_clause = seen < self.per_clause if self.per_clause is not None else True
        return kept_of_clause and (self.total is None or len(self.violations) < self.total)

    def add(self, clause: str, message: str, context: dict[str, Any] | None = None, **fields: Any) -> None:
        """Count one finding of ``clause``; keep it as a Violation when the caps allow."""
        ranks = fields.get("ranks") or (None,)
        key = (ranks[0], clause)
        self.per_rank_count[key] = self.per_rank_count.get(key, 0) + 1
        if self._keeps(clause) and (self.per_rank is None or self.per_rank_count[key] <= self.per_rank):
            ctx = {**self.context, **(context or {})}
            self.violations.append(Violation(self.contract, clause, message, context=ctx, **fields))
        self.per_clause_count[clause] = self.per_clause_count.get(clause, 0) + 1
        self.count += 1

    def add_violation(self, violation: Violation) -> None:
        """Count one finding already built (another contract's, re-labelled); keep it if the caps allow."""
        if self._keeps(violation.clause):
            self.violations.append(violation)
        self.per_clause_count[violation.clause] = self.per_clause_count.get(violation.clause, 0) + 1
        self.count += 1

    def add_first(self, clause: str, count: int, make: Callable[[int], tuple[str, dict[str, Any]]]) -> None:
        """Count ``count`` findings of ``clause``; build (``make(i)`` -> message, fields) only those kept."""
        for i in range(count):
            if not self._keeps(clause):
                break
            message, fields = make(i)
            self.violations.append(Violation(self.contract, clause, message, context=dict(self.context),
                                             **fields))
            self.per_clause_count[clause] = self.per_clause_count.get(clause, 0) + 1
            count -= 1
            self.count += 1
        self.per_clause_count[clause] = self.per_clause_count.get(clause, 0) + count
        self.count += count

    def set_count(self, clause: str, count: int) -> None:
        """Record that ``clause`` had ``count`` findings in all (those kept included)."""
        self.count += count - self.per_clause_count.get(clause, 0)
        self.per_clause_count[clause] = count

    @property
    def not_listed(self) -> int:
        """Findings counted but not kept."""
        return self.count - len(self.violations)

    def not_listed_by_clause(self) -> dict[str, int]:
        kept: dict[str, int] = {}
        for v in self.violations:
            kept[v.clause] = kept.get(v.clause, 0) + 1
        return {c: n - kept.get(c, 0) for c, n in self.per_clause_count.items() if n > kept.get(c, 0)}

    def verdict(self, checked: int = 0, **details: Any) -> Verdict:
        """The Verdict of what was collected, with ``details``."""
        return Verdict(self.contract, list(self.violations), checked=checked, details=details)

    def listed_verdict(self, checked: int = 0, **details: Any) -> Verdict:
        """The Verdict with its listing counted in ``details``: ``violations_not_listed`` (findings not
        kept, where any) and ``violation_count`` (every finding)."""
        if self.not_listed:
            details["violations_not_listed"] = self.not_listed
        details["violation_count"] = self.count
        return self.verdict(checked, **details)
