"""Verdicts: what a contract check returns and every report shows. Pure data, the same for every backend.

A check is a pure function from observations (plans, arrays, counters) to a ``Verdict``. Each
``Violation`` carries what a person needs to find the bug: contract id, clause, step, rank(s),
tensor, flat element range, expected vs got. The simulator, ``zerosim verify``, the monitor and the
benchmarks all report this one type; :meth:`Violation.to_json` is the one JSON shape of a violation
(docs/verify.md, "The JSON report") and a violation reads as that mapping too (``v["rank"]``,
``v.get("clause")``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..files.terminal_text import printable

#: the keys of a violation's JSON that are its fields; every other key is the check's context
_CORE_KEYS = ("contract", "phase", "step", "rank", "ranks", "tensor", "start", "stop", "expected", "got",
              "error", "tolerance", "message", "clause")


@dataclass(frozen=True)
class Violation(Mapping[str, Any]):
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
        """The one JSON shape of a violation (C-ZERO-001..008 alike): ``contract``, ``phase``, ``step``,
        ``rank`` (the first rank concerned), ``ranks`` (all of them), ``tensor``, ``start`` / ``stop``
        (the half-open flat element range), ``expected``, ``got``, ``error``, ``tolerance``,
        ``message``, ``clause``, then the check's own context (``state``, ...) as further keys."""
        return dict(self._json)

    @cached_property
    def _json(self) -> dict[str, Any]:
        start, stop = self.interval if self.interval is not None else (None, None)
        out: dict[str, Any] = {
            "contract": self.contract, "phase": self.phase, "step": self.step,
            "rank": self.ranks[0] if self.ranks else None, "ranks": list(self.ranks), "tensor": self.tensor,
            "start": start, "stop": stop, "expected": _jsonable(self.expected), "got": _jsonable(self.got),
            "error": _jsonable(self.error), "tolerance": _jsonable(self.tolerance), "message": self.message,
            "clause": self.clause,
        }
        out.update({str(k): _jsonable(v) for k, v in self.context.items()})
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Violation:
        """The violation :meth:`to_json` wrote (``to_json(from_json(d)) == d``)."""
        rank = data.get("rank")
        listed = list(data.get("ranks") or ())
        ranks = tuple(listed) if listed[:1] == [rank] else ((rank,) if rank is not None else ())
        context = {k: v for k, v in data.items() if k not in _CORE_KEYS}
        if listed and list(ranks) != listed:  # the check's own "ranks" (the field holds the first only)
            context["ranks"] = listed
        start, stop = data.get("start"), data.get("stop")
        return cls(str(data.get("contract", "")), str(data.get("clause", "")), str(data.get("message", "")),
                   step=data.get("step"), ranks=ranks, tensor=data.get("tensor"),
                   interval=None if start is None or stop is None else (int(start), int(stop)),
                   expected=data.get("expected"), got=data.get("got"), context=context,
                   phase=data.get("phase"), error=data.get("error"), tolerance=data.get("tolerance"))

    # read as its JSON mapping: a report's consumers look violations up by key
    def __getitem__(self, key: str) -> Any:
        return self._json[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._json)

    def __len__(self) -> int:
        return len(self._json)

    def __bool__(self) -> bool:
        return True


#: a verdict's outcome: no violation, a violation, or no violation up to the step where the reference
#: the check compares against went non-finite (the steps after it were not compared)
OUTCOMES = ("pass", "fail", "diverged")
#: a verdict's status in a report: its outcome, or "skipped" (nothing was observed to judge: the reason is
#: ``details["skipped"]``), or "finding" (only efficiency clauses broke in a run whose values are right;
#: :func:`zerosim.verify.outcome.mark_findings`)
STATUSES = (*OUTCOMES, "skipped", "finding")


