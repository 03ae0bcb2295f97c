"""Pure-function tests of what ``zerosim verify`` says in the regimes people train in: a named mesh
(C-ZERO-001 against it, ``replicas-not-reduced``), the clip diagnosis at its edges, efficiency findings
versus failures, the one error figure a failure shows, and the run value's new fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_verify_core import (
    ADAMW,
    SGD,
    data_parallel_steps,
    flat_shards,
    judged,
    numels,
    owned_ranges,
    records_for,
)
from zerosim.errors import ConfigError
from zerosim.values.verdict import Verdict
from zerosim.verify.diagnosis import bug_classes, diagnose
from zerosim.verify.model import build_model, micro_batch
from zerosim.verify.outcome import VerifyReport, mark_findings, stated
from zerosim.verify.reference import choose_clip, make_optimizer
from zerosim.verify.render import render_text
from zerosim.verify.run_value import VerifyRun, parse_mesh


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _with_optim(records, optim):
    for r in records:
        r.optim = dict(optim)
    return records


# ---- the mesh ----------------------------------------------------------------------------------------


def hybrid_ranges(replicas: int, shard: int) -> list[dict[str, list[tuple[int, int]]]]:
    """Rank r owns slice r % S of S: the layout of ``replicas`` x ``shard``."""
    slices = flat_shards(shard)
    return [slices[r % shard] for r in range(replicas * shard)]


def ownership(shards, mesh=None) -> Verdict:
    world = len(shards)
    traj = data_parallel_steps(SGD, world, 1)
    records = records_for(SGD, world, 1, [traj] * world, shards=shards)
    return judged(owned_ranges, records, numels(), mesh)


@pytest.mark.parametrize("mesh", [(2, 2), (4, 1), (1, 4)])
def test_ranges_that_follow_the_mesh_pass(mesh):
    assert ownership(hybrid_ranges(*mesh), mesh).status == "pass"


def test_ranges_of_another_shape_fail_against_the_named_mesh():
    # a trainer given --mesh 2x2 that shards over all four ranks: every element has one owner, not two
    got = ownership(hybrid_ranges(1, 4), (2, 2))
    assert got.status == "fail" and "by 1" in got.reason and "mesh 2x2" in got.reason, got.reason
    # ... or replicates everything: four owners
    assert "by 4" in ownership(hybrid_ranges(4, 1), (2, 2)).reason
    # ranks 0 and 2 (one replica group under 2x2) owning different slices
    wrong = hybrid_ranges(2, 2)
    wrong[2], wrong[3] = wrong[3], wrong[2]
    got = ownership(wrong, (2, 2))
    assert got.status == "fail" and "ranks 0 and 2 form one replica group" in got.reason, got.reason
    # without a mesh the same ranges are a valid hybrid layout
    assert ownership(wrong).status == "pass"


def replica_steps(ranks: list[int], optim: dict, steps: int) -> list[dict[str, np.ndarray]]:
    """One replica that averages its gradient over its own ``ranks`` only (no reduction across replicas)."""
    model = build_model("gpt")
    params = list(model.parameters())
    opt = make_optimizer(params, optim)
    out = []
    for step in range(1, steps + 1):
        grads = [torch.zeros_like(p) for p in params]
        for r in ranks:
            model.zero_grad(set_to_none=True)
            model(*micro_batch(r, step)).backward()
            for g, p in zip(grads, params, strict=True):
                g += p.grad
        for g, p in zip(grads, params, strict=True):
            p.grad = g / len(ranks)
        opt.step()
        out.append({n: p.detach().numpy().copy() for n, p in model.named_parameters()})
    return out


def test_replicas_not_reduced_is_named_on_an_n_by_1_mesh():
    world = 2
    trajectories = [replica_steps([r], SGD, 2) for r in range(world)]
    records = _with_optim(records_for(SGD, world, 2, trajectories), SGD)
    for mesh in ((2, 1), None):  # named by the run, or inferred from the ranks that agree
        found = diagnose(records, {}, mesh)
        assert "replicas-not-reduced" in bug_classes(found), found
        evidence = next(d.evidence for d in found if d.bug_class == "replicas-not-reduced")
        assert "step 1 (sgd)" in evidence and "ranks 0; 1" in evidence, evidence


def test_replicas_not_reduced_on_a_2x2_mesh_and_not_for_a_stale_rank():
    trajectories = [replica_steps([0, 1], SGD, 1)] * 2 + [replica_steps([2, 3], SGD, 1)] * 2
    records = records_for(SGD, 4, 1, trajectories)
    assert "replicas-not-reduced" in bug_classes(diagnose(records, {}, (2, 2)))
    # a rank that keeps its old parameters: two groups, but their mean is not the reference
    correct = data_parallel_steps(SGD, 2, 1)
    stale = [{n: p.detach().numpy().copy() for n, p in build_model("gpt").named_parameters()}]
    records = records_for(SGD, 2, 1, [correct, stale])
    assert "replicas-not-reduced" not in bug_classes(diagnose(records, {}))


# ---- the clip --------------------------------------------------------------------------------------------


def test_clip_norm_named_when_the_clip_binds_at_the_first_step():
    world, steps = 2, 2
    first_norm = choose_clip(build_model("gpt"), ADAMW, world, 1, steps)[0]
    optim = {**ADAMW, "max_grad_norm": first_norm / 4}  # binds from step 1
    wrong = {**optim, "max_grad_norm": first_norm / 8}  # as if the norm were taken over too many elements
    trajectory = data_parallel_steps(wrong, world, steps)
    records = _with_optim(records_for(optim, world, steps, [trajectory] * world), optim)
    assert records[0].ref.clip_bound
    found = diagnose(records, {})
    assert bug_classes(found)[0] == "clip-norm", found
    assert "starts at step 1, the first step where the clip binds" in found[0].evidence
    assert "wrong set of elements" in found[0].evidence


def test_a_trainer_that_never_clips_is_told_so():
    world, steps = 2, 4
    threshold, binds_at, offset = choose_clip(build_model("gpt"), ADAMW, world, 1, steps)
    optim = {**ADAMW, "max_grad_norm": threshold}
    unclipped = data_parallel_steps({**optim, "max_grad_norm": None}, world, steps, data_offset=offset)
    records = _with_optim(records_for(optim, world, steps, [unclipped] * world, data_offset=offset), optim)
    found = diagnose(records, {})
    assert bug_classes(found)[0] == "clip-norm", found
    assert "does not clip at all" in found[0].evidence, found[0].evidence
    assert "wrong set of elements" not in found[0].evidence


def test_clip_norm_named_at_a_later_binding_step_of_the_only_clipped_phase():
    world, steps = 2, 4
    optim = {**ADAMW, "max_grad_norm": 1e-3}  # binds at every step
    right = data_parallel_steps(optim, world, steps)
    off = [dict(p) for p in right]
    for k in (2, 3):  # steps 1-2 right, from step 3 on wrong
        off[k] = {n: v + 1e-6 for n, v in off[k].items()}
    records = _with_optim(records_for(optim, world, steps, [off] * world), optim)
    assert all(r.ref.clip_bound for r in records)
    found = diagnose(records, {})
    assert "clip-norm" in bug_classes(found), found
    evidence = next(d.evidence for d in found if d.bug_class == "clip-norm")
    assert "starts at step 3, a step where the clip binds" in evidence, evidence


# ---- findings and the one error figure ------------------------------------------------------------------


def _traffic_violation(clause: str = "ring_model") -> dict:
    return {"contract": "C-ZERO-005", "clause": clause, "step": 2, "phase": "sgd", "rank": 0,
            "message": "rank 0 received 49,276 bytes of gradient reduction in step 2; the zero2 ring "
            "model allows 24,638 to 24,638", "error": 24638.0, "tolerance": 0}


def _report(contracts: dict, strict: bool = False) -> VerifyReport:
    return VerifyReport("deepspeed-2", 2, 4, "float64", mark_findings(contracts), strict=strict)


def test_traffic_off_the_model_in_a_correct_run_is_a_finding_and_strict_fails_it():
    def contracts():
        return {
            "C-ZERO-002": stated("pass", "", [], {"max_error": 1e-16, "tolerance": 1e-15}),
            "C-ZERO-005": stated("fail", "rank 0 received ...", [_traffic_violation()]),
        }

    report = _report(contracts())
    assert report.contracts["C-ZERO-005"].status == "finding"
    assert report.verdict == "pass" and report.exit_code == 0 and len(report.findings) == 1
    text = render_text(report)
    assert "verdict: pass (1 finding)" in text and "49,276 bytes" in text, text
    data = report.to_json()
    assert data["findings"] and data["strict"] is False and data["verdict"] == "pass"
    assert VerifyReport.from_json(data).to_json() == data
    strict = _report(contracts(), strict=True)
    assert strict.verdict == "fail" and strict.exit_code == 1
    assert "failing under --strict" in render_text(strict)


def test_traffic_is_a_failure_when_a_value_is_wrong_or_the_clause_is_not_efficiency():
    report = _report({
        "C-ZERO-003": stated("fail", "ranks differ", [{"clause": "bitwise", "step": 1, "rank": 1}]),
        "C-ZERO-005": stated("fail", "rank 0 received ...", [_traffic_violation()]),
    })
    assert report.contracts["C-ZERO-005"].status == "fail" and report.verdict == "fail"
    report = _report({"C-ZERO-005": stated("fail", "", [_traffic_violation("dtype")])})
    assert report.contracts["C-ZERO-005"].status == "fail" and not report.findings


def test_a_failure_shows_one_error_figure_and_its_bound():
    first = {"contract": "C-ZERO-002", "clause": "allclose", "step": 3, "phase": "sgd", "rank": 1,
             "tensor": "wte.weight", "start": 0, "stop": 4, "error": 4.5e-3, "tolerance": 1.5e-15,
             "message": "parameter: 4 of 96 elements beyond tolerance "
             "(worst error 0.0045 vs tolerance 1.5e-15)"}
    later = {**first, "step": 5, "error": 9.0, "tolerance": 3e-15}
    outcome = stated("fail", "first at step 3 (sgd), rank 1, wte.weight[0:4]: " + first["message"],
                              [later, first], {"max_error": 9.0, "tolerance": 3e-15,
                                               "error_over_tolerance": 3e15, "worst": "step 5",
                                               "max_abs_error": 11.0})
    text = render_text(VerifyReport("mine:make", 2, 8, "float64", {"C-ZERO-002": outcome}))
    row = next(line for line in text.splitlines() if line.startswith("C-ZERO-002"))
    assert "4.50e-03" in row and "1.50e-15" in row and "3.00e+12" in row, row
    assert "9.00e+00" not in text and "largest absolute error" not in text, text


# ---- the run value -------------------------------------------------------------------------------------


def test_mesh_text_and_world_one():
    assert parse_mesh("2x2") == (2, 2) and parse_mesh("4X1") == (4, 1)
    for bad in ("2by2", "2x", "x2", "-1x4", "2x2x1", ""):
        with pytest.raises(ConfigError, match="mesh"):
            parse_mesh(bad)
    with pytest.raises(ConfigError, match="mesh"):
        parse_mesh("0x4")
    with pytest.raises(ConfigError, match=r"mesh='3x1'.*but the run has 2"):
        VerifyRun("fsdp2-hybrid", world=2, mesh=(3, 1)).validate()
    with pytest.raises(ConfigError, match="fixed layout"):
        VerifyRun("ddp", world=2, mesh=(2, 1)).validate()
    with pytest.raises(ConfigError, match="one rank cannot show a sharding bug"):
        VerifyRun("ddp", world=1).validate()
    assert VerifyRun("ddp", world=1, allow_world_1=True).validate().world == 1
    run = VerifyRun("mine:make", world=4, mesh=(2, 2), strict=True)
    assert VerifyRun.from_json(run.to_json() | {"mesh": [2, 2]}) == run
    with pytest.raises(ConfigError, match="mesh"):
        VerifyRun.from_json(run.to_json() | {"mesh": "2x2"})


def test_the_header_names_accumulation_the_mesh_and_the_precision_policy():
    """What evaluate records in ``extra`` for --grad-accum, --mesh and --precision appears in the first line,
    and a full-precision run says its dtype alone."""
    outcome = stated("pass", "", [], {"max_error": 1e-16, "tolerance": 1e-15, "worst": "step 2"})
    report = VerifyReport("fsdp2-hybrid", 4, 8, "float32", {"C-ZERO-002": outcome})
    report.extra.update(grad_accum=3, mesh=[4, 1], mixed_precision={"param_dtype": "float16",
                        "reduce_dtype": "bfloat16", "loss_scale": {"init": 65536.0}})
    header = render_text(report).splitlines()[0]
    assert "world 4, 3 micro-batches per step, mesh 4x1 (4 replicas of 1 shard rank)" in header, header
    assert "fp16 compute (float16 parameters and gradients), float32 master weights, gradients reduced in " \
        "bfloat16, dynamic loss scaling" in header, header
    plain = render_text(VerifyReport("ddp", 2, 8, "float64", {"C-ZERO-002": outcome})).splitlines()[0]
    assert ", float64, model gpt" in plain and "micro-batches" not in plain and "mesh" not in plain, plain
