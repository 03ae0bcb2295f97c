"""What ``zerosim verify`` returns: a :class:`VerifyReport` of one :class:`~zerosim.values.verdict.Verdict`
per contract and a ranked list of :class:`Diagnosis` (likely bug classes with their evidence). Pure data,
JSON both ways.

The contracts are judged by :mod:`zerosim.checks` (one check per contract); the report holds their
verdicts as they are, the type the simulator and the monitor report too. A verdict's JSON is
:meth:`~zerosim.values.verdict.Verdict.to_json` (``status`` "pass" | "fail" | "finding" | "skipped" |
"diverged", ``reason``, ``violations``, ``details``, and ``contract``, ``passed``, ``outcome``,
``diverged_at``, ``checked``); a violation's is :meth:`~zerosim.values.verdict.Violation.to_json`:
``contract``, ``phase`` ("sgd" | "adamw"), ``step`` (1-based, global over the phases), ``rank``,
``ranks``, ``tensor`` (its name in ``model.named_parameters()``), ``start`` / ``stop`` (a half-open
element range of the flattened tensor), ``expected``, ``got``, ``error``, ``tolerance``, ``message``,
``clause``, and what the check adds (``state``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from zerosim.values.verdict import Verdict, Violation, where

#: the clauses that judge efficiency against the declared strategy's model, not the values: memory
#: above the plan (C-ZERO-004 ``bytes``), traffic outside the ring model (C-ZERO-005 ``ring_model``)
EFFICIENCY_CLAUSES = frozenset({"bytes", "ring_model"})
FINDING = "finding"  # a contract's status when only efficiency clauses broke and every value is right
BUG_CLASSES = ("gradient-scale", "clip-norm", "unowned-elements", "overlapping-shards", "rank-local",
               "ranks-disagree", "ranks-agree-wrong", "permuted-shards", "late-divergence",
               "replicas-not-reduced", "accumulation-sum", "accumulation-dropped", "logged-norm",
               "no-fp32-master", "reduce-dtype", "loss-scale", "matrix-optimizer-on-shard",
               "gradient-not-reduced", "muon-rounding-order", "non-finite-weights")

#: the name a contract's entry in the report had when it was a type of its own; it is the verdict
ContractOutcome = Verdict

__all__ = ["BUG_CLASSES", "EFFICIENCY_CLAUSES", "FINDING", "ContractOutcome", "Diagnosis", "VerifyReport",
           "Verdict", "Violation", "mark_findings", "stated", "where"]


def stated(status: str, reason: str = "", violations: Iterable[Mapping[str, Any]] = (),
           details: Mapping[str, Any] | None = None, contract: str = "") -> Verdict:
    """A verdict as a report states it (its JSON's ``status``, ``reason``, ``violations`` and
    ``details``): a contract's entry in a report read back, a table's row, an example."""
    return Verdict.from_json({"contract": contract, "status": status, "reason": reason,
                              "violations": [dict(v) for v in violations], "details": dict(details or {})})


def mark_findings(contracts: dict[str, Verdict]) -> dict[str, Verdict]:
    """A correct run is a pass; efficiency is a finding. When no contract failed on a value clause
    (parameters, optimizer state, replicas, ownership, resumed state, logged values), every failed
    contract whose violations are all efficiency clauses (:data:`EFFICIENCY_CLAUSES`: the framework's
    own schedule moves or keeps other bytes than the declared strategy's model) becomes a "finding".
    When a value is wrong they stay failures: the traffic is then evidence of the bug."""

    def efficiency_only(c: Verdict) -> bool:
        return bool(c.violations) and all(v.get("clause") in EFFICIENCY_CLAUSES for v in c.violations)

    failed = [cid for cid, c in contracts.items() if c.status == "fail"]
    if any(not efficiency_only(contracts[cid]) for cid in failed):
        return contracts
    for cid in failed:
        contracts[cid].finding = True
    return contracts


@dataclass(frozen=True)
class Diagnosis:
    """A likely bug class (one of :data:`BUG_CLASSES`) and the observations that point at it."""

    bug_class: str
    evidence: str

    def to_json(self) -> dict[str, str]:
        return {"bug_class": self.bug_class, "evidence": self.evidence}


@dataclass
class VerifyReport:
    """The result of verifying one trainer: ``verdict`` is "fail" when any contract failed, or, with
    ``strict``, when any contract has a finding; "unsupported" when the trainer refused every phase
    (``make_trainer`` raised NotImplementedError): nothing was verified, which is no pass."""

    target: str
    world: int
    steps: int
    dtype: str
    contracts: dict[str, Verdict]
    diagnosis: list[Diagnosis] = field(default_factory=list)
    device: str = "cpu"
    model: str = "gpt"
    phases: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    strict: bool = False

    def __post_init__(self) -> None:
        for cid, verdict in self.contracts.items():  # a verdict stated without its id is the one it is under
            if not verdict.contract:
                verdict.contract = cid

    @property
    def verdict(self) -> str:
        failed = any(c.status == "fail" for c in self.contracts.values())
        if failed or (self.strict and self.findings):
            return "fail"
        refused = self.phases and all(p.get("status") == "skipped" for p in self.phases)
        return "unsupported" if refused else "pass"

    @property
    def findings(self) -> list[Violation]:
        """Each efficiency violation of a contract whose status is "finding" (traffic or memory off the
        declared strategy's model in a run whose values are right)."""
        return [v for c in self.contracts.values() if c.status == FINDING for v in c.violations]

    @property
    def exit_code(self) -> int:
        """0 pass, 1 fail, 2 unsupported (the trainer refused every phase: the run was not possible)."""
        return {"fail": 1, "unsupported": 2}.get(self.verdict, 0)

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "world": self.world, "steps": self.steps, "dtype": self.dtype,
                "device": self.device, "model": self.model, "verdict": self.verdict,
                "contracts": {k: v.to_json() for k, v in self.contracts.items()},
                "diagnosis": [d.to_json() for d in self.diagnosis], "phases": list(self.phases),
                "strict": self.strict, "findings": [v.to_json() for v in self.findings], **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VerifyReport:
        known = {"target", "world", "steps", "dtype", "device", "model", "verdict", "contracts", "diagnosis",
                 "phases", "strict", "findings"}
        return cls(data["target"], int(data["world"]), int(data["steps"]), data["dtype"],
                   {k: Verdict.from_json(v, k) for k, v in data["contracts"].items()},
                   [Diagnosis(d["bug_class"], d["evidence"]) for d in data.get("diagnosis", [])],
                   data.get("device", "cpu"), data.get("model", "gpt"), list(data.get("phases", [])),
                   {k: v for k, v in data.items() if k not in known}, bool(data.get("strict", False)))
