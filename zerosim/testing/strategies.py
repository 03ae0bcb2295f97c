"""Hypothesis strategies for property tests of sharded training code (yours and ours).

    from hypothesis import given
    from zerosim.testing.strategies import layouts, world_sizes, shard_plans, plans

    @given(shard_plans())
    def test_my_engine_accepts_every_plan(plan): ...

Everything generated is a plain zerosim value: ``ParamLayout``, ``Topology``, ``ShardingStrategy``,
``ShardPlan``, ``StatePlan``. Needs the ``hypothesis`` package (the ``test`` extra).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from ..partition import PARTITIONERS
from ..partition.base import ShardPlan
from ..values.layout import ParamLayout, TensorSpec
from ..values.plan import StatePlan, build_plan
from ..values.strategy import ShardingStrategy, StrategyKind, Topology

DTYPES = ("float32", "bfloat16", "float16")
EDGE_TOTALS = (0, 1, 2, 3, 7, 63, 64, 65, 1023, 1025, 1_000_003, 10**12, 2**61 - 1)


def world_sizes(max_value: int = 64) -> st.SearchStrategy[int]:
    """World sizes 1..max_value, shrinking towards 1."""
    return st.integers(1, max_value)


def totals(max_value: int = 10**12) -> st.SearchStrategy[int]:
    """Parameter counts: edge cases (0, 1, primes, 10^12) mixed with arbitrary values."""
    edges = st.sampled_from([t for t in EDGE_TOTALS if t <= max_value])
    return st.one_of(edges, st.integers(0, max_value))


def shapes(
    max_dims: int = 3, max_side: int = 24, allow_empty: bool = True
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes with 0..max_dims dims (0-d scalars and zero-sized dims included when allowed)."""
    return st.lists(st.integers(0 if allow_empty else 1, max_side), min_size=0 if allow_empty else 1,
                    max_size=max_dims).map(tuple)


@st.composite
def layouts(draw: Any, max_blocks: int = 6, max_tensors_per_block: int = 3, max_side: int = 24,
            allow_empty: bool = True, mixed_dtypes: bool = True) -> ParamLayout:
    """GPT-like layouts: optional embedding, ``blocks.N`` with a few tensors each, optional final
    norm and lm head (sometimes tied to the embedding), shapes from 0-d up to 3-d."""
    dtype = st.sampled_from(DTYPES) if mixed_dtypes else st.just("float32")
    shape = shapes(3, max_side, allow_empty)
    tensors: list[TensorSpec] = []
    aliases: dict[str, str] = {}
    has_embedding = draw(st.booleans())
    if has_embedding:
        tensors.append(TensorSpec("wte.weight", draw(shape), draw(dtype), "embedding"))
    for b in range(draw(st.integers(0, max_blocks))):
        for t in range(draw(st.integers(1, max_tensors_per_block))):
            tensors.append(TensorSpec(f"blocks.{b}.w{t}", draw(shape), draw(dtype), f"blocks.{b}"))
    if draw(st.booleans()):
        tensors.append(TensorSpec("ln_f.weight", draw(shape), draw(dtype), "final_norm"))
    if has_embedding and draw(st.booleans()):
        aliases["lm_head.weight"] = "wte.weight"  # tied: counted once
    elif draw(st.booleans()):
        tensors.append(TensorSpec("lm_head.weight", draw(shape), draw(dtype), "lm_head"))
    if not tensors:
        tensors.append(TensorSpec("w", draw(shape), draw(dtype), "other"))
    return ParamLayout(tuple(tensors), aliases, "hypothesis")


def flat_layouts(max_total: int = 10**12) -> st.SearchStrategy[ParamLayout]:
    """One flat tensor of ``total`` elements (for flat partitioners at huge sizes)."""
    return totals(max_total).map(lambda n: ParamLayout.from_list([("flat", (n,))], name=f"flat-{n}"))


def partitioner_names() -> st.SearchStrategy[str]:
    return st.sampled_from(sorted(PARTITIONERS))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def topologies(draw: Any, max_world_size: int = 64) -> Topology:
    """A world size and a ranks-per-node that divides it."""
    ws = draw(world_sizes(max_world_size))
    return Topology(ws, draw(st.sampled_from(_divisors(ws))))


@st.composite
def sharding_strategies(
    draw: Any, topology: Topology | None = None, max_world_size: int = 64
) -> ShardingStrategy:
    """Any strategy; hybrid ones get a shard group size that divides the (given or drawn) world size."""
    kind = draw(st.sampled_from(list(StrategyKind)))
    if kind in (StrategyKind.HYBRID_SHARD, StrategyKind.HYBRID_SHARD_ZERO2):
        ws = topology.world_size if topology is not None else draw(world_sizes(max_world_size))
        return ShardingStrategy(kind, draw(st.sampled_from(_divisors(ws))))
    return ShardingStrategy(kind)


strategies = sharding_strategies  # the name the docs use


@st.composite
def shard_plans(draw: Any, layout: st.SearchStrategy[ParamLayout] | None = None, max_world_size: int = 64,
                partitioner: st.SearchStrategy[str] | None = None) -> ShardPlan:
    """The ShardPlan of a (drawn) partitioner on a (drawn) layout and world size."""
    lay = draw(layout if layout is not None else layouts())
    name = draw(partitioner if partitioner is not None else partitioner_names())
    return PARTITIONERS[name](lay, draw(world_sizes(max_world_size)))


@st.composite
def plans(draw: Any, layout: st.SearchStrategy[ParamLayout] | None = None, max_world_size: int = 32,
          partitioner: st.SearchStrategy[str] | None = None) -> StatePlan:
    """A StatePlan: layout x topology x compatible strategy x partitioner."""
    lay = draw(layout if layout is not None else layouts())
    topo = draw(topologies(max_world_size))
    strat = draw(sharding_strategies(topology=topo))
    name = draw(partitioner if partitioner is not None else partitioner_names())
    return build_plan(lay, strat, name, topo)


__all__ = [
    "flat_layouts", "layouts", "partitioner_names", "plans", "shapes", "shard_plans", "sharding_strategies",
    "strategies", "topologies", "totals", "world_sizes",
]
