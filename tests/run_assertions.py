"""Assertions shared by the engine tests (imported by test modules: pytest puts tests/ on sys.path)."""

from __future__ import annotations


def assert_all_pass(result) -> None:
    """Every contract of a simulated run holds, and each one really checked something (none skipped)."""
    bad = [str(v) for verdict in result.verdicts.values() for v in verdict.violations]
    assert result.passed, bad[:5]
    for cid, v in result.verdicts.items():
        assert v.checked > 0, cid
        assert not v.details.get("skipped"), cid
