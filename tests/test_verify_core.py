"""zerosim verify's core: tolerance derivation, C-ZERO-001/002/003 checks, diagnosis, targets, report JSON,
protocol validation, CLI bad input, and one end-to-end run at world 2 with an in-test DDP trainer.

The checks and the diagnosis are pure functions: most tests build step records from the real float64
reference (in-process, milliseconds) and a "trainer" whose observations are the reference's values
with one deliberate bug, and assert the failure names the contract, step, rank, tensor and range.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from zerosim.checks.equivalence import check_step_equivalence, float32_masters
from zerosim.checks.identity import check_replica_identity
from zerosim.checks.partition import check_partition_plan
from zerosim.checks.tolerance import ErrorModel, adam_direction_bound, gamma, reduction_length
from zerosim.errors import ConfigError
from zerosim.verify import Diagnosis, RankFailure, TrainerError, VerifyReport, verify
from zerosim.verify.diagnosis import bug_classes, diagnose
from zerosim.verify.model import PRESETS, build_model, micro_batch, parameter_count
from zerosim.verify.observation import StepObservation, StepRecord
from zerosim.verify.outcome import stated
from zerosim.verify.protocol import (
    close_trainer,
    require_trainer_object,
    validate_local_shards,
    validate_parameters,
)
from zerosim.verify.reference import Reference, choose_clip, make_optimizer
from zerosim.verify.suite import MAX_STEPS, PHASE_CONFIGS, build_phases
from zerosim.verify.targets import resolve_factory

REPO = Path(__file__).resolve().parents[1]
SGD = dict(PHASE_CONFIGS["sgd"])
ADAMW = {**PHASE_CONFIGS["adamw"], "max_grad_norm": 2.0}


def judged(check, *args):
    """A check of zerosim.checks on the records: the verdict verify's report holds."""
    return check(*args)


def owned_ranges(records, numels, mesh=None):
    """C-ZERO-001's check on the element ranges the records' ranks own."""
    return check_partition_plan(records, numels=numels, mesh=mesh)


# ---- helpers: a correct in-process data-parallel trainer, and records from it -----------------------------


