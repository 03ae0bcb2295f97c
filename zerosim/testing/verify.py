"""A pytest helper that runs ``zerosim verify`` from a user's own test suite.

    from zerosim.testing import assert_trainer_verifies

    def test_my_zero1_trainer():
        assert_trainer_verifies("mypkg.trainer:make_trainer", world=2)

One call: it starts the ranks, trains the trainer next to the unsharded reference, checks
C-ZERO-001..005 and returns the :class:`~zerosim.verify.VerifyReport` when every contract holds.
Otherwise it raises ``AssertionError`` whose message is the diagnostic: for each failed contract the
first violation (step, phase, rank, tensor, element range, expected / got / error / tolerance), then
the likely bug classes with their evidence. A trainer that breaks the protocol or a rank that fails
or hangs is an ``AssertionError`` too, carrying the harness's one-line message; a bad option
(``world=0``) stays a :class:`zerosim.errors.ConfigError`, since the test itself is wrong.
"""

from __future__ import annotations

from typing import Any

__all__ = ["assert_trainer_verifies", "failure_message"]


def _violation_line(v: dict[str, Any], reason: str = "") -> str:
    """Where the violation is and by how much; its message unless the contract's reason already says it."""
    where = [f"step {v.get('step')}" + (f" ({v['phase']})" if v.get("phase") else "")]
    if v.get("rank") is not None:
        where.append(f"rank {v['rank']}")
    if v.get("tensor") is not None:
        span = f" elements [{v['start']}, {v['stop']})" if v.get("start") is not None else ""
        where.append(f"tensor {v['tensor']!r}{span}")
    digits = {"expected": ".10g", "got": ".10g", "error": ".3g", "tolerance": ".3g"}
    numbers = [f"{key} {v[key]:{fmt}}" if isinstance(v.get(key), float) else f"{key} {v[key]}"
               for key, fmt in digits.items() if v.get(key) is not None]
    text = ", ".join(where)
    if numbers:
        text += ": " + ", ".join(numbers)
    if v.get("message") and v["message"] not in reason:
        text += f" - {v['message']}"
    return text


def failure_message(report: Any) -> str:
    """The diagnostic of a :class:`~zerosim.verify.VerifyReport` that did not pass (failed, or unsupported:
    every phase refused), one line per fact."""
    lines = [f"zerosim verify {report.target}: {report.verdict} (world {report.world}, {report.steps} steps, "
             f"{report.dtype})"]
    for cid, outcome in report.contracts.items():
        if outcome.status != "fail":
            continue
        first = outcome.first_violation
        head = f"{cid} failed"
        if outcome.reason:
            head += f": {outcome.reason}"
        lines.append(head)
        if first is not None:
            lines.append(f"  first violation: {_violation_line(first, outcome.reason)}")
            count = outcome.details.get("violation_count", len(outcome.violations))
            if count > 1:
                lines.append(f"  ({count} violations in all)")
    for d in report.diagnosis:
        lines.append(f"likely bug: {d.bug_class}: {d.evidence}")
    if report.verdict == "unsupported":  # nothing ran: each phase's refusal is the whole story
        lines += [f"skipped {p['name']}: {p.get('reason', '')}" for p in report.phases]
    return "\n".join(lines)


def assert_trainer_verifies(target: str, **options: Any) -> Any:
    """Verify ``target`` (a built-in adapter name or ``MODULE:FACTORY``) with ``zerosim.verify.verify``'s
    keyword options (``world``, ``steps``, ``dtype``, ``device``, ``model``, ``optimizers``, ``timeout_s``,
    ``out``). Returns the report when every contract holds; raises AssertionError with the diagnostic
    otherwise. Serves C-ZERO-001..005 from a user's test suite."""
    from zerosim.verify import RankFailure, TrainerError, verify

    try:
        report = verify(target, **options)
    except (TrainerError, RankFailure) as e:
        raise AssertionError(f"zerosim verify {target}: {e}") from e
    if report.verdict != "pass":
        raise AssertionError(failure_message(report))
    return report
