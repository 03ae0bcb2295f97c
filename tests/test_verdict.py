"""One verdict type (zerosim.values.verdict.Verdict) for every command, with one JSON shape for a violation:
the simulator's run result and verify's report write the same keys, and a verdict read back from its JSON is
the verdict that wrote it."""

from __future__ import annotations

import json

from zerosim.engine.spmd import RunConfig, run_simulated
from zerosim.values.verdict import STATUSES, Verdict, Violation
from zerosim.verify.outcome import VerifyReport, mark_findings, stated

#: the keys every violation's JSON has, whichever check and command wrote it
VIOLATION_KEYS = {"contract", "phase", "step", "rank", "ranks", "tensor", "start", "stop", "expected", "got",
                  "error", "tolerance", "message", "clause"}
VERDICT_KEYS = {"contract", "status", "reason", "passed", "outcome", "diverged_at", "checked", "violations",
                "details"}


def test_a_simulated_runs_verdicts_have_the_one_shape_and_read_back() -> None:
    """A broken engine (gradients summed) fails C-ZERO-002: its verdicts' JSON has the one shape, each
    violation names rank and element range by the same keys verify uses, and reading it back gives
    the same verdict."""
    result = run_simulated(RunConfig(fault="sum-instead-of-avg", strategy="zero3", world_size=4, steps=1))
    data = json.loads(json.dumps(result.to_json()))
    v2 = data["verdicts"]["C-ZERO-002"]
    assert set(v2) == VERDICT_KEYS and v2["status"] == "fail" and v2["violations"]
    for cid, verdict in data["verdicts"].items():
        assert verdict["contract"] == cid and verdict["status"] in STATUSES
        for v in verdict["violations"]:
            assert VIOLATION_KEYS <= set(v), sorted(VIOLATION_KEYS - set(v))
        assert Verdict.from_json(verdict).to_json() == verdict
    first = min(v2["violations"], key=lambda v: (v["step"], v["rank"]))
    assert v2["reason"].startswith(f"first at step {first['step']}, rank {first['rank']}")
    assert any(v["start"] is not None and v["stop"] > v["start"] for v in v2["violations"])


def test_a_violation_reads_as_its_json_and_round_trips() -> None:
    v = Violation("C-ZERO-003", "bitwise", "ranks disagree", step=2, ranks=(1, 3), tensor="w",
                  interval=(4, 9), expected=1.5, got=2.0, context={"state": "exp_avg"}, phase="adamw")
    data = v.to_json()
    assert VIOLATION_KEYS | {"state"} == set(data)
    assert (v["rank"], v["ranks"], v["start"], v["stop"], v.get("state")) == (1, [1, 3], 4, 9, "exp_avg")
    assert dict(v) == data and Violation.from_json(data) == v
    # a check's own "ranks" (the pieces' holders) beside the rank it names first stays as it was
    other = {**data, "rank": 0, "ranks": [2, 3]}
    assert Violation.from_json(other).to_json() == other


def test_report_statuses_skipped_finding_and_a_json_round_trip() -> None:
    traffic = stated("fail", "", [{"contract": "C-ZERO-005", "clause": "ring_model", "step": 1, "rank": 0,
                                   "message": "too many bytes"}])
    contracts = {"C-ZERO-002": stated("pass"), "C-ZERO-004": Verdict.skipped("C-ZERO-004", "no strategy"),
                 "C-ZERO-005": traffic}
    mark_findings(contracts)  # only an efficiency clause broke and every value is right: a finding
    assert [c.status for c in contracts.values()] == ["pass", "skipped", "finding"]
    assert contracts["C-ZERO-004"].reason == "no strategy"
    assert traffic.reason == "first at step 1, rank 0: too many bytes"
    report = VerifyReport("t", 2, 4, "float64", contracts)
    assert report.verdict == "pass" and [v["clause"] for v in report.findings] == ["ring_model"]
    data = json.loads(json.dumps(report.to_json()))
    assert all(set(c) == VERDICT_KEYS for c in data["contracts"].values())
    assert VerifyReport.from_json(data).to_json() == data
    assert VerifyReport("t", 2, 4, "float64", contracts, strict=True).verdict == "fail"
