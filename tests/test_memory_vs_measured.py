"""The memory and traffic models against what the backends measure (C-ZERO-004 / C-ZERO-005, cost side).

Every run of the reference engine is compared category by category: params, grads, optimizer
state (from the ranks' live arrays), the step's transient buffers (from the memory tracker's
timeline) and the data traffic (from the traffic counters, split intra / inter node). The model
with the engine's packing must match exactly; the ZeRO paper's even split may differ only by the
partitioner's padding, and by exactly the padding's bytes.
"""

from __future__ import annotations

import pytest

from zerosim.engine.spmd import RunConfig, simulate_observations
from zerosim.numerics.model import SimModelConfig
from zerosim.report.measure import (
    memory_comparison,
    modelled_for_run,
    run_under_mpi,
    run_under_torch,
    torch_unavailable_reason,
    traffic_comparison,
)

ODD = SimModelConfig(vocab_size=37, d_model=12, n_layer=3, d_ff=20, seq_len=4, batch_size=2)  # 2,175 params


def strategies_for(ws: int) -> list[str]:
    out = ["no_shard", "zero1", "zero2", "zero3"]
    if ws >= 4:
        out += ["hybrid_shard:2", "hybrid_shard_zero2:2"]
    return out


CASES = [(ws, s, prec) for ws in (1, 2, 4, 8) for s in strategies_for(ws) for prec in ("fp32", "bf16")]


def _check_exact(cmp: dict, run) -> None:
    rows = {r["category"]: r for r in cmp["rows"]}
    for cat, r in rows.items():
        assert r["rel_diff_vs_engine_model"] == 0.0 and r["placement_matches"], (cat, r)
        assert r["measured_max_rank"] == r["measured_min_rank"] or cat == "transient", (cat, r)
    # the paper's even split differs by the padding alone, byte for byte
    paper = modelled_for_run(run, "partitioner", partitioner=None).per_rank
    engine = modelled_for_run(run, "engine").per_rank
    for cat in ("params", "grads", "optimizer_states"):
        pad = engine.numel[cat] - paper.numel[cat]
        per_elem = engine.category(cat).total // max(engine.numel[cat], 1)
        assert rows[cat]["measured_max_rank"] - rows[cat]["model_paper"] == pad * per_elem
        if pad:
            assert "padding" in rows[cat]["explanation"]


