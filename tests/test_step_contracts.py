"""C-ZERO-002..005: each clause fails on a deliberately broken engine (or observation) with a useful
diagnostic."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from zerosim.checks import tolerance
from zerosim.checks.contracts import load_contracts
from zerosim.engine.config import RunConfig
from zerosim.engine.fault_catalog import FAULTS
from zerosim.engine.run_result import evaluate
from zerosim.engine.spmd import run_simulated, simulate_observations

STEP_CONTRACTS = ("C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005")


def failing(result):
    return sorted(k for k, v in result.verdicts.items() if not v.passed)


def first(result, contract, clause=None):
    vs = [v for v in result.verdicts[contract].violations if clause is None or v.clause == clause]
    assert vs, f"{contract}/{clause} did not fail: {[str(v) for v in result.verdicts[contract].violations]}"
    return vs[0]


def assert_diagnostic(v, contract, *, tensor=True, interval=True):
    """The violation names contract, step, rank, (tensor, element range,) expected and got, in the
    object and in the one-line text a user reads."""
    text = str(v)
    assert v.contract == contract and text.startswith(contract), text
    assert v.step is not None and "step=" in text, text
    assert v.ranks and "rank=" in text, text
    assert v.expected is not None and v.got is not None and "expected=" in text and "got=" in text, text
    if tensor:
        assert v.tensor and f"tensor={v.tensor}" in text, text
    if interval:
        assert v.interval is not None and v.interval[1] > v.interval[0], text
        assert f"range=[{v.interval[0]}, {v.interval[1]})" in text, text


# ---- the spec files and the code agree ------------------------------------------------------------

def test_specs_resolve_and_tolerances_match_the_code():
    specs = load_contracts()
    for cid in STEP_CONTRACTS:
        assert callable(specs[cid].resolve_check())
    tol = specs["C-ZERO-002"].tolerance
    for precision, t in tolerance.EQUIVALENCE_TOLERANCE.items():
        assert tol[precision] == {"atol_scale": t.atol_scale, "norm_rtol": t.norm_rtol}
    assert set(specs["C-ZERO-004"].clauses) == {
        "intervals",
        "padding",
        "bytes",
        "tracker",
        "transients_freed",
        "peak_bound",
    }


# ---- C-ZERO-002 --------------------------------------------------------------------------------------

def test_sum_instead_of_mean_fails_equivalence_naming_state_step_rank_and_tensor():
    r = run_simulated(
        RunConfig(strategy="zero3", world_size=4, steps=2, fault="sum-instead-of-avg", max_grad_norm=None)
    )
    assert failing(r) == ["C-ZERO-002"]
    v = first(r, "C-ZERO-002", "allclose")
    assert v.step == 0 and v.ranks and v.tensor is not None and v.interval is not None
    assert v.context["state"].startswith("optimizer.")  # Adam hides the scale in the weights, not in m
    assert math.isclose(v.got / v.expected, 4.0, rel_tol=1e-3)  # x world_size
    assert_diagnostic(v, "C-ZERO-002")
    assert_diagnostic(first(r, "C-ZERO-002", "bitwise"), "C-ZERO-002")


@pytest.mark.parametrize("strategy, extra", [("zero2", {}), ("zero1", {}),
                                             ("zero1", {"zero1_grad_reduce": "reduce_scatter"})])
def test_rank_local_clipping_fails_equivalence(strategy, extra):
    """Bug class 3 wherever the ranks sum owned elements for the norm: ZeRO-2, and ZeRO-1 (which
    sums its owned range whether it all-reduces the gradient or reduce-scatters it)."""
    r = run_simulated(
        RunConfig(strategy=strategy, world_size=4, steps=2, max_grad_norm=0.05, fault="local-norm-clip",
                  **extra)
    )
    assert "C-ZERO-002" in failing(r)
    clauses = {v.clause for v in r.verdicts["C-ZERO-002"].violations}
    assert {"grad_norm", "clip_coef", "allclose", "bitwise"} <= clauses


def test_norm_over_replicas_fails_equivalence_on_hybrid():
    r = run_simulated(RunConfig(strategy="hybrid_shard:2", world_size=4, steps=1, max_grad_norm=0.05,
                                fault="norm-over-replicas"))
    v = first(r, "C-ZERO-002", "grad_norm")
    assert math.isclose(v.got / v.expected, math.sqrt(2), rel_tol=1e-6)  # two replicas counted twice


def test_micro_batch_accumulation_without_average_fails():
    r = run_simulated(RunConfig(strategy="zero2", world_size=2, steps=1, micro_batches=2, optimizer="sgd",
                                fault="no-accum-average", max_grad_norm=None))
    v = first(r, "C-ZERO-002", "allclose")
    assert v.context["state"] in ("master", "optimizer.momentum_buffer")


def test_padding_leak_is_caught_even_though_no_real_element_changes():
    r = run_simulated(RunConfig(strategy="zero3", world_size=3, steps=1, fault="padding-leak"))
    v = first(r, "C-ZERO-002", "padding")
    assert v.expected == 0.0 and v.got != 0.0 and "padding" in v.message
    assert_diagnostic(v, "C-ZERO-002", interval=False)  # padding has no global range: shard positions instead
    p0, p1 = v.context["shard_positions"]
    assert p1 > p0 and f"[{p0}, {p1})" in v.message
    assert not any(x.clause in ("allclose", "bitwise") for x in r.verdicts["C-ZERO-002"].violations)


def test_bitwise_clause_catches_a_single_flipped_bit():
    cfg = RunConfig(strategy="zero3", world_size=2, steps=1)
    obs = simulate_observations(cfg)
    bad = copy.deepcopy(obs)
    vals = bad[1].steps[0].master.values
    vals.view(np.uint32)[3] ^= 1  # one ulp on one element of rank 1's shard
    r = evaluate(cfg, bad)
    v = first(r, "C-ZERO-002", "bitwise")
    assert v.ranks == (1,) and v.step == 0 and v.interval[1] - v.interval[0] == 1
    assert not any(x.clause == "allclose" for x in r.verdicts["C-ZERO-002"].violations)  # within tolerance
    assert evaluate(cfg, obs).passed


# ---- C-ZERO-003 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["zero3", "zero1", "hybrid_shard_zero2:2"])
def test_stale_parameters_on_one_rank_fail_identity(strategy):
    r = run_simulated(RunConfig(strategy=strategy, world_size=4, steps=2, fault="stale-params"))
    assert {"C-ZERO-002", "C-ZERO-003"} <= set(failing(r))
    v = first(r, "C-ZERO-003", "identical")
    assert 1 in v.ranks and v.tensor is not None and v.interval is not None
    m = first(r, "C-ZERO-003", "matches_master")
    assert m.ranks == (1,) and "stale" in m.message
    assert_diagnostic(v, "C-ZERO-003")
    assert_diagnostic(m, "C-ZERO-003")


def test_hybrid_without_replicate_all_reduce_diverges_and_misses_traffic():
    r = run_simulated(
        RunConfig(strategy="hybrid_shard:2", world_size=4, steps=1, fault="skip-replicate-allreduce")
    )
    assert failing(r) == ["C-ZERO-002", "C-ZERO-003", "C-ZERO-005"]
    v = first(r, "C-ZERO-003", "identical")
    assert v.ranks == (0, 2)  # rank 2 is rank 0's replica in the other shard group
    c5 = first(r, "C-ZERO-005", "ring_model")
    assert c5.context["group_kind"] == "replicate" and c5.got["calls"] == 0 and c5.expected["calls"] == 1


def test_equally_stale_ranks_fail_matches_master():
    cfg = RunConfig(strategy="zero1", world_size=2, steps=2)
    obs = simulate_observations(cfg)
    for o in obs:  # every rank reports the weights of step 0 at step 1: identical to each other, but stale
        o.steps[1].gathered = o.steps[0].gathered.copy()
    r = evaluate(cfg, obs)
    v = first(r, "C-ZERO-003", "matches_master")
    assert v.step == 1
    assert not any(x.clause == "identical" for x in r.verdicts["C-ZERO-003"].violations)


# ---- C-ZERO-004 --------------------------------------------------------------------------------------

def test_keeping_gathered_blocks_breaks_the_peak_bound_and_leaves_transients():
    r = run_simulated(RunConfig(strategy="zero3", world_size=4, steps=2, fault="keep-gathered"))
    assert "C-ZERO-004" in failing(r)
    t = first(r, "C-ZERO-004", "transients_freed")
    assert t.context["category"] == "gathered" and t.got > 0
    assert t.tensor in {
        "embedding",
        "blocks.0",
        "blocks.1",
        "final_norm",
        "lm_head",
    }  # the block left gathered
    assert_diagnostic(t, "C-ZERO-004", interval=False)
    p = first(r, "C-ZERO-004", "peak_bound")
    assert p.got > p.expected
    assert_diagnostic(p, "C-ZERO-004", tensor=False, interval=False)


def test_a_hidden_full_copy_breaks_ownership_intervals_and_bytes_are_consistent():
    r = run_simulated(RunConfig(strategy="zero1", world_size=4, steps=1, fault="hidden-full-copy"))
    assert failing(r) == ["C-ZERO-004"]
    v = first(r, "C-ZERO-004", "intervals")
    assert v.ranks == (0,) and v.context["kind"] == "optimizer" and v.tensor is not None
    assert "holds elements the plan does not give it" in v.message
    assert_diagnostic(v, "C-ZERO-004")


def test_misreported_holdings_fail_bytes_padding_and_tracker():
    cfg = RunConfig(strategy="zero3", world_size=3, steps=1)
    obs = simulate_observations(cfg)
    h = obs[2].steps[0].holdings["params"]
    obs[2].steps[0].holdings["params"] = type(h)(
        h.kind, h.intervals, h.stored_numel + 5, h.nbytes + 4, h.dtype
    )
    r = evaluate(cfg, obs)
    clauses = {v.clause for v in r.verdicts["C-ZERO-004"].violations}
    assert {"padding", "bytes", "tracker"} <= clauses


def test_plan_mismatch_names_missing_elements():
    cfg = RunConfig(strategy="zero2", world_size=2, steps=1)
    obs = simulate_observations(cfg)
    h = obs[0].steps[0].holdings["grads"]
    s, e = h.intervals[0]
    obs[0].steps[0].holdings["grads"] = type(h)(
        h.kind, ((s, e - 7),) + h.intervals[1:], h.stored_numel, h.nbytes, h.dtype
    )
    v = first(evaluate(cfg, obs), "C-ZERO-004", "intervals")
    assert v.interval == (e - 7, e) and "is missing" in v.message


# ---- C-ZERO-005 --------------------------------------------------------------------------------------

def test_an_extra_all_gather_fails_communication_with_expected_and_measured_bytes():
    r = run_simulated(RunConfig(strategy="zero3", world_size=4, steps=1, fault="extra-all-gather"))
    assert failing(r) == ["C-ZERO-005"]
    v = first(r, "C-ZERO-005", "ring_model")
    assert v.context["collective"] == "all_gather" and v.got["calls"] == v.expected["calls"] + 1
    assert v.got["bytes_sent"] > v.expected["bytes_sent"]
    # traffic has no tensor or element range: the diagnostic names the group kind and the collective
    assert_diagnostic(v, "C-ZERO-005", tensor=False, interval=False)
    assert "collective=all_gather" in str(v) and "group_kind=world" in str(v)


def test_every_catalogued_fault_is_one_value_the_engine_consults():
    """The catalogue is data: each engine and state-dict fault carries one EngineFault (a hook point and
    a corruption that hook knows), every hook point is used by some fault, and a partitioner fault
    hands the engine nothing (it breaks the plan instead)."""
    from zerosim.engine.fault_catalog import engine_fault
    from zerosim.engine.faults import CORRUPTIONS, EngineFault, Hook

    engines = {name: f for name, f in FAULTS.items() if f.where != "partitioner"}
    for name, fault in engines.items():
        assert isinstance(fault.corrupts, EngineFault), name
        assert fault.corrupts.corruption in CORRUPTIONS[fault.corrupts.hook], name
    used = {(f.corrupts.hook, f.corrupts.corruption) for f in engines.values() if f.corrupts is not None}
    assert used == {(h, c) for h, cs in CORRUPTIONS.items() for c in cs}
    assert {h for h, _ in used} == set(Hook)
    assert all(f.corrupts is None for f in FAULTS.values() if f.where == "partitioner")
    run = RunConfig(fault="stale-params", **FAULTS["stale-params"].example).resolve()
    assert engine_fault(run) == FAULTS["stale-params"].corrupts
    assert engine_fault(RunConfig(strategy="zero3", world_size=4).resolve()) is None
    with pytest.raises(ValueError, match="knows the corruptions"):  # a corruption the hook does not know
        EngineFault(Hook.PADDING, "sum")


def test_a_fault_acts_only_on_its_rank_and_step():
    from zerosim.engine.faults import EngineFault, Hook

    drift = EngineFault(Hook.OPTIMIZER_STEP, "count-twice", rank=1, step=0)
    assert drift.acts(Hook.OPTIMIZER_STEP, 1, 4, 0)
    assert not drift.acts(Hook.OPTIMIZER_STEP, 0, 4, 0)   # another rank
    assert not drift.acts(Hook.OPTIMIZER_STEP, 1, 4, 1)   # a later step
    assert not drift.acts(Hook.PADDING, 1, 4, 0)          # another hook
    assert drift.acts(Hook.OPTIMIZER_STEP, 0, 1, 0)       # a world of one rank: its only rank


def test_every_fault_fails_exactly_the_contracts_it_claims():
    """In its example configuration (two steps), each fault fails exactly the contracts it lists."""
    for name, fault in FAULTS.items():
        r = run_simulated(RunConfig(fault=name, **{"steps": 2, **fault.example}))
        assert failing(r) == sorted(fault.catches), name


def test_checks_are_pure_functions_of_the_observations():
    cfg = RunConfig(strategy="hybrid_shard:2", world_size=4, steps=2)
    obs = simulate_observations(cfg)
    a, b = evaluate(cfg, obs), evaluate(cfg, obs)
    assert a.passed and {k: v.to_json() for k, v in a.verdicts.items()} == {
        k: v.to_json() for k, v in b.verdicts.items()
    }
