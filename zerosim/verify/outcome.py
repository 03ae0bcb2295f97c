"""What ``zerosim verify`` returns: a :class:`VerifyReport` of :class:`ContractOutcome` per contract and a
ranked list of :class:`Diagnosis` (likely bug classes with their evidence). Pure data, JSON both ways.

A violation is a plain dict: ``contract``, ``phase`` ("sgd" | "adamw"), ``step`` (1-based, global over
the phases), ``rank``, ``tensor`` (its name in ``model.named_parameters()``), ``start`` / ``stop`` (a
half-open element range of the flattened tensor), ``expected``, ``got``, ``error``, ``tolerance``,
``message``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CONTRACT_IDS = ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005")
BUG_CLASSES = ("gradient-scale", "clip-norm", "unowned-elements", "overlapping-shards", "rank-local",
               "ranks-disagree", "ranks-agree-wrong", "permuted-shards", "late-divergence")


@dataclass
class ContractOutcome:
    """One contract's verdict: ``status`` "pass" | "fail" | "skipped", why, and what broke it.
    ``details`` carries the measured ``max_error`` next to its ``tolerance`` where the contract has one."""

    status: str
    reason: str = ""
    violations: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "violations": list(self.violations),
                "details": dict(self.details)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ContractOutcome:
        return cls(data["status"], data.get("reason", ""), list(data.get("violations", [])),
                   dict(data.get("details", {})))

    @property
    def first_violation(self) -> dict[str, Any] | None:
        if not self.violations:
            return None
        return min(self.violations, key=lambda v: (v.get("step") or 0, v.get("rank") or 0))


@dataclass(frozen=True)
class Diagnosis:
    """A likely bug class (one of :data:`BUG_CLASSES`) and the observations that point at it."""

    bug_class: str
    evidence: str

    def to_json(self) -> dict[str, str]:
        return {"bug_class": self.bug_class, "evidence": self.evidence}


@dataclass
class VerifyReport:
    """The result of verifying one trainer: ``verdict`` is "fail" when any contract failed."""

    target: str
    world: int
    steps: int
    dtype: str
    contracts: dict[str, ContractOutcome]
    diagnosis: list[Diagnosis] = field(default_factory=list)
    device: str = "cpu"
    model: str = "gpt"
    phases: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "fail" if any(c.status == "fail" for c in self.contracts.values()) else "pass"

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "fail" else 0

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "world": self.world, "steps": self.steps, "dtype": self.dtype,
                "device": self.device, "model": self.model, "verdict": self.verdict,
                "contracts": {k: v.to_json() for k, v in self.contracts.items()},
                "diagnosis": [d.to_json() for d in self.diagnosis], "phases": list(self.phases), **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VerifyReport:
        known = {"target", "world", "steps", "dtype", "device", "model", "verdict", "contracts", "diagnosis",
                 "phases"}
        return cls(data["target"], int(data["world"]), int(data["steps"]), data["dtype"],
                   {k: ContractOutcome.from_json(v) for k, v in data["contracts"].items()},
                   [Diagnosis(d["bug_class"], d["evidence"]) for d in data.get("diagnosis", [])],
                   data.get("device", "cpu"), data.get("model", "gpt"), list(data.get("phases", [])),
                   {k: v for k, v in data.items() if k not in known})
