"""Plans held as arrays (ShardTable, RankStates) and their C-ZERO-001 check agree with the per-rank
objects they replace; the array sweep finds what the per-interval sweep finds; a million-rank plan
is built, checked and summarised; the scale benchmark's exponent fit recovers a known power law."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from zerosim.bench.scale import fit_exponent, total_for
from zerosim.checks.partition import check_partition_plan
from zerosim.cli import main
from zerosim.partition import MAX_WORLD_SIZE, PARTITIONERS, get_partitioner
from zerosim.partition.base import RankShard, ShardPlan, ShardTable
from zerosim.values.intervals import sweep, sweep_arrays
from zerosim.values.layout import ParamLayout
from zerosim.values.plan import RankStates, build_plan, bytes_before, bytes_in, shard_columns
from zerosim.values.strategy import ShardingStrategy, Topology


def _as_tuples(plan: ShardPlan) -> ShardPlan:
    return dataclasses.replace(plan, shards=tuple(plan.shards))


def _same_verdict(a, b) -> None:
    assert a.passed == b.passed
    assert [(v.clause, v.message, v.ranks, v.interval) for v in a.violations] == \
           [(v.clause, v.message, v.ranks, v.interval) for v in b.violations]
    assert a.details == b.details and a.checked == b.checked


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
@pytest.mark.parametrize("ws", [1, 3, 8, 64])
def test_array_plans_check_exactly_as_their_per_rank_objects(name, ws):
    plan = get_partitioner(name)(ParamLayout.from_config("tiny"), ws)
    assert plan.table is not None
    _same_verdict(check_partition_plan(plan), check_partition_plan(_as_tuples(plan)))


def _random_table(rng: random.Random) -> tuple[ShardTable, int]:
    total = rng.randint(0, 40)
    ws = rng.randint(1, 6)
    per_rank = []
    for _ in range(ws):
        starts = [rng.randint(0, total) for _ in range(rng.randint(0, 3))]
        ivs = sorted((s, rng.randint(s, total)) for s in starts)
        per_rank.append([iv for iv in ivs if iv[1] > iv[0]])
    table = ShardTable.from_lists(per_rank, [rng.randint(0, 3) for _ in range(ws)])
    assert table is not None
    return table, total


def test_broken_array_plans_report_the_same_findings_as_per_rank_objects():
    rng = random.Random(7)
    for _ in range(400):
        table, total = _random_table(rng)
        meta = rng.choice([{}, {"balance_target": total // len(table), "balance_tolerance": 1},
                           {"padded_shard_numel": rng.randint(0, total + 3)}])
        plan = ShardPlan("random", len(table), total, table, rng.randint(0, 5), "", meta)
        _same_verdict(check_partition_plan(plan, limit=2), check_partition_plan(_as_tuples(plan), limit=2))


def test_the_array_sweep_finds_the_gaps_overlaps_and_owners_of_the_interval_sweep():
    rng = random.Random(3)
    for _ in range(2000):
        hi = rng.randint(0, 30)
        starts = [rng.randint(0, hi) for _ in range(rng.randint(0, 8))]
        items = [(s, rng.randint(s, hi), rng.randint(0, 4)) for s in starts]
        if rng.random() < 0.5:
            items.sort()
        limit = rng.randint(0, 3)
        cols = [np.array([it[i] for it in items], dtype=np.int64) for i in range(3)]
        assert sweep_arrays(*cols, 0, hi, limit) == sweep(items, 0, hi, limit)


def test_a_shard_table_reads_as_the_shards_it_holds():
    per_rank = [[(0, 3), (5, 6)], [], [(3, 5)]]
    table = ShardTable.from_lists(per_rank, [0, 4, 1])
    assert table is not None and len(table) == 3
    assert table[0] == RankShard(0, ((0, 3), (5, 6)), 0) and table[-1] == RankShard(2, ((3, 5),), 1)
    assert table[0] is table[0]  # made once, then kept
    assert table[1:] == (RankShard(1, (), 4), RankShard(2, ((3, 5),), 1))
    assert table == tuple(table) and list(table.real_numel()) == [4, 0, 2]
    assert ShardTable.from_lists([[(0, 2**63)]], [0]) is None  # beyond int64: the plan keeps tuples


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:4"])
@pytest.mark.parametrize("partitioner", ["seed", "fsdp", "round-robin"])
def test_derived_rank_states_check_as_the_materialised_plan(strategy, partitioner):
    layout = ParamLayout.from_config("tiny")
    plan = build_plan(layout, ShardingStrategy.parse(strategy), partitioner, Topology(8, 4))
    assert isinstance(plan.ranks, RankStates)
    materialised = dataclasses.replace(plan, ranks=tuple(plan.ranks))
    _same_verdict(check_partition_plan(plan), check_partition_plan(materialised))
    k = plan.shard_plan.world_size
    for r in (0, 5, 7):
        own = plan.shard_plan.shard(r % k).intervals
        assert plan.ranks[r].params.intervals == (own if plan.strategy.shards_params
                                                  else ((0, layout.total_numel),))


def test_bytes_from_cumulative_boundaries_equal_bytes_in():
    layout = ParamLayout.from_list([("a", (5,), "float32"), ("b", (0,), "float16"), ("c", (7,), "bfloat16"),
                                    ("d", (3,), "float64")])
    total = layout.total_numel
    for s in range(total + 1):
        for e in range(s, total + 1):
            got = int(bytes_before(layout, np.array([e]))[0] - bytes_before(layout, np.array([s]))[0])
            assert got == bytes_in(layout, ((s, e),))
    cols = shard_columns(layout, get_partitioner("fsdp")(layout, 4))
    shards = get_partitioner("fsdp")(layout, 4).shards
    assert list(cols.nbytes) == [bytes_in(layout, s.intervals) for s in shards]


def test_a_million_ranks_by_a_quadrillion_parameters_is_planned_checked_and_summarised(capsys):
    assert MAX_WORLD_SIZE == 2**20
    plan = build_plan(ParamLayout.from_list([("flat", (10**15,))]), ShardingStrategy.parse("zero3"), "seed",
                      Topology(2**20))
    verdict = check_partition_plan(plan)
    assert verdict.passed and verdict.checked == 3 * 2**20
    shard = plan.shard_plan.shard(2**20 - 1)
    assert shard.intervals[-1][1] == 10**15 and shard.numel in (10**15 // 2**20, 10**15 // 2**20 + 1)
    assert main(["plan", "--params", "1e15", "--world-size", str(2**20)]) == 0
    out = capsys.readouterr().out
    assert "1048560 of 1048576 ranks elided" in out and "C-ZERO-001 holds" in out
    assert len(out.splitlines()) < 40


def test_the_exponent_fit_recovers_a_power_law():
    xs = [8, 32, 128, 1024]
    assert fit_exponent(xs, [3.0 * x**1.5 for x in xs]) == pytest.approx(1.5, rel=1e-12)
    assert fit_exponent([8], [1.0]) is None
    assert total_for(10) == 10**12 and total_for(20) == 10**15
