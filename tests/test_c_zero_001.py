"""C-ZERO-001: every clause passes on correct plans and fails, with the right diagnostic, on a
deliberately wrong partitioner. Plus StatePlan (plan.py) for every strategy, hybrid included."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosim import ParamLayout, ShardingStrategy, Topology, build_plan
from zerosim.checks import check_partition_plan
from zerosim.partition import PARTITIONERS, RankShard, ShardPlan, get_partitioner
from zerosim.partition.base import RegisteredPartitioner
from zerosim.testing.strategies import plans
from zerosim.values import intervals
from zerosim.values.plan import STATE_KINDS, bytes_in
from zerosim.values.strategy import StrategyKind


def plan_of(per_rank, total, bound=1, padding=None, **meta):
    padding = padding or [0] * len(per_rank)
    shards = tuple(RankShard(r, tuple(ivs), padding[r]) for r, ivs in enumerate(per_rank))
    return ShardPlan("test", len(per_rank), total, shards, bound, "", meta)


def clauses(verdict):
    return [v.clause for v in verdict.violations]


# ---- a wrong partitioner per clause -------------------------------------------------------------------
def test_coverage_gap_at_the_end_names_the_missing_interval_and_rank():
    # "forgets the remainder": every rank takes total // ws, the last 3 elements belong to nobody
    total, ws = 23, 4
    verdict = check_partition_plan(plan_of([[(r * 5, r * 5 + 5)] for r in range(ws)], total))
    assert clauses(verdict) == ["coverage"]
    v = verdict.violations[0]
    assert v.contract == "C-ZERO-001" and v.interval == (20, 23) and v.ranks == (3,)
    assert v.context == {"world_size": 4, "total": 23}
    assert "owned by no rank" in str(v) and "range=[20, 23)" in str(v)


def test_coverage_gap_in_the_middle_names_both_neighbours():
    verdict = check_partition_plan(plan_of([[(0, 4)], [(6, 10)]], 10, bound=2))
    assert [(v.clause, v.interval, v.ranks) for v in verdict.violations] == [("coverage", (4, 6), (0, 1))]


def test_disjoint_overlap_between_ranks_and_within_one_rank():
    # ceil-sized shards that forget to clamp: ranks 0 and 1 both own [3, 4)
    verdict = check_partition_plan(plan_of([[(0, 4)], [(3, 7)]], 7, bound=1))
    assert [(v.clause, v.interval, v.ranks) for v in verdict.violations] == [("disjoint", (3, 4), (0, 1))]
    twice = check_partition_plan(plan_of([[(0, 3), (1, 2)], [(3, 6)]], 6, bound=1))
    assert [(v.clause, v.interval, v.ranks) for v in twice.violations] == [("disjoint", (1, 2), (0, 0))]
    assert "listed twice" in twice.violations[0].message


def test_balance_seed_clause_flags_the_last_rank_absorbing_the_remainder():
    # what the seed's doc comment says: the last shard absorbs the remainder (10, 3 -> 3, 3, 4 is fine;
    # 11, 4 -> 2, 2, 2, 5 is not)
    total, ws = 11, 4
    per_rank = [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 11)]]
    verdict = check_partition_plan(
        plan_of(per_rank, total, bound=1, balance_target=total // ws, balance_tolerance=1)
    )
    assert [(v.clause, v.ranks, v.expected, v.got) for v in verdict.violations] == [("balance", (3,), 2, 5)]


def test_balance_bound_of_a_partitioner_is_enforced():
    # a "zero-redundancy" that puts every tensor on rank 0 exceeds its bound (the largest tensor)
    layout = ParamLayout.from_list([("a", (4,)), ("b", (3,)), ("c", (3,))])
    good = get_partitioner("zero-redundancy")(layout, 2)
    bad = dataclasses.replace(good, shards=(RankShard(0, ((0, 10),)), RankShard(1, ())))
    assert check_partition_plan(good).passed
    verdict = check_partition_plan(bad)
    assert [(v.clause, v.ranks, v.expected, v.got) for v in verdict.violations] == [
        ("balance", (0, 1), 4, 10)
    ]


def test_padding_counted_as_data_is_flagged():
    # a DeepSpeed-style plan that lists the tail padding [10, 12) as rank 2's data
    verdict = check_partition_plan(
        plan_of([[(0, 4)], [(4, 8)], [(8, 12)]], 10, bound=5, padded_shard_numel=4)
    )
    found = [(v.clause, v.interval, v.ranks) for v in verdict.violations]
    assert ("padding", (10, 12), (2,)) in found
    assert all(c == "padding" for c, _, _ in found)


def test_padding_size_mismatch_and_negative_padding_are_flagged():
    verdict = check_partition_plan(plan_of([[(0, 4)], [(4, 8)], [(8, 10)]], 10, bound=5,
                                           padding=[0, 0, 1], padded_shard_numel=4))
    assert [(v.clause, v.ranks, v.expected, v.got) for v in verdict.violations] == [("padding", (2,), 4, 3)]
    neg = check_partition_plan(plan_of([[(0, 5)], [(5, 10)]], 10, padding=[0, -1]))
    assert [(v.clause, v.ranks) for v in neg.violations] == [("padding", (1,))]


def test_negative_start_is_padding_below_zero():
    verdict = check_partition_plan(plan_of([[(-2, 5)], [(5, 10)]], 10, bound=10))
    assert [(v.clause, v.interval) for v in verdict.violations] == [("padding", (-2, 0))]


def test_well_formed_clause():
    wrong_count = ShardPlan("test", 3, 10, (RankShard(0, ((0, 5),)), RankShard(1, ((5, 10),))), 5)
    assert "well_formed" in clauses(check_partition_plan(wrong_count))
    mislabelled = ShardPlan("test", 2, 10, (RankShard(1, ((0, 5),)), RankShard(1, ((5, 10),))), 5)
    v = check_partition_plan(mislabelled).violations
    assert [(x.clause, x.ranks, x.got) for x in v] == [("well_formed", (0,), 1)]
    reversed_iv = check_partition_plan(plan_of([[(0, 5)], [(10, 5)]], 10, bound=10))
    assert ("well_formed", (10, 5)) in [(x.clause, x.interval) for x in reversed_iv.violations]
    floats = check_partition_plan(plan_of([[(0, 5.0)], [(5, 10)]], 10, bound=10))
    assert "well_formed" in clauses(floats)


def test_violations_are_capped_per_clause_but_counted():
    # every rank misses one element: 1000 gaps
    per_rank = [[(2 * r, 2 * r + 1)] for r in range(1000)]
    verdict = check_partition_plan(plan_of(per_rank, 2000, bound=1), limit=5)
    assert clauses(verdict) == ["coverage"] * 5
    assert verdict.details["violations_by_clause"] == {"coverage": 1000}
    assert verdict.details["suppressed"] == 995


def test_correct_plans_pass_and_record_the_spread():
    verdict = check_partition_plan(get_partitioner("seed")(ParamLayout.from_list([("w", (10,))]), 3))
    assert verdict.passed and verdict.checked == 3
    assert verdict.details["spread"] == 1 and verdict.details["num_intervals"] == 3


def test_interval_arithmetic_scales_to_10_12_params_on_1024_ranks_and_beyond():
    for total in (10**12, 10**18, 2**61 - 1):
        plan = get_partitioner("seed")(ParamLayout.from_list([("w", (total,))]), 1024)
        verdict = check_partition_plan(plan)
        assert verdict.passed and verdict.details["num_intervals"] == 1024
    # and a gap of a single element among 10^18 is still found exactly
    per_rank = [[(0, 10**17)], [(10**17 + 1, 10**18)]]
    bad = check_partition_plan(plan_of(per_rank, 10**18, bound=10**18))
    assert [(v.clause, v.interval) for v in bad.violations] == [("coverage", (10**17, 10**17 + 1))]


# ---- StatePlan (plan.py) and the hybrid rules ------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy", ["no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2"]
)
@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_state_plan_shards_what_the_strategy_says(strategy, partitioner):
    layout = ParamLayout.from_config("tiny")
    strat, topo = ShardingStrategy.parse(strategy), Topology(4, 2)
    plan = build_plan(layout, strat, partitioner, topo)
    k = strat.shard_group_size(4)
    assert plan.shard_plan.world_size == k
    sharded = {
        "params": strat.shards_params,
        "grads": strat.shards_grads,
        "optimizer": strat.shards_optimizer,
    }
    for r in plan.ranks:
        assert (r.shard_group, r.local_rank) == divmod(r.rank, k)
        for kind in STATE_KINDS:
            held = r.holding(kind)
            if sharded[kind]:
                assert held.intervals == plan.shard_plan.shard(r.local_rank).intervals
            else:
                assert held.intervals == ((0, layout.total_numel),) and held.padding == 0
    assert check_partition_plan(plan).passed
    # bytes of one shard group's params add up to the model's bytes
    group0 = [r for r in plan.ranks if r.shard_group == 0]
    param_bytes = sum(bytes_in(layout, r.params.intervals) for r in group0)
    assert param_bytes == layout.total_bytes * (len(group0) if not strat.shards_params else 1)


def _tamper(plan, rank, kind, shard):
    ranks = list(plan.ranks)
    ranks[rank] = dataclasses.replace(ranks[rank], **{kind: shard})
    return dataclasses.replace(plan, ranks=tuple(ranks))


def test_hybrid_replicas_that_differ_are_flagged():
    layout = ParamLayout.from_config("tiny")
    plan = build_plan(layout, ShardingStrategy.hybrid_shard(2), "seed", Topology(4, 2))
    # rank 3 (group 1, local 1) swaps in a different but self-consistent shard: group 1 alone would
    # still cover [0, total) only if rank 2 changes too, so change both members of group 1.
    mid = layout.total_numel // 2 + 5
    bad = _tamper(plan, 2, "params", RankShard(2, ((0, mid),)))
    bad = _tamper(bad, 3, "params", RankShard(3, ((mid, layout.total_numel),)))
    verdict = check_partition_plan(bad)
    assert set(clauses(verdict)) == {"replicas", "balance"}
    reps = [v for v in verdict.violations if v.clause == "replicas"]
    assert {v.ranks for v in reps} == {(0, 2), (1, 3)}
    assert all(v.context == {"state": "params"} for v in reps)
    assert reps[0].interval is not None


def test_hybrid_coverage_is_checked_inside_every_shard_group_with_global_ranks():
    layout = ParamLayout.from_config("tiny")
    plan = build_plan(layout, ShardingStrategy.hybrid_shard(2), "seed", Topology(4, 2))
    bad = _tamper(plan, 3, "grads", RankShard(3, ()))  # rank 3 forgets its grad shard
    verdict = check_partition_plan(bad)
    cov = [v for v in verdict.violations if v.clause == "coverage"]
    assert len(cov) == 1 and cov[0].ranks == (2,) and cov[0].context == {"state": "grads", "group": 1}
    assert cov[0].interval == plan.ranks[3].grads.intervals[0]
    assert "replicas" in clauses(verdict)


def test_replicated_state_must_be_whole_on_every_rank():
    layout = ParamLayout.from_config("tiny")
    plan = build_plan(layout, ShardingStrategy.parse("zero2"), "seed", Topology(4))
    bad = _tamper(plan, 1, "params", RankShard(1, ((0, 10),)))
    verdict = check_partition_plan(bad)
    cov = [v for v in verdict.violations if v.clause == "coverage"]
    assert cov and cov[0].ranks == (1,) and cov[0].context["state"] == "params"


def test_a_wrong_registered_partitioner_fails_through_build_plan(monkeypatch):
    def forgets_tail(layout, world_size):
        good = PARTITIONERS["deepspeed"](layout, world_size)
        last = good.shards[-1]
        return dataclasses.replace(good, shards=good.shards[:-1] + (RankShard(last.rank, (), last.padding),))

    monkeypatch.setitem(
        PARTITIONERS, "forgets-tail", RegisteredPartitioner("forgets-tail", "bug", forgets_tail)
    )
    plan = build_plan(ParamLayout.from_list([("w", (37,))]), ShardingStrategy.parse("zero3"), "forgets-tail",
                      Topology(4))
    verdict = check_partition_plan(plan)
    assert {v.clause for v in verdict.violations} >= {"coverage", "padding"}
    assert all(v.context.get("state") in STATE_KINDS for v in verdict.violations)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_every_generated_state_plan_satisfies_c_zero_001(plan):
    verdict = check_partition_plan(plan)
    assert verdict.passed, [str(v) for v in verdict.violations[:5]]
    strat = plan.strategy
    if strat.kind in (StrategyKind.HYBRID_SHARD, StrategyKind.HYBRID_SHARD_ZERO2):
        assert plan.shard_plan.world_size == strat.intra_node_size


# ---- the interval arithmetic itself, against brute force on small spaces --------------------------------
@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 40).flatmap(
        lambda total: st.tuples(
            st.just(total),
            st.lists(
                st.lists(
                    st.tuples(st.integers(-3, total + 3), st.integers(-3, total + 3)).map(sorted).map(tuple),
                    max_size=4,
                ),
                min_size=1,
                max_size=6,
            ),
        )
    )
)
def test_check_matches_a_brute_force_flag_count_on_small_spaces(case):
    total, per_rank = case
    verdict = check_partition_plan(plan_of(per_rank, total, bound=10**9))
    owners = [0] * total
    outside = 0
    for ivs in per_rank:
        for s, e in ivs:
            for i in range(s, e):
                if 0 <= i < total:
                    owners[i] += 1
                else:
                    outside += 1
    assert verdict.details["gap_elements"] == owners.count(0)
    assert verdict.details["overlap_elements"] == sum(c - 1 for c in owners if c > 1)
    counts = verdict.details["violations_by_clause"]
    assert ("coverage" in counts) == (0 in owners)
    assert ("disjoint" in counts) == any(c > 1 for c in owners)
    assert ("padding" in counts) == (outside > 0)
    assert verdict.passed == (owners.count(1) == total and outside == 0)


def test_first_difference_and_union():
    assert intervals.union([(5, 7), (0, 2), (1, 3), (3, 4)]) == ((0, 4), (5, 7))
    assert intervals.first_difference([(0, 10)], [(0, 4), (5, 10)]) == (4, 5)
    assert intervals.first_difference([(0, 4)], [(0, 4)]) is None
    assert intervals.merge_adjacent([(4, 6), (0, 4), (6, 6), (5, 7)]) == ((0, 6), (5, 7))
