"""The closed-form memory model (C-ZERO-004's expectation): the ZeRO paper's figures, every strategy,
hybrid, offload, precisions and optimizers, partitioner padding, and bad input."""

from __future__ import annotations

import math

import pytest

from zerosim.cost.memory_model import all_strategies, memory_per_rank
from zerosim.cost.memory_settings import MemorySettings, parse_offload
from zerosim.cost.shard_sizes import parse_param_count, shard_sizes
from zerosim.cost.units import format_bytes, format_value, to_unit
from zerosim.errors import ConfigError
from zerosim.values.layout import ParamLayout
from zerosim.values.strategy import ShardingStrategy, Topology

PSI = 7_500_000_000
ND = 64


def paper_bytes(stage: int, psi: int, nd: int, K: int = 12) -> float:
    """The ZeRO paper's model-state bytes per device (sec. 3, Figure 1)."""
    return {0: (2 + 2 + K) * psi, 1: 2 * psi + 2 * psi + K * psi / nd, 2: 2 * psi + (2 + K) * psi / nd,
            3: (2 + 2 + K) * psi / nd}[stage]


@pytest.mark.parametrize("strategy,stage,printed", [
    ("ddp", 0, "120 GB"), ("zero1", 1, "31.4 GB"), ("zero2", 2, "16.6 GB"), ("zero3", 3, "1.88 GB"),
])
def test_zero_paper_figure_for_7_5b_at_64_ranks(strategy, stage, printed):
    est = memory_per_rank(7.5e9, strategy, ND)
    total = est.per_rank.total.device
    assert total == paper_bytes(stage, PSI, ND)
    assert format_bytes(total, "GB") == printed
    assert est.per_rank.total.host == 0
    assert est.settings.K == 12


@pytest.mark.parametrize("nd", [1, 2, 3, 7, 64, 1000, 1024])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_paper_formula_holds_at_any_degree_up_to_padding(nd, stage):
    psi = 1_000_003  # prime: never divisible, padding is ceil(psi/nd)*nd - psi
    strat = ["ddp", "zero1", "zero2", "zero3"][stage]
    c = memory_per_rank(psi, strat, nd).per_rank
    shard = math.ceil(psi / nd)
    exact = {0: 16 * psi, 1: 4 * psi + 12 * shard, 2: 2 * psi + 14 * shard, 3: 16 * shard}[stage]
    assert c.total.device == exact
    assert 0 <= exact - paper_bytes(stage, psi, nd) < 16 * 1  # padding costs less than one element per rank