@dataclass
class Verdict:
    """One contract's verdict on one run: what its check found and how the reports show it."""

    contract: str
    violations: list[Violation] = field(default_factory=list)
    checked: int = 0  # how many things (ranks, steps, tensors, plans) the check looked at
    details: dict[str, Any] = field(default_factory=dict)
    #: the 0-based step at which the reference went non-finite (loss or state); steps from it on were
    #: not compared. Not a violation: ``passed`` stays true when nothing before it was violated.
    diverged_at: int | None = None
    #: the one line a report shows for it; empty: said by the first violation (:attr:`reason`)
    note: str = ""
    #: a failure of efficiency clauses only, reported as a finding (see :data:`STATUSES`)
    finding: bool = False

    @classmethod
    def skipped(cls, contract: str, reason: str) -> Verdict:
        """The verdict of a contract that had nothing to judge, and why."""
        return cls(contract, details={"skipped": reason})

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

    @property
    def status(self) -> str:
        """One of :data:`STATUSES`: "finding" or "fail" with a violation, "skipped" when nothing was
        judged, else the outcome."""
        if self.violations:
            return "finding" if self.finding else "fail"
        return "skipped" if "skipped" in self.details else self.outcome

    @property
    def first_violation(self) -> Mapping[str, Any] | None:
        """The first violation by step, then rank (a violation of no step or rank first)."""
        if not self.violations:
            return None
        return min(self.violations, key=lambda v: (_order(v.step), _order(v.ranks[0] if v.ranks else None)))

    @property
    def reason(self) -> str:
        """The report's one line: :attr:`note`, else where the first violation is and what broke, else
        why the contract was skipped ("" for a pass)."""
        if self.note:
            return self.note
        first = self.first_violation
        if first is not None:
            return where(first)
        return str(self.details["skipped"]) if "skipped" in self.details else ""

    def extend(self, other: Verdict) -> None:
        self.violations.extend(other.violations)
        self.checked += other.checked
        if other.diverged_at is not None:
            self.diverged_at = (
                other.diverged_at if self.diverged_at is None else min(self.diverged_at, other.diverged_at)
            )

    def to_json(self) -> dict[str, Any]:
        """``contract``, ``status``, ``reason``, ``passed``, ``outcome``, ``diverged_at``, ``checked``,
        ``violations`` (each :meth:`Violation.to_json`) and ``details``."""
        return {"contract": self.contract, "status": self.status, "reason": self.reason,
                "passed": self.passed, "outcome": self.outcome,
                "diverged_at": self.diverged_at, "checked": self.checked,
                "violations": [v.to_json() for v in self.violations],
                "details": {k: _jsonable(v) for k, v in self.details.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], contract: str | None = None) -> Verdict:
        """The verdict :meth:`to_json` wrote (``contract``: its id where the JSON is keyed by it)."""
        violations = [Violation.from_json(v) for v in data.get("violations", [])]
        out = cls(str(data.get("contract", contract or "")), violations, int(data.get("checked", 0)),
                  dict(data.get("details", {})), data.get("diverged_at"),
                  finding=data.get("status") == "finding")
        reason = str(data.get("reason", ""))
        if data.get("status") == "skipped" and "skipped" not in out.details:
            out.details["skipped"] = reason
        if reason != out.reason:
            out.note = reason
        return out


def where(v: Mapping[str, Any]) -> str:
    """'first at step 3 (sgd), rank 1, h.0.w[4:9]: ...' for a violation (its JSON or itself)."""
    phase = f" ({v['phase']})" if v.get("phase") is not None else ""
    at = f"first at step {v['step']}{phase}" if v.get("step") is not None else "first"
    rank = f", rank {v['rank']}" if v.get("rank") is not None else ""
    if v.get("tensor") is None:
        return f"{at}{rank}: {v['message']}"
    if v.get("start") is None:  # a whole tensor (a normwise clause)
        return f"{at}{rank}, {v['tensor']}: {v['message']}"
    return f"{at}{rank}, {v['tensor']}[{v['start']}:{v['stop']}]: {v['message']}"


def _order(x: int | None) -> int:
    return -1 if x is None else int(x)


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
