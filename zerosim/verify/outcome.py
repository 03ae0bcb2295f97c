"""What ``zerosim verify`` returns: a :class:`VerifyReport` of :class:`ContractOutcome` per contract and a
ranked list of :class:`Diagnosis` (likely bug classes with their evidence). Pure data, JSON both ways.

The contracts are judged by :mod:`zerosim.checks` (one check per contract, returning a
:class:`~zerosim.verdict.Verdict` of :class:`~zerosim.verdict.Violation`); a :class:`ContractOutcome` is
its rendering in the report (:meth:`ContractOutcome.from_verdict`). A rendered violation
(:func:`violation_json`) is a plain dict: ``contract``, ``phase`` ("sgd" | "adamw"), ``step`` (1-based,
global over the phases), ``rank``, ``tensor`` (its name in ``model.named_parameters()``), ``start`` /
``stop`` (a half-open element range of the flattened tensor), ``expected``, ``got``, ``error``,
``tolerance``, ``message``, ``clause``, and what the check adds (``ranks``, ``state``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerosim.verdict import Verdict, Violation

#: the clauses that judge efficiency against the declared strategy's model, not the values: memory
#: above the plan (C-ZERO-004 ``bytes``), traffic outside the ring model (C-ZERO-005 ``ring_model``)
EFFICIENCY_CLAUSES = frozenset({"bytes", "ring_model"})
FINDING = "finding"  # a contract's status when only efficiency clauses broke and every value is right
BUG_CLASSES = ("gradient-scale", "clip-norm", "unowned-elements", "overlapping-shards", "rank-local",
               "ranks-disagree", "ranks-agree-wrong", "permuted-shards", "late-divergence",
               "replicas-not-reduced", "accumulation-sum", "accumulation-dropped", "logged-norm",
               "no-fp32-master", "reduce-dtype", "loss-scale", "matrix-optimizer-on-shard",
               "gradient-not-reduced", "muon-rounding-order", "non-finite-weights")


@dataclass
class ContractOutcome:
    """One contract's verdict: ``status`` "pass" | "fail" | "finding" | "skipped", why, and what broke it
    ("finding": see :func:`mark_findings`).
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

    @classmethod
    def from_verdict(cls, verdict: Verdict) -> ContractOutcome:
        """The report's rendering of a check's verdict: "skipped" (with the reason in
        ``details["skipped"]``) when it observed nothing, else "fail" with the first violation (by step,
        then rank) as the reason, or "pass"."""
        details = dict(verdict.details)
        if not verdict.violations and "skipped" in details:
            return cls("skipped", str(details["skipped"]))
        listed = [violation_json(v) for v in verdict.violations]
        if not listed:
            return cls("pass", "", [], details)
        first = min(listed, key=lambda v: (v["step"], v["rank"] if v["rank"] is not None else -1))
        return cls("fail", where(first), listed, details)

    @property
    def first_violation(self) -> dict[str, Any] | None:
        if not self.violations:
            return None
        return min(self.violations, key=lambda v: (v.get("step") or 0, v.get("rank") or 0))


def violation_json(v: Violation) -> dict[str, Any]:
    """One violation as the report lists it: where (phase, step, rank, tensor, the half-open element
    range), expected, got, error, tolerance, one line saying what broke, the clause and the check's
    own context (``ranks``, ``state``, ...)."""
    start, stop = v.interval if v.interval is not None else (None, None)
    return {
        "contract": v.contract,
        "phase": v.phase,
        "step": v.step,
        "rank": v.ranks[0] if v.ranks else None,
        "tensor": v.tensor,
        "start": start,
        "stop": stop,
        "expected": _num(v.expected),
        "got": _num(v.got),
        "error": _num(v.error),
        "tolerance": _num(v.tolerance),
        "message": v.message,
        "clause": v.clause,
        **v.context,
    }


def where(v: dict[str, Any]) -> str:
    """'first at step 3 (sgd), rank 1, h.0.w[4:9]: ...' for a rendered violation."""
    rank = f", rank {v['rank']}" if v.get("rank") is not None else ""
    if v.get("start") is None and v.get("tensor") is not None:  # a whole tensor (a normwise clause)
        return f"first at step {v['step']} ({v['phase']}){rank}, {v['tensor']}: {v['message']}"
    if v.get("tensor") is None:
        return f"first at step {v['step']} ({v['phase']}){rank}: {v['message']}"
    return (
        f"first at step {v['step']} ({v['phase']}){rank}, {v['tensor']}[{v['start']}:{v['stop']}]: "
        f"{v['message']}"
    )


def _num(x: Any) -> Any:
    if x is None or isinstance(x, (str, bool, int)):
        return x
    if isinstance(x, (list, tuple)):
        return [_num(v) for v in x]
    return float(x)


def mark_findings(contracts: dict[str, ContractOutcome]) -> dict[str, ContractOutcome]:
    """A correct run is a pass; efficiency is a finding. When no contract failed on a value clause
    (parameters, optimizer state, replicas, ownership, resumed state, logged values), every failed
    contract whose violations are all efficiency clauses (:data:`EFFICIENCY_CLAUSES`: the framework's
    own schedule moves or keeps other bytes than the declared strategy's model) becomes a "finding".
    When a value is wrong they stay failures: the traffic is then evidence of the bug."""

    def efficiency_only(c: ContractOutcome) -> bool:
        return bool(c.violations) and all(v.get("clause") in EFFICIENCY_CLAUSES for v in c.violations)

    failed = [cid for cid, c in contracts.items() if c.status == "fail"]
    if any(not efficiency_only(contracts[cid]) for cid in failed):
        return contracts
    for cid in failed:
        contracts[cid].status = FINDING
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
    contracts: dict[str, ContractOutcome]
    diagnosis: list[Diagnosis] = field(default_factory=list)
    device: str = "cpu"
    model: str = "gpt"
    phases: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    strict: bool = False

    @property
    def verdict(self) -> str:
        failed = any(c.status == "fail" for c in self.contracts.values())
        if failed or (self.strict and self.findings):
            return "fail"
        refused = self.phases and all(p.get("status") == "skipped" for p in self.phases)
        return "unsupported" if refused else "pass"

    @property
    def findings(self) -> list[dict[str, Any]]:
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
                "strict": self.strict, "findings": self.findings, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VerifyReport:
        known = {"target", "world", "steps", "dtype", "device", "model", "verdict", "contracts", "diagnosis",
                 "phases", "strict", "findings"}
        return cls(data["target"], int(data["world"]), int(data["steps"]), data["dtype"],
                   {k: ContractOutcome.from_json(v) for k, v in data["contracts"].items()},
                   [Diagnosis(d["bug_class"], d["evidence"]) for d in data.get("diagnosis", [])],
                   data.get("device", "cpu"), data.get("model", "gpt"), list(data.get("phases", [])),
                   {k: v for k, v in data.items() if k not in known}, bool(data.get("strict", False)))