@pytest.mark.parametrize("ws,strategy,precision", CASES)
def test_model_equals_measured_on_the_tiny_model(ws, strategy, precision):
    run = RunConfig(
        model="tiny", world_size=ws, strategy=strategy, precision=precision, steps=1, prefetch=1
    ).resolve()
    obs = simulate_observations(run)
    _check_exact(memory_comparison(run, obs), run)
    t = traffic_comparison(run, obs)
    assert t["measured"]["sent_max_rank"] == t["measured"]["sent_min_rank"] == t["model"]["sent"]
    assert t["measured"]["intra"] == t["model"]["intra"] and t["measured"]["inter"] == t["model"]["inter"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("ws", [2, 4, 5])
@pytest.mark.parametrize("variant", ["all_reduce", "reduce_scatter"])
def test_zero1_gradient_reduction_variants_are_modelled_exactly(variant, ws, precision):
    """ZeRO-1's two gradient reductions (RunConfig.zero1_grad_reduce): persistent categories and the
    step's transient equal the measured ones exactly. reduce_scatter (DeepSpeed stage 1) holds the packed
    full fp32 gradient and the reduced fp32 chunk together (bf16: more than the param refresh)."""
    run = RunConfig(model="tiny", world_size=ws, strategy="zero1", precision=precision, steps=1,
                    zero1_grad_reduce=variant).resolve()
    obs = simulate_observations(run)
    cmp = memory_comparison(run, obs)
    _check_exact(cmp, run)
    rows = {r["category"]: r for r in cmp["rows"]}
    for cat in ("params", "grads", "optimizer_states", "total", "transient"):
        assert (
            rows[cat]["measured_max_rank"] == rows[cat]["measured_min_rank"] == rows[cat]["model_engine"]
        ), cat
    model = modelled_for_run(run, "engine")
    assert model.settings.zero1_grad_reduce == variant
    phases = model.per_rank.transient
    packed, chunk = model.units[0].packed_numel, model.per_rank.numel["optimizer_states"]
    if variant == "reduce_scatter":
        assert phases["reduce"] == packed * 4 + chunk * 4 == rows["transient"]["measured_max_rank"]
    else:
        assert "reduce" not in phases
        assert rows["transient"]["measured_max_rank"] == phases["refresh"]


@pytest.mark.parametrize("partitioner", ["fsdp", "deepspeed", "deepspeed-zero3", "seed", "zero-redundancy"])
@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("ws", [3, 8])
def test_padding_is_explained_on_an_odd_shaped_model(partitioner, strategy, ws):
    """Odd shapes: every partitioner pads differently; the engine-packing model still matches exactly."""
    run = RunConfig(model=ODD, world_size=ws, strategy=strategy, partitioner=partitioner, steps=1,
                    optimizer="sgd").resolve()
    obs = simulate_observations(run)
    cmp = memory_comparison(run, obs)
    _check_exact(cmp, run)
    t = traffic_comparison(run, obs)
    assert t["measured"]["sent_max_rank"] == t["model"]["sent"]


@pytest.mark.parametrize("strategy", ["zero3", "hybrid_shard:2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_cpu_offload_placement_and_bytes_are_modelled(strategy, precision, prefetch):
    """Engine offload = master, optimizer state and gradient shard on the host; the working params
    stay on the device (in fp32 as a separate copy of the host master)."""
    run = RunConfig(model="tiny", world_size=4, strategy=strategy, precision=precision, steps=1, offload=True,
                    prefetch=prefetch).resolve()
    obs = simulate_observations(run)
    if not any(h.location == "host" for h in obs[0].steps[-1].holdings.values()):
        pytest.skip("this engine build accepts offload but keeps everything on the device")
    cmp = memory_comparison(run, obs)
    _check_exact(cmp, run)
    m = cmp["measured_per_rank"][0]
    assert m["params"]["host"] == 0 and m["grads"]["device"] == 0 and m["optimizer_states"]["device"] == 0


def test_prefetch_depth_and_sgd_variants_are_modelled():
    for prefetch in (0, 2):
        for optimizer, extra in (("sgd", {"momentum": 0.0}), ("sgd", {}), ("adam", {})):
            run = RunConfig(model="tiny", world_size=4, strategy="zero3", steps=1, prefetch=prefetch,
                            optimizer=optimizer, extra=extra).resolve()
            obs = simulate_observations(run)
            _check_exact(memory_comparison(run, obs), run)


def test_deliberately_wrong_engines_are_caught_and_named():
    """A hidden full copy (persistent) and never-freed gathered blocks (transient) show up as non-zero
    differences against the model, named by category."""
    run = RunConfig(model="tiny", world_size=4, strategy="zero3", steps=2, fault="hidden-full-copy").resolve()
    rows = {r["category"]: r for r in memory_comparison(run, simulate_observations(run))["rows"]}
    psi = run.layout.total_numel  # the hidden copy: psi fp32 values on top of an Adam shard of 2 x psi/4
    assert rows["optimizer_states"]["rel_diff_vs_engine_model"] == pytest.approx(psi * 4 / (psi // 4 * 8))
    assert "UNEXPLAINED" in rows["optimizer_states"]["explanation"]
    assert (
        rows["optimizer_states"]["measured_min_rank"] == rows["optimizer_states"]["model_engine"]
    )  # ranks 1..3
    run = RunConfig(model="tiny", world_size=4, strategy="zero3", steps=2, fault="keep-gathered").resolve()
    rows = {r["category"]: r for r in memory_comparison(run, simulate_observations(run))["rows"]}
    assert rows["transient"]["rel_diff_vs_engine_model"] > 0.5
    assert rows["params"]["rel_diff_vs_engine_model"] == 0.0


@pytest.mark.mpi
@pytest.mark.parametrize("ws,strategies", [(2, ("zero2", "zero3")), (4, ("zero3", "hybrid_shard:2"))])
def test_model_equals_measured_under_mpiexec(ws, strategies):
    """Real processes (2 ranks per node at 4 ranks): memory per category and traffic per link class."""
    from zerosim.mpi.launch import mpi_unavailable_reason

    reason = mpi_unavailable_reason()
    if reason:
        pytest.skip(reason)
    for strategy in strategies:
        cfg = RunConfig(model="tiny", world_size=ws, strategy=strategy, steps=1, prefetch=1,
                        ranks_per_node=2 if ws > 2 else None)
        res = run_under_mpi(cfg, timeout_s=120)
        assert res.error is None, res.error
        assert [o.backend for o in res.observations] == ["mpi"] * ws
        run = cfg.resolve()
        _check_exact(memory_comparison(run, res.observations), run)
        t = traffic_comparison(run, res.observations)
        assert t["measured"]["sent_max_rank"] == t["model"]["sent"]
        assert (t["measured"]["intra"], t["measured"]["inter"]) == (t["model"]["intra"], t["model"]["inter"])
        if ws > 2:
            assert t["model"]["inter"] > 0  # two nodes: some ring edges cross them


@pytest.mark.torchdist
def test_model_equals_measured_under_torchrun_at_two_ranks():
    """The torch.distributed backend (zerogpu, gloo on CPU, torch arrays) allocates and sends what the
    models say, like the simulator and MPI."""
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    cfgs = [
        RunConfig(model="tiny", world_size=2, strategy=s, steps=1, prefetch=1) for s in ("zero2", "zero3")
    ]
    res = run_under_torch(cfgs, 2, timeout_s=240)
    assert res.error is None, res.error
    for cfg, obs in zip(cfgs, res.observations, strict=True):
        assert [o.backend for o in obs] == ["torch", "torch"]
        run = cfg.resolve()
        _check_exact(memory_comparison(run, obs), run)
        assert (
            traffic_comparison(run, obs)["measured"]["sent_max_rank"]
            == traffic_comparison(run, obs)["model"]["sent"]
        )
