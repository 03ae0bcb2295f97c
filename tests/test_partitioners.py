"""The partitioners: the seed's API, each peer's rule on hand-worked cases and against torch, and
C-ZERO-001 as a property of every partitioner on generated layouts and world sizes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosim import ConfigError, OptimizerShard, ParamLayout, ZeroShardMap
from zerosim.checks import check_partition_plan
from zerosim.partition import PARTITIONERS, get_partitioner
from zerosim.testing.strategies import flat_layouts, layouts, partitioner_names, world_sizes

PADDED = ("deepspeed", "deepspeed-zero3", "fsdp")


def shards_of(plan):
    return [(list(s.intervals), s.padding) for s in plan.shards]


def flat(n):
    return ParamLayout.from_list([("flat", (n,))])


# ---- OptimizerShard (the seed's semantics) --------------------------------------------------------
def test_optimizer_shard_even_split():
    s = OptimizerShard.for_rank(0, 4, 100)
    assert (s.param_start, s.param_end, s.shard_size()) == (0, 25, 25)
    assert s.owns_param(0) and s.owns_param(24) and not s.owns_param(25)


def test_optimizer_shard_first_ranks_take_the_remainder():
    shards = OptimizerShard.all_ranks(3, 10)
    assert [(s.param_start, s.param_end) for s in shards] == [(0, 4), (4, 7), (7, 10)]
    assert [s.shard_size() for s in shards] == [4, 3, 3]


def test_optimizer_shard_completeness_on_a_prime_by_intervals():
    total, ws = 1_000_003, 7
    shards = OptimizerShard.all_ranks(ws, total)
    assert shards[0].param_start == 0 and shards[-1].param_end == total
    assert all(a.param_end == b.param_start for a, b in zip(shards, shards[1:], strict=False))
    assert {s.shard_size() for s in shards} == {total // ws, total // ws + 1}


def test_optimizer_shard_memory_accounting():
    s = OptimizerShard.for_rank(0, 4, 1_000_000)
    assert s.memory_savings() == pytest.approx(0.75)
    assert s.full_memory_bytes() == 8_000_000  # m + v, fp32
    assert s.shard_memory_bytes() == 2_000_000


@pytest.mark.parametrize("args, field", [
    ((0, 0, 10), "world_size"), ((0, -2, 10), "world_size"), ((4, 4, 10), "rank"), ((-1, 4, 10), "rank"),
    ((0, 4, -5), "total_params"), ((True, 4, 10), "rank"), ((0, 4, 2.5), "total_params"),
])
def test_optimizer_shard_bad_input_names_the_field(args, field):
    with pytest.raises(ConfigError) as e:
        OptimizerShard.for_rank(*args)
    assert e.value.field == field


@settings(max_examples=200, deadline=None)
@given(ws=st.integers(1, 1024), total=st.integers(0, 2**64))
def test_optimizer_shard_sizes_within_one_of_floor_at_any_size(ws, total):
    shards = OptimizerShard.all_ranks(ws, total) if ws <= 64 else [
        OptimizerShard.for_rank(r, ws, total) for r in (0, ws // 2, ws - 1)]
    for s in shards:
        assert total // ws <= s.shard_size() <= total // ws + 1
    if ws <= 64:
        assert shards[-1].param_end == total


# ---- ZeroShardMap -----------------------------------------------------------------------------------
def test_zero_shard_map_round_robin():
    m = ZeroShardMap.round_robin(24, 4)
    assert [m.block_owner(i) for i in range(5)] == [0, 1, 2, 3, 0]
    assert m.num_blocks_for_rank(0) == m.num_blocks_for_rank(1) == 6
    assert m.blocks_for_rank(0) == [0, 4, 8, 12, 16, 20]
    assert m.memory_fraction_for_rank(0) == pytest.approx(0.25)
    assert (m.embedding_owner, m.final_norm_owner, m.lm_head_owner) == (0, 0, 0)


def test_zero_shard_map_contiguous_even_and_uneven():
    m = ZeroShardMap.contiguous(24, 4)
    assert [m.blocks_for_rank(r) for r in range(4)] == [list(range(6 * r, 6 * r + 6)) for r in range(4)]
    u = ZeroShardMap.contiguous(10, 3)
    assert [u.num_blocks_for_rank(r) for r in range(3)] == [4, 3, 3]
    c = ZeroShardMap.contiguous(12, 3)
    assert c.rank_owns_block(0, 0) and c.rank_owns_block(0, 3) and not c.rank_owns_block(0, 4)
    assert c.rank_owns_block(1, 4)


def test_zero_shard_map_bad_input_is_our_error_not_a_panic():
    m = ZeroShardMap.round_robin(4, 2)
    for call, field in [(lambda: m.block_owner(4), "block_idx"), (lambda: m.block_owner(-1), "block_idx"),
                        (lambda: m.blocks_for_rank(2), "rank"), (lambda: m.rank_owns_block(-1, 0), "rank"),
                        (lambda: ZeroShardMap.round_robin(4, 0), "world_size"),
                        (lambda: ZeroShardMap.contiguous(-1, 2), "num_blocks"),
                        (lambda: ZeroShardMap((0, 5), 2), "block_owners[1]")]:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.field == field
    assert ZeroShardMap.round_robin(0, 3).memory_fraction_for_rank(1) == 0.0
    with pytest.raises(ConfigError, match="num_blocks"):
        ZeroShardMap.round_robin(5, 2).to_shard_plan(ParamLayout.from_config("tiny"))


def test_block_fraction_misleads_byte_fraction_does_not():
    """gpt2-small: the (tied) embedding is ~32% of the model and sits on rank 0."""
    layout = ParamLayout.from_config("gpt2-small")
    m = ZeroShardMap.contiguous(12, 4)
    emb = sum(layout.block_bytes(b) for b in layout.blocks if b.kind in ("embedding", "final_norm"))
    per_block = layout.block_bytes(next(b for b in layout.blocks if b.kind == "block"))
    assert emb / layout.total_bytes > 0.3
    assert [m.memory_fraction_for_rank(r) for r in range(4)] == [0.25] * 4
    fractions = [m.byte_fraction_for_rank(r, layout) for r in range(4)]
    assert fractions[0] == pytest.approx((emb + 3 * per_block) / layout.total_bytes)
    assert fractions[1] == pytest.approx(3 * per_block / layout.total_bytes)
    assert sum(fractions) == pytest.approx(1.0)
    plan = get_partitioner("contiguous")(layout, 4)
    assert plan.meta["byte_fraction"] == pytest.approx(fractions)
    assert plan.meta["block_fraction"] == [0.25] * 4


# ---- each rule on hand-worked cases ---------------------------------------------------------------------
def test_seed_partitioner_is_the_optimizer_shard_rule():
    plan = get_partitioner("seed")(flat(10), 3)
    assert shards_of(plan) == [([(0, 4)], 0), ([(4, 7)], 0), ([(7, 10)], 0)]
    assert plan.balance_bound == 1 and plan.meta["balance_target"] == 3


def test_deepspeed_zero12_pads_the_flat_buffer_to_a_multiple_of_2ws():
    plan = get_partitioner("deepspeed")(flat(10), 4)  # 10 -> 16 (multiple of 8), 4 per rank
    assert shards_of(plan) == [([(0, 4)], 0), ([(4, 8)], 0), ([(8, 10)], 2), ([], 4)]
    assert plan.meta["padded_shard_numel"] == 4 and plan.total_padding == 6
    plan3 = get_partitioner("deepspeed")(flat(10), 3)  # 10 -> 12 (multiple of 6)
    assert shards_of(plan3) == [([(0, 4)], 0), ([(4, 8)], 0), ([(8, 10)], 2)]


def test_deepspeed_zero12_lets_a_parameter_straddle_ranks():
    layout = ParamLayout.from_list([("a", (3,)), ("b", (5,))])
    plan = get_partitioner("deepspeed")(layout, 2)  # 8 -> 8, 4 per rank; b = [3, 8) straddles
    assert shards_of(plan) == [([(0, 4)], 0), ([(4, 8)], 0)]


def test_deepspeed_zero3_pads_each_parameter_to_a_multiple_of_ws():
    layout = ParamLayout.from_list([("a", (5,)), ("b", (2, 4))])
    plan = get_partitioner("deepspeed-zero3")(layout, 4)  # a: 5 -> 8, 2 each; b: 8, 2 each
    assert shards_of(plan) == [([(0, 2), (5, 7)], 0), ([(2, 4), (7, 9)], 0), ([(4, 5), (9, 11)], 1),
                               ([(11, 13)], 2)]
    assert plan.meta["padded_shard_numel"] == 4


def test_fsdp_chunks_dim0_and_pads_to_chunk0():
    layout = ParamLayout.from_list([("w", (5, 3)), ("s", ()), ("z", (0, 4))])
    plan = get_partitioner("fsdp")(layout, 4)  # rows 2, 2, 1, 0 of 3 elements; scalar on rank 0
    assert shards_of(plan) == [([(0, 6), (15, 16)], 0), ([(6, 12)], 1), ([(12, 15)], 4), ([], 7)]
    assert plan.meta["padded_shard_numel"] == 7


def test_zero_redundancy_sorted_greedy_whole_tensors():
    layout = ParamLayout.from_list([("a", (7,)), ("b", (5,)), ("c", (4,)), ("d", (3,)), ("e", (1,))])
    plan = get_partitioner("zero-redundancy")(layout, 2)
    # 7 -> r0; 5 -> r1; 4 -> r1 (5 < 7); 3 -> r0 (7 < 9); 1 -> r1 (9 < 10)
    assert shards_of(plan) == [([(0, 7), (16, 19)], 0), ([(7, 16), (19, 20)], 0)]
    assert plan.balance_bound == 7
    ties = get_partitioner("zero-redundancy")(
        ParamLayout.from_list([("x", (2,)), ("y", (2,)), ("z", (2,))]), 2
    )
    assert ties.meta["tensor_owners"] == [0, 1, 0]  # equal sizes keep layout order, lowest rank first


def test_block_partitioners_keep_blocks_whole_and_pin_embedding_norm_head_to_rank0():
    layout = ParamLayout.from_config("tiny")
    for name in ("round-robin", "contiguous"):
        plan = get_partitioner(name)(layout, 2)
        for block in layout.blocks:
            lo = layout.offsets[block.tensor_indices[0]]
            last = block.tensor_indices[-1]
            hi = layout.offsets[last] + layout.tensors[last].numel
            owners = [s.rank for s in plan.shards if any(a <= lo and hi <= b for a, b in s.intervals)]
            assert len(owners) == 1, (name, block.name)
            if block.kind != "block":
                assert owners == [0]


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partitioners_reject_bad_world_sizes_and_layouts(name):
    part = get_partitioner(name)
    for ws in (0, -3, 2.0, True):
        with pytest.raises(ConfigError) as e:
            part(flat(10), ws)
        assert e.value.field == "world_size"
    with pytest.raises(ConfigError) as e:
        part("not a layout", 2)
    assert e.value.field == "layout"


def test_unknown_partitioner():
    with pytest.raises(ConfigError) as e:
        get_partitioner("magic")
    assert e.value.field == "partitioner" and "seed" in str(e.value)


# ---- against torch's own implementations ---------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple), ws=st.integers(1, 12))
def test_fsdp_rule_matches_torch_chunk(shape, ws):
    torch = pytest.importorskip("torch")
    n = 1
    for d in shape:
        n *= d
    t = torch.arange(n).reshape(shape)
    chunks = list(torch.chunk(t, ws, dim=0)) if shape[0] else []
    plan = get_partitioner("fsdp")(ParamLayout.from_list([("t", shape)]), ws)
    chunk0 = chunks[0].numel() if chunks else 0
    for r in range(ws):
        expected = chunks[r].flatten().tolist() if r < len(chunks) else []
        got = [i for a, b in plan.shards[r].intervals for i in range(a, b)]
        assert got == expected
        assert plan.shards[r].padded_numel == chunk0


@settings(max_examples=40, deadline=None)
@given(numels=st.lists(st.integers(0, 50), min_size=1, max_size=10), ws=st.integers(1, 6))
def test_zero_redundancy_rule_matches_torch(numels, ws):
    torch = pytest.importorskip("torch")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Probe(ZeroRedundancyOptimizer):  # torch's partitioning code, no process group needed
        def __init__(self, params, world_size):
            self.world_size = world_size
            self.param_groups = [{"params": params}]
            self._partition_parameters_cache = []

    params = [torch.empty(n, device="meta") for n in numels]
    try:
        per_rank = Probe(params, ws)._partition_parameters()
    except AttributeError as e:  # pragma: no cover - torch internals moved
        pytest.skip(f"torch ZeroRedundancyOptimizer internals changed: {e}")
    torch_owner = {id(p): r for r, groups in enumerate(per_rank) for p in groups[0]["params"]}
    layout = ParamLayout.from_list([(f"p{i}", (n,)) for i, n in enumerate(numels)])
    plan = get_partitioner("zero-redundancy")(layout, ws)
    assert plan.meta["tensor_owners"] == [torch_owner[id(p)] for p in params]


# ---- C-ZERO-001 as a property of every partitioner --------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(layout=layouts(), ws=world_sizes(64), name=partitioner_names())
def test_every_partitioner_satisfies_c_zero_001(layout, ws, name):
    plan = PARTITIONERS[name](layout, ws)
    verdict = check_partition_plan(plan)
    assert verdict.passed, [str(v) for v in verdict.violations]
    assert sum(s.numel for s in plan.shards) == layout.total_numel
    if name in PADDED:
        assert len({s.padded_numel for s in plan.shards}) == 1
    else:
        assert plan.total_padding == 0


@settings(max_examples=60, deadline=None)
@given(
    layout=flat_layouts(2**61),
    ws=st.sampled_from([1, 2, 3, 7, 64, 1000, 1024]),
    name=st.sampled_from(["seed", "deepspeed", "deepspeed-zero3", "fsdp", "zero-redundancy", "contiguous"]),
)
def test_flat_partitioners_hold_at_huge_totals(layout, ws, name):
    verdict = check_partition_plan(PARTITIONERS[name](layout, ws))
    assert verdict.passed, [str(v) for v in verdict.violations]


@settings(max_examples=80, deadline=None)
@given(layout=layouts(), ws=world_sizes(16))
def test_deepspeed_alignment_and_balance_bounds_are_tight_enough(layout, ws):
    ds = PARTITIONERS["deepspeed"](layout, ws)
    assert (ds.meta["padded_shard_numel"] * ws) % (2 * ws) == 0
    assert ds.total_padding < 2 * ws
    zr = PARTITIONERS["zero-redundancy"](layout, ws)
    sizes = [s.numel for s in zr.shards]
    assert max(sizes) - min(sizes) <= max(layout.numels())
    seed = PARTITIONERS["seed"](layout, ws)
    assert max(s.numel for s in seed.shards) - min(s.numel for s in seed.shards) <= 1