def data_parallel_steps(
    optim: dict,
    world: int,
    steps: int,
    dtype: str = "float64",
    first_step: int = 1,
    bug: str | None = None,
    data_offset: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Parameters after each step of a correct data-parallel computation done the sharded way (each rank's
    gradient on its own micro-batch, added in rank order, divided by world), with an optional bug."""
    model = build_model("gpt", dtype)
    params = list(model.parameters())
    opt = make_optimizer(params, optim)
    out = []
    for k in range(steps):
        step = first_step + k
        grads = [torch.zeros_like(p) for p in params]
        for r in range(world):
            model.zero_grad(set_to_none=True)
            model(*micro_batch(r, step + data_offset)).backward()
            for g, p in zip(grads, params, strict=True):
                g += p.grad
        for g, p in zip(grads, params, strict=True):
            p.grad = g if bug == "summed" else g / world
        if optim.get("max_grad_norm") is not None:
            torch.nn.utils.clip_grad_norm_(params, optim["max_grad_norm"], foreach=False)
        if bug == "double-decay":
            with torch.no_grad():
                for p in params:
                    p.mul_(1 - optim["lr"] * optim["weight_decay"])
        opt.step()
        out.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    return out


def records_for(
    optim: dict,
    world: int,
    steps: int,
    trajectories: list[list[dict[str, np.ndarray]]],
    dtype: str = "float64",
    phase: str | None = None,
    shards=None,
    data_offset: int = 0,
) -> list[StepRecord]:
    """StepRecords: the reference and its bounds beside ``trajectories[rank][step]``."""
    model = build_model("gpt", dtype)
    ref = Reference(model, optim, world, phase=phase or optim["name"], data_offset=data_offset)
    em = ErrorModel(optim, dtype, PRESETS["gpt"], world)
    records = []
    for k in range(steps):
        rs = ref.step(k + 1)
        obs = [
            StepObservation(
                rs.phase, k + 1, r, 0.0, trajectories[r][k], None, None if shards is None else shards[r]
            )
            for r in range(world)
        ]
        records.append(StepRecord(rs, em.step(rs), obs))
    return records


def numels() -> dict[str, int]:
    return {n: p.numel() for n, p in build_model("gpt").named_parameters()}


def flat_shards(world: int, cut=None) -> list[dict[str, list[tuple[int, int]]]]:
    """ZeRO-1 style ownership of the flattened model: rank r owns [r*c, (r+1)*c) of the concatenation."""
    sizes = numels()
    total = sum(sizes.values())
    chunk = math.ceil(total / world)
    out = []
    for r in range(world):
        lo, hi = r * chunk, min((r + 1) * chunk, total)
        if cut is not None:
            lo, hi = cut(r, lo, hi)
        mine: dict[str, list[tuple[int, int]]] = {}
        offset = 0
        for name, n in sizes.items():
            a, b = max(lo, offset), min(hi, offset + n)
            mine[name] = [(a - offset, b - offset)] if a < b else []
            offset += n
        out.append(mine)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 matmuls: one thread is 20x faster than two on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sgd_correct():
    world = 3
    traj = data_parallel_steps(SGD, world, 3)
    return world, traj


# ---- the model ---------------------------------------------------------------------------------------------


def test_model_sizes_do_not_divide_by_small_world_sizes():
    for name in PRESETS:
        model = build_model(name)
        count = parameter_count(model)
        assert all(count % k for k in (2, 3, 4, 8)), (name, count)
        odd = [n for n, p in model.named_parameters() if all(p.numel() % k for k in (2, 3, 4, 8))]
        assert len(odd) >= 5, odd
    tied = build_model("gpt-tied")
    assert tied.head.weight is tied.wte.weight
    assert "head.weight" not in dict(tied.named_parameters())


def test_micro_batches_differ_per_rank_and_step_and_repeat():
    a, b, c = micro_batch(0, 1), micro_batch(1, 1), micro_batch(0, 2)
    assert not torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    assert torch.equal(micro_batch(1, 1)[0], b[0])
    assert torch.equal(build_model("gpt").wte.weight, build_model("gpt").wte.weight)


# ---- tolerance ---------------------------------------------------------------------------------------------


def test_gamma_and_reduction_length():
    u = 2.0**-53
    assert gamma(10, u) == pytest.approx(10 * u, rel=1e-12)
    assert gamma(2**53, u) == math.inf
    assert reduction_length(PRESETS["gpt"], 4) > 4 * PRESETS["gpt"].batch * PRESETS["gpt"].block


def test_adam_direction_bound_holds_for_any_gradient_sequence():
    rng = np.random.default_rng(0)
    b1, b2 = 0.9, 0.999
    assert adam_direction_bound(b1, b2, 1) == pytest.approx(1.0)
    for _ in range(200):
        g = rng.standard_normal(12) * 10.0 ** rng.uniform(-6, 3, 12)
        if rng.random() < 0.5:
            g[:-1] *= 1e-9  # the worst case: everything in the last gradient
        m = v = 0.0
        for t, gt in enumerate(g, start=1):
            m = b1 * m + (1 - b1) * gt
            v = b2 * v + (1 - b2) * gt * gt
            r = (m / (1 - b1**t)) / math.sqrt(v / (1 - b2**t))
            assert abs(r) <= adam_direction_bound(b1, b2, t) * (1 + 1e-12)


@pytest.mark.parametrize("optim", [SGD, ADAMW], ids=["sgd", "adamw"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_correct_sharded_computation_stays_within_the_derived_bound(optim, dtype):
    world, steps = 4, 4
    traj = data_parallel_steps(optim, world, steps, dtype)
    outcome = judged(check_step_equivalence, records_for(optim, world, steps, [traj] * world, dtype))
    assert outcome.status == "pass", outcome.reason
    assert outcome.details["max_error"] <= outcome.details["tolerance"]


@pytest.mark.parametrize("optim", [SGD, ADAMW], ids=["sgd", "adamw"])
def test_weight_decay_twice_exceeds_the_float64_bound(optim):
    world, steps = 2, 2
    traj = data_parallel_steps(optim, world, steps, bug="double-decay")
    outcome = judged(check_step_equivalence, records_for(optim, world, steps, [traj] * world))
    assert outcome.status == "fail"
    first = outcome.first_violation
    assert first["step"] == 1 and first["contract"] == "C-ZERO-002"
    assert first["error"] > first["tolerance"]


# ---- C-ZERO-002 / 003 --------------------------------------------------------------------------------------


def test_equivalence_names_rank_tensor_and_range(sgd_correct):
    world, traj = sgd_correct
    bad = copy.deepcopy(traj)
    bad[1]["blocks.0.fc.bias"][10:13] += 1e-6  # step 2, rank 2
    trajectories = [traj, traj, bad]
    outcome = judged(check_step_equivalence, records_for(SGD, world, 3, trajectories))
    assert outcome.status == "fail"
    v = outcome.first_violation
    assert (v["step"], v["rank"], v["tensor"], v["start"], v["stop"]) == (2, 2, "blocks.0.fc.bias", 10, 13)
    assert v["phase"] == "sgd" and v["got"] - v["expected"] == pytest.approx(1e-6, rel=1e-6)
    assert "3 of 47 elements" in v["message"]


def test_identity_names_the_odd_rank_out(sgd_correct):
    world, traj = sgd_correct
    bad = copy.deepcopy(traj)
    flat = bad[0]["wpe.weight"].reshape(-1)
    flat[100] = np.nextafter(flat[100], np.inf)  # one ulp, step 1, rank 1
    outcome = judged(check_replica_identity, records_for(SGD, world, 3, [traj, bad, traj]))
    assert outcome.status == "fail"
    v = outcome.first_violation
    assert (v["step"], v["rank"], v["tensor"], v["start"], v["stop"]) == (1, 1, "wpe.weight", 100, 101)
    assert "rank(s) 0,2" in v["message"]
    assert judged(check_replica_identity, records_for(SGD, world, 3, [traj] * world)).status == "pass"


def test_live_trainer_verdicts_use_the_contracts_own_clauses(sgd_correct):
    """The checks of zerosim.checks judge a live trainer's records into Violations whose clauses are
    those the contract's spec names; a bug (one rank's bias off by 1e-6) is named in the Violation."""
    from zerosim.checks.contracts import get_contract

    world, traj = sgd_correct
    bad = copy.deepcopy(traj)
    bad[1]["blocks.0.fc.bias"][10:13] += 1e-6  # step 2, rank 2
    records = records_for(SGD, world, 3, [traj, traj, bad])
    for check, cid in ((check_step_equivalence, "C-ZERO-002"), (check_replica_identity, "C-ZERO-003")):
        verdict = check(records)
        assert not verdict.passed and verdict.contract == cid
        assert {v.clause for v in verdict.violations} <= set(get_contract(cid).clauses)
        v = verdict.violations[0]
        where = (v.phase, v.step, v.ranks, v.tensor, v.interval)
        assert where == ("sgd", 2, (2,), "blocks.0.fc.bias", (10, 13))
        assert v.error is not None and v.tolerance is not None and v.error > v.tolerance
    gap = flat_shards(4, cut=lambda r, lo, hi: (lo, hi - 3 if r == 3 else hi))
    ranges = owned_ranges(records_for(SGD, 4, 1, [data_parallel_steps(SGD, 4, 1)] * 4, shards=gap),
                                    numels())
    assert {v.clause for v in ranges.violations} <= set(get_contract("C-ZERO-001").clauses)
    last = list(numels())[-1]  # the gap is the end of the flat vector: the last parameter's elements
    assert any(v.clause == "coverage" and v.tensor == last for v in ranges.violations)


def test_step_counter_must_match_exactly():
    world = 2
    traj = data_parallel_steps(ADAMW, world, 1)
    recs = records_for(ADAMW, world, 1, [traj] * world)
    for obs in recs[0].ranks:
        obs.state = {
            n: {k: np.array(v, copy=True) for k, v in st.items()} for n, st in recs[0].ref.state.items()
        }
    assert judged(check_step_equivalence, recs).status == "pass"
    recs[0].ranks[1].state["ln_f.bias"]["step"] = np.array(2.0)
    v = judged(check_step_equivalence, recs).first_violation
    assert (v["rank"], v["tensor"], v.get("state")) == (1, "ln_f.bias", "step")


def test_float32_masters_are_detected():
    world = 2
    traj = data_parallel_steps(SGD, world, 2)
    recs = records_for(SGD, world, 2, [traj] * world)
    assert not float32_masters([r.ranks for r in recs])
    for r in recs:
        for o in r.ranks:
            o.params = {n: a.astype(np.float32).astype(np.float64) for n, a in o.params.items()}
    assert float32_masters([r.ranks for r in recs])


def test_float32_masters_of_a_float64_model_stay_within_the_float32_bound():
    world, steps = 2, 3
    model = build_model("gpt")
    masters = copy.deepcopy(model).to(torch.float32)
    params = list(masters.parameters())
    opt = make_optimizer(params, ADAMW)
    traj = []
    for k in range(steps):
        grads = [torch.zeros_like(p) for p in params]
        for r in range(world):
            masters.zero_grad(set_to_none=True)
            masters(*micro_batch(r, k + 1)).backward()
            for g, p in zip(grads, params, strict=True):
                g += p.grad
        for g, p in zip(grads, params, strict=True):
            p.grad = g / world
        torch.nn.utils.clip_grad_norm_(params, ADAMW["max_grad_norm"], foreach=False)
        opt.step()
        traj.append({n: p.detach().double().numpy().copy() for n, p in masters.named_parameters()})
    assert float32_masters([[StepObservation("adamw", k + 1, 0, 0.0, traj[k])] for k in range(steps)])
    ref = Reference(model, ADAMW, world)
    em = ErrorModel(ADAMW, "float32", PRESETS["gpt"], world, rounded_start=True)
    records = []
    for k in range(steps):
        rs = ref.step(k + 1)
        records.append(
            StepRecord(
                rs, em.step(rs), [StepObservation("adamw", k + 1, r, 0.0, traj[k]) for r in range(world)]
            )
        )
    outcome = judged(check_step_equivalence, records)
    assert outcome.status == "pass", outcome.reason


# ---- C-ZERO-001 --------------------------------------------------------------------------------------------


def _ownership(shards, world=4):
    traj = data_parallel_steps(SGD, world, 1)
    return judged(owned_ranges, records_for(SGD, world, 1, [traj] * world, shards=shards), numels())


def test_ownership_passes_for_flat_zero1_and_hybrid():
    assert _ownership(flat_shards(4)).status == "pass"
    two = flat_shards(2)
    outcome = _ownership([two[0], two[1], two[0], two[1]])
    assert outcome.status == "pass", outcome.reason
    assert outcome.details["layouts"] == ["hybrid: 2 shard(s) x 2 replicas"]


def test_ownership_names_unowned_overlapping_duplicated_and_unbalanced():
    total = sum(numels().values())
    gap = _ownership(flat_shards(4, cut=lambda r, lo, hi: (lo, hi - 3 if r == 3 else hi)))
    v = next(v for v in gap.violations if v["clause"] == "coverage")
    # the gap is the last 3 flat elements: the first tensor they touch, up to its end
    starts = np.cumsum([0, *numels().values()])
    i = int(np.searchsorted(starts, total - 3, side="right")) - 1
    name, n, lo = list(numels())[i], list(numels().values())[i], int(starts[i])
    assert v["tensor"] == name and v["stop"] == n and v["start"] == total - 3 - lo
    over = _ownership(flat_shards(4, cut=lambda r, lo, hi: (lo, hi + 5 if r == 0 else hi)))
    v = next(v for v in over.violations if v["clause"] == "disjoint")
    assert v["ranks"] == [0, 1] and v["stop"] - v["start"] == 5
    dup = flat_shards(4)
    dup[2]["ln_f.bias"] = [(0, 5), (3, 9)]
    v = next(v for v in _ownership(dup).violations if v["clause"] == "disjoint")
    assert (v["rank"], v["tensor"], v["start"], v["stop"]) == (2, "ln_f.bias", 3, 5)
    lopsided = flat_shards(
        4,
        cut=lambda r, lo, hi: {0: (0, 2000), 1: (2000, total - 20)}.get(
            r, (total - 20 + (r - 2) * 10, total - 20 + (r - 1) * 10)
        ),
    )
    v = next(v for v in _ownership(lopsided).violations if v["clause"] == "balance")
    assert v["rank"] == 1
    two = flat_shards(2)
    shifted = flat_shards(2, cut=lambda r, lo, hi: (lo + 4 if r == 1 else lo, hi + 4 if r == 0 else hi))
    v = next(
        v
        for v in _ownership([two[0], two[1], shifted[0], shifted[1]]).violations
        if v["clause"] == "replicas"
    )
    assert "own different ranges" in v["message"] or "group of" in v["message"]


def test_ownership_skipped_without_local_shards():
    outcome = _ownership(None)
    assert outcome.status == "skipped" and "local_shards" in outcome.reason


# ---- diagnosis ---------------------------------------------------------------------------------------------


def _diagnose(records, shards_numels=None):
    contracts = {"C-ZERO-002": judged(check_step_equivalence, records),
                 "C-ZERO-003": judged(check_replica_identity, records)}
    if shards_numels is not None:
        contracts["C-ZERO-001"] = judged(owned_ranges, records, shards_numels)
    return diagnose(records, contracts)


def test_diagnosis_gradient_scale():
    world = 4
    traj = data_parallel_steps(SGD, world, 2, bug="summed")
    found = _diagnose(records_for(SGD, world, 2, [traj] * world))
    assert bug_classes(found)[0] == "gradient-scale"
    assert "times 4" in found[0].evidence and "summed" in found[0].evidence


def test_diagnosis_ranks_agree_wrong_not_gradient_scale():
    world = 2
    traj = data_parallel_steps(SGD, world, 2, bug="double-decay")
    classes = bug_classes(_diagnose(records_for(SGD, world, 2, [traj] * world)))
    assert (
        "ranks-agree-wrong" in classes and "gradient-scale" not in classes and "ranks-disagree" not in classes
    )


def test_diagnosis_late_divergence(sgd_correct):
    world, traj = sgd_correct
    bad = copy.deepcopy(traj)
    for r in range(1, 3):
        for arr in bad[r].values():
            arr += 1e-7  # wrong from step 2 on
    found = _diagnose(records_for(SGD, world, 3, [bad] * world))
    assert "late-divergence" in bug_classes(found)
    assert "diverges from step 2" in next(d.evidence for d in found if d.bug_class == "late-divergence")


def test_diagnosis_ranks_disagree_names_a_stale_rank(sgd_correct):
    world, traj = sgd_correct
    stale = [traj[0], traj[0], traj[2]]  # rank 1 keeps step 1's weights at step 2
    found = _diagnose(records_for(SGD, world, 3, [traj, stale, traj]))
    d = next(d for d in found if d.bug_class == "ranks-disagree")
    assert "rank 1" in d.evidence and "stale" in d.evidence


def test_diagnosis_permuted_shards(sgd_correct):
    world, traj = sgd_correct
    names = list(traj[0])
    swapped = []
    for step in traj:
        flat = np.concatenate([step[n].reshape(-1) for n in names])
        half = flat.size // 2
        flat = np.concatenate([flat[half:], flat[:half]])
        out, off = {}, 0
        for n in names:
            out[n] = flat[off : off + step[n].size].reshape(step[n].shape)
            off += step[n].size
        swapped.append(out)
    found = _diagnose(records_for(SGD, world, 3, [swapped] * world))
    assert bug_classes(found)[0] == "permuted-shards"


def test_diagnosis_unowned_elements_from_values(sgd_correct):
    world, traj = sgd_correct
    initial = {n: p.detach().numpy().copy() for n, p in build_model("gpt").named_parameters()}
    frozen = copy.deepcopy(traj)
    tail = list(initial)[::-1]  # freeze the last 5 elements of the flattened vector, whichever tensors
    for step in frozen:
        left = 5
        for name in tail:
            take = min(left, initial[name].size)
            step[name].reshape(-1)[-take:] = initial[name].reshape(-1)[-take:]
            left -= take
            if not left:
                break
    found = _diagnose(records_for(SGD, world, 3, [frozen] * world))
    d = next(d for d in found if d.bug_class == "unowned-elements")
    assert "5 element(s)" in d.evidence and "end of the flattened" in d.evidence


def test_diagnosis_overlap_and_rank_local(sgd_correct):
    world, traj = sgd_correct
    shards = flat_shards(world, cut=lambda r, lo, hi: (lo, hi + 6 if r == 0 else hi))
    found = _diagnose(records_for(SGD, world, 3, [traj] * world, shards=shards), numels())
    assert bug_classes(found) == ["overlapping-shards"]
    owned_by_2 = flat_shards(world)[2]
    bad = copy.deepcopy(traj)
    name = next(n for n, rs in owned_by_2.items() if rs and rs[0][1] - rs[0][0] > 4)
    a = owned_by_2[name][0][0]
    for step in bad:
        step[name].reshape(-1)[a : a + 3] += 1e-5
    found = _diagnose(records_for(SGD, world, 3, [bad] * world, shards=flat_shards(world)), numels())
    d = next(d for d in found if d.bug_class == "rank-local")
    assert "rank 2" in d.evidence


def test_diagnosis_clip_norm():
    world, steps = 2, 4
    threshold, binds_at, offset = choose_clip(build_model("gpt"), ADAMW, world, 1, steps)
    assert binds_at > 1, "a batch order where the norm rises exists among the offsets tried"
    optim = {**ADAMW, "max_grad_norm": threshold}
    wrong = {
        **optim,
        "max_grad_norm": threshold * 3,
    }  # as if the norm were taken over a third of the elements
    traj = data_parallel_steps(wrong, world, steps, data_offset=offset)
    records = records_for(optim, world, steps, [traj] * world, data_offset=offset)
    assert [r.ref.clip_bound for r in records][:binds_at] == [False] * (binds_at - 1) + [True]
    found = _diagnose(records)
    assert bug_classes(found)[0] == "clip-norm", found
    assert f"starts at step {binds_at}" in found[0].evidence


def test_diagnosis_empty_for_a_correct_run(sgd_correct):
    world, traj = sgd_correct
    assert _diagnose(records_for(SGD, world, 3, [traj] * world), numels()) == []


def arrival_counters(world: int) -> list:
    """One ArrivalCounter per rank of a fake world sharing one in-memory store."""
    from types import SimpleNamespace

    from zerosim.verify.arrival import ArrivalCounter

    job = SimpleNamespace(board=SimpleNamespace(store=torch.distributed.HashStore()))
    return [ArrivalCounter(SimpleNamespace(rank=r, world_size=world, _job=job)) for r in range(world)]


def test_arrival_names_the_rank_that_never_saw_the_timeout():
    counters = arrival_counters(3)
    try:
        counters[1].mark("step 2 (sgd): step()")
        counters[2].laggard(grace_s=0.0)  # rank 2 saw the timeout; rank 1 never does
        rank, detail = counters[0].laggard(grace_s=0.2)
        assert rank == 1 and "never reached" in detail and "step 2 (sgd): step()" in detail
    finally:
        for c in reversed(counters):
            c.restore()


def test_arrival_names_the_rank_with_an_odd_count_of_collectives():
    counters = arrival_counters(3)
    try:
        for c in counters:
            c.calls = 7 if c.rank == 2 else 6  # rank 2 issued one collective more
            c.mark("step 3 (adamw): full_parameters()")
            c.laggard(grace_s=0.0)
        rank, detail = counters[0].laggard(grace_s=0.0)
        assert rank == 2 and "entered 7 collectives, the other ranks 6" in detail
    finally:
        for c in reversed(counters):
            c.restore()


# ---- protocol, targets, suite, report --------------------------------------------------------------------


def test_validate_parameters_names_the_problem():
    expected = {"a": ((2, 3), "float64")}
    ok = {"a": np.zeros((2, 3))}
    validate_parameters(ok, expected, rank=1)
    cases = [
        ({}, "missing parameter 'a'"),
        ({**ok, "b": np.zeros(1)}, "unknown name 'b'"),
        ({"a": np.zeros((3, 2))}, "shape (3, 2)"),
        ({"a": np.zeros((2, 3), np.float32)}, "dtype float32"),
        ({"a": np.full((2, 3), np.nan)}, "non-finite"),
    ]
    for params, text in cases:
        with pytest.raises(TrainerError, match="rank 1") as e:
            validate_parameters(params, expected, rank=1)
        assert text in str(e.value)


def test_validate_local_shards_rejects_out_of_bounds_and_non_integers():
    assert validate_local_shards({"a": [(0, 2), [3, 3]]}, {"a": 4}, 0) == {"a": [(0, 2)]}
    for bad, text in [
        ({"a": [(0, 5)]}, "out of bounds"),
        ({"a": [(0.5, 2)]}, "integer pairs"),
        ({"a": [(3, 1)]}, "out of bounds"),
        ({"z": []}, "unknown name"),
    ]:
        with pytest.raises(TrainerError, match=text):
            validate_local_shards(bad, {"a": 4}, 0)


def test_target_resolution(tmp_path, monkeypatch):
    (tmp_path / "my_trainers.py").write_text(
        "make = 3\ndef make_trainer(model, optim):\n    return None\nraise_on_import = None\n"
    )
    (tmp_path / "broken_import.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.chdir(tmp_path)
    assert callable(resolve_factory("my_trainers:make_trainer"))
    assert callable(resolve_factory("ddp"))
    for target, text in [
        ("no_such_module:f", "not found"),
        ("my_trainers:nope", "no attribute 'nope'"),
        ("my_trainers:make", "not callable"),
        ("broken_import:f", "boom at import"),
    ]:
        with pytest.raises(TrainerError, match=text):
            resolve_factory(target)
    with pytest.raises(ConfigError, match="target"):
        resolve_factory("not-an-adapter")


def test_suite_phases_and_bad_steps():
    phases = build_phases()
    assert [(p.name, p.first_step, p.steps) for p in phases] == [("sgd", 1, 12), ("adamw", 13, 12)]
    assert phases[0].optim["max_grad_norm"] is None
    assert [p.steps for p in build_phases(steps=7)] == [4, 3]
    with pytest.raises(ConfigError, match="steps"):
        build_phases(steps=3)
    assert sum(p.steps for p in build_phases(steps=MAX_STEPS)) == MAX_STEPS
    with pytest.raises(ConfigError, match=f"invalid steps={MAX_STEPS + 1}: at most {MAX_STEPS}"):
        build_phases(steps=MAX_STEPS + 1)
    with pytest.raises(ConfigError, match="optimizers"):
        build_phases(("sgd", "lion"))


def test_report_json_round_trip():
    report = VerifyReport(
        "ddp",
        2,
        8,
        "float64",
        {
            "C-ZERO-002": stated(
                "fail",
                "first at step 3",
                [{"contract": "C-ZERO-002", "step": 3, "rank": 1}],
                {"max_error": 0.5, "tolerance": 1e-14},
            )
        },
        [Diagnosis("late-divergence", "from step 3")],
    )
    data = json.loads(json.dumps(report.to_json()))
    assert {"target", "world", "steps", "dtype", "verdict", "contracts", "diagnosis"} <= set(data)
    assert data["verdict"] == "fail" and data["contracts"]["C-ZERO-002"]["status"] == "fail"
    back = VerifyReport.from_json(data)
    assert back.to_json() == data and back.exit_code == 1


def test_human_report_lists_contracts_error_tolerance_diagnosis_and_skips():
    from zerosim.verify.render import render_text

    report = VerifyReport(
        "mine:make",
        4,
        8,
        "float64",
        {
            "C-ZERO-002": stated(
                "fail",
                "first at step 6 (adamw), rank 1, wte.weight[3:9]: ...",
                [{"contract": "C-ZERO-002", "phase": "adamw", "step": 6, "rank": 1, "tensor": "wte.weight",
                  "start": 3, "stop": 9, "message": "..."}],
                {
                    "max_error": 2.5e-3,
                    "tolerance": 1e-14,
                    "error_over_tolerance": 2.5e11,
                    "worst": "step 6, rank 1, wte.weight[4]",
                    "max_abs_error": 3e-3,
                },
            ),
            "C-ZERO-001": stated("skipped", "the trainer has no local_shards()"),
        },
        [Diagnosis("clip-norm", "divergence starts at step 6")],
        phases=[
            {
                "name": "sgd",
                "first_step": 1,
                "last_step": 4,
                "status": "skipped",
                "reason": "no SGD",
                "not_ruled_out": "a gradient summed",
                "optim": {},
            },
            {
                "name": "adamw",
                "first_step": 5,
                "last_step": 8,
                "status": "ran",
                "clip_binds_at": [6],
                "optim": {"max_grad_norm": 3.1},
            },
        ],
    )
    text = render_text(report)
    assert "clip 3.1 binds at step(s) 6" in text
    row = next(line for line in text.splitlines() if line.startswith("C-ZERO-002"))
    assert "2.50e-03" in row and "1.00e-14" in row and "first at step 6" in row
    assert "verdict: fail" in text and "clip-norm: divergence starts at step 6" in text
    assert "skipped sgd: no SGD; not ruled out: a gradient summed" in text


# ---- CLI bad input (no ranks started) ---------------------------------------------------------------------


def _cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerosim", "verify", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize(
    "args, field",
    [
        (["ddp", "--world", "100000"], "world"),
        (["ddp", "--dtype", "float16"], "dtype"),
        (["ddp", "--steps", "1"], "steps"),
        (["no_such_module:f"], "not found"),
        (["ddp", "--model", "llama"], "model"),
    ],
)
def test_cli_bad_input_one_line_exit_2(args, field):
    done = _cli(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], done.stderr
    assert "Traceback" not in done.stderr


# ---- end to end --------------------------------------------------------------------------------

DDP_TRAINER = textwrap.dedent("""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from zerosim.verify.reference import make_optimizer


    class DDPTrainer:
        def __init__(self, model, optim):
            self.model, self.optim = model, optim
            self.ddp = DistributedDataParallel(model)
            self.opt = make_optimizer(list(model.parameters()), optim)

        def step(self, inputs, targets):
            self.opt.zero_grad(set_to_none=True)
            loss = self.ddp(inputs, targets)
            loss.backward()
            if self.optim["max_grad_norm"] is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim["max_grad_norm"])
            self.opt.step()
            return float(loss)

        def full_parameters(self):
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}

        def full_optimizer_state(self):
            names = {p: n for n, p in self.model.named_parameters()}
            return {names[p]: dict(st) for p, st in self.opt.state.items()}


    def make_trainer(model, optim):
        return DDPTrainer(model, optim)
