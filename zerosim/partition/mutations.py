"""Deliberately broken partition rules: the boundary bugs sharding code ships, as transforms of a plan.

Each mutation takes a correct rule (``fn(layout, world_size) -> ShardPlan``) and returns the plan a
buggy implementation of it would produce. They exist so C-ZERO-001 can be shown to catch each bug
class (``zerosim simulate --fault shard-off-by-one``, ``zerosim mutants``); nothing selects one
unless a fault names it. Interval arithmetic only: a mutation never materialises elements.

* ``off_by_one``: every rank but the last stops one element early (an exclusive end computed as
  ``end - 1``): one element between neighbours is owned by nobody.
* ``overlapping``: every rank but the first starts one element early: the boundary element is owned
  by two ranks (their updates race, the norm counts it twice).
* ``dropped_remainder``: ``total % world_size`` elements at the end of the space, the remainder of
  an even split, are dropped by the rank that should hold them.
* ``trailing_unowned``: the rule is evaluated for ``world_size + 1`` ranks (the world counted one too
  many) and the first ``world_size`` shards are handed out: the last shard belongs to no rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from ..values.layout import ParamLayout
from .base import RankShard, RegisteredPartitioner, ShardPlan

Rule = Callable[[ParamLayout, int], ShardPlan]


def _with_intervals(plan: ShardPlan, intervals: list[list[tuple[int, int]]]) -> ShardPlan:
    shards = tuple(RankShard(s.rank, tuple(iv for iv in ivs if iv[1] > iv[0]), s.padding)
                   for s, ivs in zip(plan.shards, intervals, strict=True))
    return replace(plan, shards=shards, meta=_without_shard_size(plan))


def _without_shard_size(plan: ShardPlan) -> dict:
    """The plan's meta without its declared padded shard size (a broken plan no longer has one)."""
    return {k: v for k, v in plan.meta.items() if k != "padded_shard_numel"}


def _intervals(plan: ShardPlan) -> list[list[tuple[int, int]]]:
    return [sorted(s.intervals) for s in plan.shards]


def off_by_one(rule: Rule, layout: ParamLayout, world_size: int) -> ShardPlan:
    plan = rule(layout, world_size)
    ivs = _intervals(plan)
    for r in range(world_size - 1):
        if ivs[r]:
            s, e = ivs[r][-1]
            ivs[r][-1] = (s, e - 1)
    return _with_intervals(plan, ivs)


def overlapping(rule: Rule, layout: ParamLayout, world_size: int) -> ShardPlan:
    plan = rule(layout, world_size)
    ivs = _intervals(plan)
    for r in range(1, world_size):
        if ivs[r] and ivs[r][0][0] > 0:
            s, e = ivs[r][0]
            ivs[r][0] = (s - 1, e)
    return _with_intervals(plan, ivs)


def dropped_remainder(rule: Rule, layout: ParamLayout, world_size: int) -> ShardPlan:
    plan = rule(layout, world_size)
    drop_from = plan.total - plan.total % world_size
    ivs = [[(s, min(e, drop_from)) for s, e in rank] for rank in _intervals(plan)]
    return _with_intervals(plan, ivs)


def trailing_unowned(rule: Rule, layout: ParamLayout, world_size: int) -> ShardPlan:
    wider = rule(layout, world_size + 1)
    shards = tuple(RankShard(r, s.intervals, s.padding) for r, s in enumerate(wider.shards[:world_size]))
    return replace(wider, world_size=world_size, shards=shards, meta=_without_shard_size(wider))


MUTATIONS: dict[str, Callable[[Rule, ParamLayout, int], ShardPlan]] = {
    "off_by_one": off_by_one,
    "overlapping": overlapping,
    "dropped_remainder": dropped_remainder,
    "trailing_unowned": trailing_unowned,
}


def mutate(rule: RegisteredPartitioner, mutation: str) -> RegisteredPartitioner:
    """``rule`` with one of :data:`MUTATIONS` applied to every plan it makes (named ``rule+mutation``)."""
    broken = MUTATIONS[mutation]
    return RegisteredPartitioner(f"{rule.name}+{mutation}", f"{rule.description} (broken: {mutation})",
                                 lambda layout, n: broken(rule.fn, layout, n))