def test_categories_and_bytes_per_element_per_strategy():
    psi, n = 1_200, 4
    expect = {  # (params, grads, optimizer) elements per rank
        "no_shard": (psi, psi, psi), "shard_optimizer": (psi, psi, psi // n),
        "shard_grad_op": (psi, psi // n, psi // n), "full_shard": (psi // n, psi // n, psi // n),
    }
    for strat in all_strategies(Topology(n)):
        c = memory_per_rank(psi, strat, n).per_rank
        p, g, o = expect[strat.name]
        assert (c.params.device, c.grads.device, c.optimizer_states.device) == (2 * p, 2 * g, 12 * o)
        assert c.numel == {"params": p, "grads": g, "optimizer_states": o}


def test_hybrid_shards_inside_the_node_group_only():
    topo = Topology(16, 4)
    hsdp = memory_per_rank(8_000, "hybrid_shard", topo).per_rank
    zero3_at_4 = memory_per_rank(8_000, "zero3", 4).per_rank
    assert hsdp.total.device == zero3_at_4.total.device == 16 * 8_000 // 4
    hz2 = memory_per_rank(8_000, "hybrid_shard_zero2:4", topo)
    assert hz2.per_rank.total.device == 2 * 8_000 + 14 * 8_000 // 4
    assert hz2.shard_group_size == 4 and hz2.per_rank.count == 16
    assert [s.name for s in all_strategies(topo)][-2:] == ["hybrid_shard:4", "hybrid_shard_zero2:4"]
    assert len(all_strategies(Topology(16))) == 4  # one node: hybrid would equal full_shard


def test_hybrid_group_must_divide_world():
    with pytest.raises(ConfigError, match="intra_node_size"):
        memory_per_rank(1000, "hybrid_shard:3", Topology(8))


@pytest.mark.parametrize(
    "precision,optimizer,K,pb,gb",
    [
        ("mixed", "adamw", 12, 2, 2),
        ("mixed", "adam", 12, 2, 2),
        ("mixed", "sgd", 4, 2, 2),
        ("mixed", "sgd-momentum", 8, 2, 2),
        ("fp32", "adamw", 8, 4, 4),
        ("fp32", "sgd", 0, 4, 4),
        ("fp32", "sgd-momentum", 4, 4, 4),
        ("bf16-fp32grads", "adamw", 12, 2, 4),
        ("bf16-pure", "adamw", 4, 2, 2),
        ("bf16", "adamw", 12, 2, 4),
        ("fp16", "sgd", 4, 2, 4),
    ],
)
def test_precision_and_optimizer_bytes(precision, optimizer, K, pb, gb):
    s = MemorySettings(precision, optimizer)
    assert s.K == K
    c = memory_per_rank(1_000, "no_shard", 1, s).per_rank
    assert (c.params.device, c.grads.device, c.optimizer_states.device) == (pb * 1000, gb * 1000, K * 1000)
    z3 = memory_per_rank(1_000, "zero3", 8, s).per_rank
    assert z3.total.device == (pb + gb + K) * 125


def test_offload_moves_bytes_to_host_without_changing_totals():
    base = memory_per_rank(64_000, "zero3", 8).per_rank
    for offload, on_host in [
        ("optimizer", {"optimizer_states"}),
        ("grads+optimizer", {"grads", "optimizer_states"}),
        ("params+optimizer", {"params", "optimizer_states"}),
        ("all", {"params", "grads", "optimizer_states"}),
    ]:
        c = memory_per_rank(64_000, "zero3", 8, MemorySettings(offload=offload)).per_rank
        assert c.total.total == base.total.total
        for cat in ("params", "grads", "optimizer_states"):
            placed = c.category(cat)
            assert (placed.host > 0) == (cat in on_host) and (placed.device > 0) == (cat not in on_host)
    assert parse_offload("params+optimizer") == {"params", "optimizer_states"}
    with pytest.raises(ConfigError, match="offload"):
        memory_per_rank(64_000, "zero2", 8, MemorySettings(offload="params+optimizer"))
    with pytest.raises(ConfigError, match="offload"):
        MemorySettings(offload="gpu")


def test_zero3_transient_is_prefetch_depth_plus_one_largest_blocks():
    """Forward: (1 + d) gathered blocks in the param dtype; backward: d prefetched + one packed fp32 grad."""
    uniform = ParamLayout.from_list([(f"blocks.{i}.w", (100,)) for i in range(6)])
    for depth in (0, 1, 3, 5):
        for precision, pb, gb in (("mixed", 2, 2), ("bf16-fp32grads", 2, 4), ("fp32", 4, 4)):
            c = memory_per_rank(uniform, "zero3", 4, MemorySettings(precision, prefetch_depth=depth)).per_rank
            assert c.transient["forward"] == (1 + depth) * 100 * pb
            assert c.transient["backward"] == max((1 + depth) * 100 * pb, depth * 100 * pb + 100 * gb)
            assert c.peak_device == c.total.device + max(c.transient.values())
    # uneven blocks: the largest window of consecutive blocks, each padded to a multiple of k
    layout = ParamLayout.from_config("tiny")
    sizes = [math.ceil(layout.block_numel(b) / 4) * 4 for b in layout.blocks]
    for depth in (0, 1, 3):
        c = memory_per_rank(layout, "zero3", 4, MemorySettings(prefetch_depth=depth)).per_rank
        assert c.transient["forward"] == 2 * max(sum(sizes[j:j + depth + 1]) for j in range(len(sizes)))
    # params offloaded: the device holds only the transient
    off = memory_per_rank(layout, "zero3", 4, MemorySettings(offload="all")).per_rank
    assert off.total.device == 0 and off.peak_device == off.transient_device > 0
    # bare count: no block structure -> no transient, and a note says so; largest_block_numel fills it in
    bare = memory_per_rank(10**9, "zero3", 8)
    assert bare.per_rank.transient_device == 0 and any("transient" in n for n in bare.notes)
    given = memory_per_rank(10**9, "zero3", 8, MemorySettings(prefetch_depth=1), largest_block_numel=800)
    assert given.per_rank.transient["forward"] == 2 * 800 * 2


def test_zero2_and_zero1_transients_follow_the_engine_schedule():
    c = memory_per_rank(1003, "zero2", 4, MemorySettings("bf16")).per_rank  # bf16 params, fp32 grads
    assert c.transient == {"backward_end": 1003 * 2 + 1004 * 4, "refresh": 1004 * 2}
    c = memory_per_rank(1003, "zero2", 4, MemorySettings("bf16", grad_bucket_numel=100)).per_rank
    assert c.transient["backward_end"] == 1003 * 2 + 100 * 4
    # all-reduce ZeRO-1 steps a view of its accumulation buffer: only the all-gather is transient
    c = memory_per_rank(1003, "zero1", 4, MemorySettings("fp32")).per_rank
    assert c.transient == {"refresh": 1004 * 4}
    assert memory_per_rank(1003, "no_shard", 4).per_rank.transient == {}


def test_zero1_reduce_scatter_holds_the_packed_gradient_and_the_chunk_at_once():
    """DeepSpeed stage 1 (``zero1_grad_reduce="reduce_scatter"``): during the reduce the packed full fp32
    gradient and the rank's reduced fp32 chunk are live together, and the chunk, a buffer of its own,
    stays live until the params are refreshed (all-reduce ZeRO-1 steps a view of its accumulation
    buffer instead)."""
    settings = MemorySettings("bf16", zero1_grad_reduce="reduce_scatter")  # bf16 params, fp32 grads
    c = memory_per_rank(1003, "zero1", 4, settings).per_rank
    assert c.transient == {"reduce": 1004 * 4 + 251 * 4, "optimizer": 251 * 4, "refresh": 1004 * 2 + 251 * 4}
    assert c.transient_device == 1004 * 4 + 251 * 4
    default = memory_per_rank(1003, "zero1", 4, MemorySettings("bf16")).per_rank
    assert "reduce" not in default.transient and default.transient_device == 1004 * 2
    assert (c.params, c.grads, c.optimizer_states) == (
        default.params,
        default.grads,
        default.optimizer_states,
    )
    for strategy in ("no_shard", "zero2", "zero3"):  # the option is ZeRO-1's only
        assert (memory_per_rank(1003, strategy, 4, settings).per_rank.transient
                == memory_per_rank(1003, strategy, 4, MemorySettings("bf16")).per_rank.transient)
    with pytest.raises(ConfigError, match="zero1_grad_reduce.*scatter"):
        MemorySettings(zero1_grad_reduce="scatter")


def test_fp32_zero1_and_zero2_keep_a_separate_master_shard():
    for strat, master in (
        ("no_shard", 0),
        ("zero1", 4),
        ("zero2", 4),
        ("zero3", 0),
        ("hybrid_shard_zero2:2", 4),
    ):
        c = memory_per_rank(1000, strat, Topology(4, 2), MemorySettings("fp32", "adamw")).per_rank
        assert c.optimizer_states.device == (8 + master) * c.numel["optimizer_states"]


def test_partitioner_closed_forms_padding_and_rank_classes():
    layout = ParamLayout.from_list([("a", (5, 3)), ("b", (7,)), ("c", (2, 2))])  # 15 + 7 + 4 = 26
    assert shard_sizes(layout, 4).max_stored == 7 and shard_sizes(layout, 4).padding == 2
    seed = shard_sizes(layout, 4, "seed")  # 26 = 7,7,6,6
    assert [(c.stored_numel, c.count, c.local_ranks) for c in seed.classes] == [
        (7, 2, ((0, 2),)),
        (6, 2, ((2, 4),)),
    ]
    assert seed.padding == 0
    ds = shard_sizes(layout, 4, "deepspeed")  # padded to a multiple of 8: 32 -> 8 each
    assert ds.max_stored == 8 and ds.padding == 6
    ds3 = shard_sizes(layout, 4, "deepspeed_zero3")  # ceil(15/4)+ceil(7/4)+ceil(4/4) = 4+2+1
    assert ds3.max_stored == 7 and ds3.padding == 2
    fsdp = shard_sizes(layout, 4, "fsdp")  # ceil(5/4)*3 + ceil(7/4)*1 + ceil(2/4)*2 = 6+2+2
    assert fsdp.max_stored == 10 and fsdp.padding == 14
    zro = shard_sizes(layout, 4, "zero_redundancy")  # whole tensors: 15 | 7 | 4 | 0
    assert sorted(c.stored_numel for c in zro.classes) == [0, 4, 7, 15] and zro.padding == 0
    # the rank classes carry through to the estimate: seed's first two ranks hold one element more
    est = memory_per_rank(layout, "hybrid_shard", Topology(8, 4), partitioner="seed")
    assert [c.count for c in est.classes] == [4, 4]  # two shard groups x two local ranks per class
    assert est.per_rank.numel["params"] == 7


def test_large_scale_is_closed_form():
    topo = Topology(1024, 8)
    for strat in all_strategies(topo):
        est = memory_per_rank(10**12, strat, topo)
        assert len(est.classes) == 1
    z3 = memory_per_rank(10**12, "zero3", topo).per_rank
    assert z3.total.device == 16 * math.ceil(10**12 / 1024)
    big = memory_per_rank(ParamLayout.from_config("gpt3-175b"), "zero3", topo, partitioner="zero_redundancy")
    assert sum(c.count for c in big.classes) == 1024


def test_json_is_bytes_and_consistent():
    est = memory_per_rank(ParamLayout.from_config("tiny"), "hybrid_shard:2", Topology(4, 2))
    j = est.to_json()
    assert j["units"] == "bytes" and j["shard_group_size"] == 2 and j["replicate_group_size"] == 2
    pr = j["per_rank"]
    for place in ("device", "host"):
        assert pr["total"][place] == sum(pr[c][place] for c in ("params", "grads", "optimizer_states"))
        assert all(isinstance(pr[c][place], int) for c in ("params", "grads", "optimizer_states", "total"))


@pytest.mark.parametrize("bad", ["abc", "0", "-3", "1.5", "nan", "inf", True, 0, -1e9, ""])
def test_bad_param_counts_name_the_field(bad):
    with pytest.raises(ConfigError, match="params"):
        parse_param_count(bad)


def test_param_count_spellings():
    assert parse_param_count("7.5e9") == parse_param_count("7.5B") == parse_param_count(7.5e9) == PSI
    assert parse_param_count("1T") == 10**12 and parse_param_count("124_439_808") == 124439808


def test_bad_settings_and_topology():
    with pytest.raises(ConfigError, match="precision"):
        MemorySettings(precision="fp8")
    with pytest.raises(ConfigError, match="optimizer"):
        MemorySettings(optimizer="lamb")
    with pytest.raises(ConfigError, match="prefetch_depth"):
        MemorySettings(prefetch_depth=-1)
    with pytest.raises(ConfigError, match="world_size"):
        memory_per_rank(100, "zero3", 0)
    with pytest.raises(ConfigError, match="strategy"):
        memory_per_rank(100, "zero4", 4)
    with pytest.raises(ConfigError, match="topology"):
        memory_per_rank(100, "zero3", "four")
    assert memory_per_rank(100, ShardingStrategy.parse("zero3"), Topology(4)).per_rank.numel["params"] == 25


def test_units_gb_vs_gib():
    assert to_unit(2**30, "GiB") == 1.0 and to_unit(10**9, "GB") == 1.0
    assert format_bytes(1_875_000_000, "GB") == "1.88 GB"
    assert format_bytes(2**31, binary=True) == "2 GiB"
    assert format_value(1_875_000_000, "GiB") == "1.746"
    with pytest.raises(ConfigError, match="unit"):
        to_unit(1, "gigabytes")


@pytest.mark.parametrize("partitioner", ["seed", "deepspeed", "deepspeed-zero3", "fsdp", "zero-redundancy"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 16])
@pytest.mark.parametrize("model", ["tiny", "odd"])
def test_closed_forms_equal_the_real_partitioners(partitioner, k, model):
    """Each closed form gives exactly the stored (real + padding) elements of the partitioner's ShardPlan."""
    from zerosim.partition import get_partitioner

    layout = (ParamLayout.from_config("tiny") if model == "tiny" else
              ParamLayout.from_list([("a", (5, 3)), ("b", (7,)), ("c", (2, 2)), ("d", (1,)), ("e", (13, 1))]))
    plan = get_partitioner(partitioner)(layout, k)
    got = sorted(s for c in shard_sizes(layout, k, partitioner).classes for s in [c.stored_numel] * c.count)
    assert got == sorted(s.padded_numel for s in plan.shards)
    assert shard_sizes(layout, k, partitioner).padding == plan.total_padding


def test_partitioners_without_closed_form_are_measured_on_the_layout():
    layout = ParamLayout.from_config("tiny")
    sizes = shard_sizes(layout, 2, "round-robin")
    assert "measured" in sizes.rule and sum(c.count for c in sizes.classes) == 2
    with pytest.raises(ConfigError, match="partitioner"):
        shard_sizes(10_000, 2, "round-robin")
    with pytest.raises(ConfigError, match="partitioner"):
        shard_sizes(layout, 2, "no-such-rule")


@pytest.mark.parametrize(
    "strategy", ["no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2"]
)
@pytest.mark.parametrize("offload", ["none", "grads+optimizer"])
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_modelled_timeline_peaks_at_the_closed_form_peak(strategy, offload, depth):
    from zerosim.cost.memory_timeline import modelled_step_timeline

    layout = ParamLayout.from_config("tiny")
    settings = MemorySettings("bf16", "adamw", offload, depth)
    est, points = modelled_step_timeline(layout, strategy, Topology(4, 2), settings, micro_batches=2)
    assert max(p.device for p in points) == est.per_rank.peak_device
    assert min(p.device for p in points) == est.per_rank.total.device
    assert {p.host for p in points} == {est.per_rank.total.host}


@pytest.mark.parametrize("offload", ["none", "grads+optimizer"])
def test_modelled_timeline_peaks_at_the_zero1_reduce_scatter_peak(offload):
    from zerosim.cost.memory_timeline import modelled_step_timeline

    settings = MemorySettings("bf16", "adamw", offload, zero1_grad_reduce="reduce_scatter")
    est, points = modelled_step_timeline(ParamLayout.from_config("tiny"), "zero1", Topology(4, 2), settings)
    assert max(p.device for p in points) == est.per_rank.peak_device
    assert [p.device - est.per_rank.total.device for p in points if p.phase == "reduce"] == [
        est.per_rank.transient["reduce"]]


def test_fp32_offload_keeps_a_separate_host_master():
    """fp32 params on the device cannot be the master the host optimizer steps: K grows by 4 there."""
    on = memory_per_rank(1000, "zero3", 4, MemorySettings("fp32", "adamw", "grads+optimizer")).per_rank
    assert on.optimizer_states.host == (8 + 4) * 250 and on.params.device == 4 * 250
    everything = memory_per_rank(1000, "zero3", 4, MemorySettings("fp32", "adamw", "all")).per_rank
    assert everything.optimizer_states.host == 8 * 250  # the host params are the master


@pytest.mark.parametrize("k", [0, -2, None, "4", 2.0, True])
def test_shard_sizes_refuses_a_group_size_that_is_not_a_positive_integer(k):
    with pytest.raises(ConfigError, match=r"invalid k=.*must be a positive integer"):
        shard_sizes(10, k)
