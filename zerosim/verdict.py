"""Verdicts: what a contract check returns. Pure data, the same for every backend.

A check is a pure function from observations (plans, arrays, counters) to a ``Verdict``. Each
``Violation`` carries what a person needs to find the bug: contract id, clause, step, rank(s),
tensor, flat element range, expected vs got.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .terminal_text import printable


@dataclass(frozen=True)
class Violation:
    contract: str
    clause: str
    message: str
    step: int | None = None
    ranks: tuple[int, ...] = ()
    tensor: str | None = None
    interval: tuple[int, int] | None = None  # flat [start, end)
    expected: Any = None
    got: Any = None
    context: dict[str, Any] = field(default_factory=dict)
    #: the optimizer phase of a live trainer's run ("sgd" | "adamw"); None for the engine's runs
    phase: str | None = None
    #: the measured error and the bound it exceeded, where the clause has a tolerance
    error: float | None = None
    tolerance: float | None = None

    def __str__(self) -> str:
        parts = [self.contract, self.clause]
        if self.phase is not None:
            parts.append(f"phase={self.phase}")
        if self.context:
            parts += [f"{k}={v}" for k, v in self.context.items()]
        if self.step is not None:
            parts.append(f"step={self.step}")
        if self.ranks:
            parts.append("rank=" + ",".join(map(str, self.ranks)))
        if self.tensor is not None:
            parts.append(f"tensor={self.tensor}")
        if self.interval is not None:
            parts.append(f"range=[{self.interval[0]}, {self.interval[1]})")
        if self.expected is not None or self.got is not None:
            parts.append(f"expected={self.expected!r} got={self.got!r}")
        if self.error is not None or self.tolerance is not None:
            parts.append(f"error={self.error!r} tolerance={self.tolerance!r}")
        # names and messages carry text from the run (tensor names): escaped so a terminal shows it
        return printable(" ".join(parts) + f": {self.message}")

    def to_json(self) -> dict[str, Any]:
        out = {
            "contract": self.contract, "clause": self.clause, "message": self.message, "step": self.step,
            "ranks": list(self.ranks), "tensor": self.tensor,
            "interval": list(self.interval) if self.interval else None,
            "expected": _jsonable(self.expected), "got": _jsonable(self.got),
            "context": {k: _jsonable(v) for k, v in self.context.items()},
        }
        for key in ("phase", "error", "tolerance"):  # only where the check set them
            if getattr(self, key) is not None:
                out[key] = _jsonable(getattr(self, key))
        return out


#: a verdict's outcome: no violation, a violation, or no violation up to the step where the reference
#: the check compares against went non-finite (the steps after it were not compared)
OUTCOMES = ("pass", "fail", "diverged")


@dataclass
class Verdict:
    contract: str
    violations: list[Violation] = field(default_factory=list)
    checked: int = 0  # how many things (ranks, steps, tensors, plans) the check looked at
    details: dict[str, Any] = field(default_factory=dict)
    #: the 0-based step at which the reference went non-finite (loss or state); steps from it on were
    #: not compared. Not a violation: ``passed`` stays true when nothing before it was violated.
    diverged_at: int | None = None

    @property
    def passed(self) -> bool:
        return not self.violations

    @property
    def outcome(self) -> str:
        """"fail" (a violation), "diverged" (none, but the comparison stopped where the reference went
        non-finite) or "pass"."""
        if self.violations:
            return "fail"
        return "diverged" if self.diverged_at is not None else "pass"

    def extend(self, other: Verdict) -> None:
        self.violations.extend(other.violations)
        self.checked += other.checked
        if other.diverged_at is not None:
            self.diverged_at = (
                other.diverged_at if self.diverged_at is None else min(self.diverged_at, other.diverged_at)
            )

    def to_json(self) -> dict[str, Any]:
        return {"contract": self.contract, "passed": self.passed, "outcome": self.outcome,
                "diverged_at": self.diverged_at, "checked": self.checked,
                "violations": [v.to_json() for v in self.violations],
                "details": {k: _jsonable(v) for k, v in self.details.items()}}


def _jsonable(v: Any) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    try:
        return float(v)
    except (TypeError, ValueError):
        return repr(v)
