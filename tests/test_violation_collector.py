"""The one violation collector of zerosim.checks: caps per clause and in all, counts what it drops."""

from __future__ import annotations

from zerosim.checks.collect import ViolationCollector


def test_per_clause_cap_keeps_the_first_and_counts_the_rest():
    col = ViolationCollector("C-ZERO-002", {"mode": "bitwise"}, per_clause=2)
    for step in range(5):
        col.add("bitwise", f"differs at step {step}", step=step, context={"state": "master"})
    col.add("padding", "padding leaked", step=0)
    v = col.verdict(checked=6)
    assert [x.step for x in v.violations if x.clause == "bitwise"] == [0, 1]
    assert v.violations[0].context == {"mode": "bitwise", "state": "master"}
    assert col.count == 6 and col.not_listed == 3
    assert col.not_listed_by_clause() == {"bitwise": 3}
    assert not v.passed and v.checked == 6


def test_total_cap_and_counts_set_afterwards():
    col = ViolationCollector("C-ZERO-001", total=3)
    col.add_first("coverage", 10, lambda i: (f"gap {i}", {"interval": (i, i + 1)}))
    col.add("disjoint", "overlap")
    assert len(col.violations) == 3 and col.count == 11
    col.set_count("disjoint", 4)  # the sweep counted four overlaps in all
    assert col.count == 14 and col.not_listed_by_clause() == {"coverage": 7, "disjoint": 4}


def test_per_rank_cap_keeps_every_failing_rank_named():
    # rank 0 fails ten times, rank 1 once: a per-rank cap of 2 still lists rank 1 under a total cap of 4
    col = ViolationCollector("C-ZERO-006", total=4, per_rank=2)
    for i in range(10):
        col.add("shard", f"element {i} differs", ranks=(0,))
    col.add("shard", "element 3 differs", ranks=(1,))
    col.add("pieces", "no shard reported", ranks=(0,))
    kept = [(x.clause, x.ranks) for x in col.violations]
    assert kept == [("shard", (0,)), ("shard", (0,)), ("shard", (1,)), ("pieces", (0,))]
    assert col.count == 12 and col.not_listed_by_clause() == {"shard": 8}
