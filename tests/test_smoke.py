from zerosim import ParamLayout, ShardingStrategy, Topology


def test_gpt2_small_parameter_count_counts_tied_weights_once():
    layout = ParamLayout.from_config("gpt2-small")
    assert layout.total_numel == 124_439_808
    assert layout.aliases == {"lm_head.weight": "wte.weight"}


def test_hybrid_groups_are_node_major():
    s = ShardingStrategy.parse("hybrid_shard:2")
    t = Topology(4, 2)
    assert t.shard_groups(s) == [[0, 1], [2, 3]]
    assert t.replicate_groups(s) == [[0, 2], [1, 3]]