""")


@pytest.mark.torchdist
def test_end_to_end_world_2_with_a_correct_ddp_trainer(tmp_path, monkeypatch):
    (tmp_path / "in_test_ddp.py").write_text(DDP_TRAINER)
    monkeypatch.chdir(tmp_path)
    report = verify("in_test_ddp:make_trainer", world=2, steps=8, timeout_s=120, out=str(tmp_path / "run"))
    assert report.verdict == "pass", report.to_json()
    c2 = report.contracts["C-ZERO-002"]
    assert c2.status == "pass" and 0 <= c2.details["max_error"] <= c2.details["tolerance"]
    assert set(c2.details["state_compared"]) == {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"}
    assert report.contracts["C-ZERO-003"].status == "pass"
    assert report.contracts["C-ZERO-001"].status == "skipped"
    adamw = next(p for p in report.phases if p["name"] == "adamw")
    assert adamw["clip_binds_at"], adamw
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["verdict"] == "pass" and saved["world"] == 2 and saved["steps"] == 8


@pytest.mark.torchdist
def test_end_to_end_a_rank_that_raises_is_named(tmp_path, monkeypatch):
    (tmp_path / "in_test_ddp.py").write_text(DDP_TRAINER)
    (tmp_path / "raising.py").write_text(
        textwrap.dedent("""
        import torch.distributed as dist
        from in_test_ddp import DDPTrainer

        class Raising(DDPTrainer):
            def step(self, inputs, targets):
                if dist.get_rank() == 1:
                    raise ValueError("rank one is broken")
                return super().step(inputs, targets)

        def make_trainer(model, optim):
            return Raising(model, optim)
    """)
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RankFailure) as e:
        verify("raising:make_trainer", world=2, steps=4, timeout_s=60)
    assert e.value.rank == 1 and "rank one is broken" in str(e.value)


@pytest.mark.torchdist
def test_end_to_end_a_rank_that_hangs_is_named(tmp_path, monkeypatch):
    (tmp_path / "in_test_ddp.py").write_text(DDP_TRAINER)
    (tmp_path / "hanging.py").write_text(
        textwrap.dedent("""
        import time

        import torch.distributed as dist
        from in_test_ddp import DDPTrainer

        class Hanging(DDPTrainer):
            calls = 0

            def step(self, inputs, targets):
                self.calls += 1
                if dist.get_rank() == 1 and self.calls == 2:
                    time.sleep(3600)
                return super().step(inputs, targets)

        def make_trainer(model, optim):
            return Hanging(model, optim)
    """)
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RankFailure) as e:
        verify("hanging:make_trainer", world=2, steps=4, timeout_s=8)  # far below the 3600 s sleep
    assert e.value.rank == 1, str(e.value)
    assert "never reached" in str(e.value) and "step 2 (sgd): step()" in str(e.value)


@pytest.mark.torchdist
def test_end_to_end_a_phase_the_trainer_does_not_support_is_skipped(tmp_path, monkeypatch):
    (tmp_path / "in_test_ddp.py").write_text(DDP_TRAINER)
    (tmp_path / "sgd_only.py").write_text(
        textwrap.dedent("""
        from in_test_ddp import DDPTrainer

        def make_trainer(model, optim):
            if optim["name"] != "sgd":
                raise NotImplementedError("only SGD here")
            return DDPTrainer(model, optim)
    """)
    )
    monkeypatch.chdir(tmp_path)
    report = verify("sgd_only:make_trainer", world=1, steps=4, timeout_s=60, allow_world_1=True)
    assert report.verdict == "pass"
    adamw = next(p for p in report.phases if p["name"] == "adamw")
    assert adamw["status"] == "skipped" and "only SGD here" in adamw["reason"]
    assert "clip norm" in adamw["not_ruled_out"]
    assert report.contracts["C-ZERO-002"].status == "pass"
    assert report.contracts["C-ZERO-002"].details["state_compared"] == ["momentum_buffer"]


@pytest.mark.torchdist
def test_end_to_end_a_trainer_that_refuses_every_phase_is_unsupported_not_a_pass(tmp_path, monkeypatch):
    """Nothing verified is no pass: the verdict is "unsupported" and the exit status 2, with each phase's
    reason."""
    (tmp_path / "refuses.py").write_text(textwrap.dedent("""
        def make_trainer(model, optim):
            raise NotImplementedError("no optimizer of verify's is supported here")
    """))
    monkeypatch.chdir(tmp_path)
    report = verify("refuses:make_trainer", world=1, steps=4, timeout_s=60, allow_world_1=True)
    assert (report.verdict, report.exit_code) == ("unsupported", 2)
    assert [p["status"] for p in report.phases] == ["skipped", "skipped"]
    reason = report.contracts["C-ZERO-002"].reason
    assert reason.count("no optimizer of verify's is supported here") == 1, reason  # said once, not per phase
    assert VerifyReport.from_json(report.to_json()).verdict == "unsupported"
    from zerosim.testing.verify import failure_message

    message = failure_message(report)  # what assert_trainer_verifies raises with
    assert message.startswith("zerosim verify refuses:make_trainer: unsupported"), message
    assert "skipped adamw: make_trainer raised NotImplementedError (no optimizer" in message, message


def test_close_is_optional_called_when_present_and_must_be_a_method() -> None:
    """A trainer's close() runs once its phase is over; a trainer without one is fine; a close that is
    not callable is a protocol breach named with the rank."""
    from zerosim.verify.errors import TrainerError

    class Plain:
        def step(self, inputs, targets):
            return 0.0

        def full_parameters(self):
            return {}

    class Closing(Plain):
        closed = 0

        def close(self):
            self.closed += 1

    class Broken(Plain):
        close = 3

    closing = Closing()
    for trainer in (Plain(), closing):
        require_trainer_object(trainer, "t:make", 0)
        close_trainer(trainer)
    assert closing.closed == 1
    with pytest.raises(TrainerError, match="close on rank 2 is int, not a method"):
        require_trainer_object(Broken(), "t:make", 2)

