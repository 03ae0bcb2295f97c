"""C-ZERO-001 by interval arithmetic (zerosim.checks.owned_intervals): each wrong layout fails naming the
tensor, the range and the ranks; on in-bounds layouts it agrees with the element-by-element check."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from zerosim.checks.owned_intervals import owned_intervals_verdict
from zerosim.checks.partition import check_partition_plan

NUMELS = {"w": 12, "b": 4}


def _found(owned, numels=NUMELS):
    verdict, layout = owned_intervals_verdict(owned, numels, step=7)
    return verdict, layout, [(v.clause, v.tensor, v.interval, tuple(v.ranks)) for v in verdict.violations]


def test_sharded_and_hybrid_layouts_pass():
    verdict, layout, _ = _found({0: {"w": [(0, 6)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": []}})
    assert verdict.passed and layout == "sharded (each element owned once)"
    hybrid = {r: {"w": [(0, 6)] if r % 2 == 0 else [(6, 12)], "b": [(0, 4)] if r % 2 == 0 else []}
              for r in range(4)}
    verdict, layout, _ = _found(hybrid)
    assert verdict.passed and layout == "hybrid: 2 shard(s) x 2 replicas"


def test_a_gap_fails_naming_tensor_and_range():
    verdict, _, found = _found({0: {"w": [(0, 5)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": []}})
    assert found == [("coverage", "w", (5, 6), ())]
    assert verdict.violations[0].step == 7
    assert "1 element(s) owned by no rank" in verdict.violations[0].message


def test_an_overlap_fails_naming_tensor_range_and_both_ranks():
    _, _, found = _found({0: {"w": [(0, 7)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": []}})
    assert found == [("disjoint", "w", (6, 7), (0,))]
    verdict, _, _ = _found({0: {"w": [(0, 7)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": []}})
    assert verdict.violations[0].context["ranks"] == [0, 1]


def test_a_range_past_the_end_fails_naming_tensor_and_rank():
    _, _, found = _found({0: {"w": [(0, 6)], "b": [(0, 4)]}, 1: {"w": [(6, 15)], "b": []}})
    assert found == [("padding", "w", (12, 15), (1,))]
    _, _, found = _found({0: {"w": [(0, 6)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "x": [(0, 1)]}})
    assert found == [("well_formed", "x", (0, 0), (1,))]
    _, _, found = _found({0: {"w": [(0, 6)], "b": [(4, 0)]}, 1: {"w": [(6, 12)], "b": [(0, 4)]}})
    assert found == [("well_formed", "b", (4, 0), (0,))]


def test_a_rank_listing_elements_twice_and_a_replica_that_differs():
    _, _, found = _found({0: {"w": [(0, 6), (4, 6)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": []}})
    assert found == [("disjoint", "w", (4, 6), (0,))]
    # every element owned twice, but ranks 2 and 3 hold pieces of both shards: not replicas of one
    crossed = {0: {"w": [(0, 6)], "b": [(0, 4)]}, 1: {"w": [(6, 12)], "b": [(0, 4)]},
               2: {"w": [(0, 3), (6, 9)], "b": []}, 3: {"w": [(3, 6), (9, 12)], "b": []}}
    verdict, _, found = _found(crossed)
    assert {c for c, *_ in found} == {"replicas"}, found
    assert ("replicas", "*", (0, 0), (2,)) in found  # rank 2 alone: a group of 1, not 2 replicas
    assert ("replicas", "w", (3, 6), (2,)) in found  # rank 0 owns w[3, 6), rank 2 (sharing w[0, 3)) not
    assert verdict.violations[0].context["ranks"] == [0]


@dataclass
class _Rank:
    rank: int
    step: int
    shards: dict
    phase: str = "monitor"


@dataclass
class _Step:
    step: int
    ranks: list = field(default_factory=list)
    phase: str = "monitor"


def test_agrees_with_the_element_by_element_check_on_random_layouts():
    rng = random.Random(5)
    for _ in range(400):
        numels = {f"t{i}": rng.randint(1, 12) for i in range(rng.randint(1, 3))}
        world = rng.randint(1, 6)
        mode = rng.random()
        owned = {}
        for r in range(world):
            mine = {}
            for name, size in numels.items():
                if mode < 0.3:
                    mine[name] = [tuple(sorted((rng.randint(0, size), rng.randint(0, size))))
                                  for _ in range(rng.randint(0, 2))]
                else:
                    k = 2 if mode > 0.65 and world % 2 == 0 else 1
                    groups = world // k
                    per = -(-size // groups)
                    a, b = min(r % groups * per, size), min((r % groups + 1) * per, size)
                    mine[name] = [(max(0, a - 1) if rng.random() < 0.1 else a, b)]
            owned[r] = mine
        verdict, _ = owned_intervals_verdict(owned, numels)
        steps = [_Step(0, [_Rank(r, 0, owned[r]) for r in range(world)])]
        reference = check_partition_plan(steps, numels=numels)
        assert verdict.passed == reference.passed, (owned, numels)
        if "replicas" not in {v.clause for v in reference.violations}:
            assert {v.clause for v in verdict.violations} == {v.clause for v in reference.violations}, owned
