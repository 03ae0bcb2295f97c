"""What a monitored run keeps of its checks: each rank's observation line, rank 0's log lines, the notes
and the JSON summary (:class:`RunRecords`, the part of :class:`~zerosim.monitor.Monitor` that records)."""

from __future__ import annotations

from typing import Any

from ..values.observe import MonitorObservation
from ..values.verdict import Verdict, Violation
from .judge import CONTRACTS, summary_line
from .trace import append_line

#: violations (and skipped checks) kept in the JSON summary (the rest are counted)
SUMMARY_LISTED = 50


class RunRecords:
    """Appends observations, logs verdicts, keeps notes and builds the summary of a
    :class:`~zerosim.monitor.Monitor` (whose attributes these methods read)."""

    _trace: Any
    _own_log: Any
    _log: Any
    rank: int
    violations: list[Violation]
    violation_count: int
    notes: list[str]
    adapter: str
    every: Any
    checks: int
    steps: list[int]
    skipped_count: int
    skipped: list[dict[str, Any]]
    seconds: float
    enabled: bool
    off_reason: str | None

    # ---- what the run keeps ---------------------------------------------------------------------------
    def _record(self, mine: MonitorObservation, elapsed: float) -> None:
        """Append this rank's observation; a failed write is one line on this rank, once, and no more."""
        if self._trace is None:
            return
        try:
            append_line(self._trace, {**mine.to_json(), "monitor_s": elapsed})
        except OSError as err:
            self._own_log(f"zerosim.monitor: rank {self.rank} cannot append to {self._trace}: "
                          f"{err.strerror or err}; its observation file is not written any more, the "
                          f"checks go on")
            self._trace = None

    def _report(self, step: int, verdicts: list[Verdict], found: list[Violation], elapsed: float) -> None:
        self.violation_count += sum(v.details.get("violation_count", len(v.violations)) for v in verdicts)
        self.violations.extend(found[: max(0, SUMMARY_LISTED - len(self.violations))])
        self._log(f"zerosim.monitor {summary_line(step, verdicts)}; {elapsed * 1e3:.1f} ms")
        for v in found[:5]:
            self._log(f"zerosim.monitor violation: {v}")

    def _note(self, text: str) -> None:
        """Keep ``text`` for the summary and log it, once per run."""
        if text not in self.notes:
            self.notes.append(text)
            self._log(f"zerosim.monitor note: {text}")

    def summary(self) -> dict[str, Any]:
        """What the run's checks found so far (the JSON summary's content)."""
        by_contract = dict.fromkeys(CONTRACTS, 0)
        for v in self.violations:
            by_contract[v.contract] = by_contract.get(v.contract, 0) + 1
        return {"adapter": self.adapter, "world_size": getattr(self, "world", None), "every": self.every,
                "checks": self.checks,
                "steps_checked": [self.steps[0], self.steps[-1]] if self.steps else None,
                "passed": self.violation_count == 0, "violation_count": self.violation_count,
                "listed_by_contract": by_contract, "violations": [v.to_json() for v in self.violations],
                "skipped_count": self.skipped_count, "skipped": list(self.skipped),
                "monitor_seconds": self.seconds, "enabled": self.enabled, "off_reason": self.off_reason,
                "notes": list(self.notes), "step_checks_off": getattr(self, "step_checks_off", None)}

