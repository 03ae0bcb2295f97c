"""``zerosim verify --model moe``: the built-in mixture of experts, an expert-parallel trainer, its bugs.

Pure tests: the model's sizes and deterministic routing; the group diagnoses
(:mod:`zerosim.verify.diagnosis_groups`) on records of an in-process data-parallel computation of the
MoE model with one bug applied to one group of tensors (experts' gradients summed, the router's not
reduced, experts left out of the logged norm), and on the whole-model bug they must leave to the
model-wide diagnosis. Launches (world 2 and 3, gloo): ``examples/expert_parallel_trainer.py`` passes
against the unsharded reference; each broken variant of ``tests/verify_trainers/expert_parallel.py``
fails at the first SGD step with the contract and the class that name its group.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zerosim.checks.equivalence import check_step_equivalence  # noqa: E402
from zerosim.checks.identity import check_replica_identity  # noqa: E402
from zerosim.checks.logged_norm import check_logged_norm  # noqa: E402
from zerosim.checks.tolerance import ErrorModel  # noqa: E402
from zerosim.testing.verify import failure_message  # noqa: E402
from zerosim.verify.diagnosis import bug_classes, diagnose  # noqa: E402
from zerosim.verify.diagnosis_groups import name_group  # noqa: E402
from zerosim.verify.model_moe import MOE_CONFIG, route  # noqa: E402
from zerosim.verify.model_source import model_source  # noqa: E402
from zerosim.verify.observation import StepObservation, StepRecord  # noqa: E402
from zerosim.verify.optimizers import PHASE_CONFIGS  # noqa: E402
from zerosim.verify.reference import Reference, make_optimizer  # noqa: E402

SGD = dict(PHASE_CONFIGS["sgd"])
LAUNCH_TIMEOUT_S = 120.0
EP = "tests.verify_trainers.expert_parallel"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 matmuls: one thread is faster than two on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the model ----------------------------------------------------------------------------------------


def test_no_tensor_and_not_the_count_divide_by_small_world_sizes() -> None:
    model = model_source("moe").build("float64")
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for k in (2, 3, 4, 8):
        assert sum(sizes.values()) % k, (k, sum(sizes.values()))
        assert not [n for n, s in sizes.items() if s % k == 0], k
    assert sum(1 for n in sizes if n.startswith("moe.experts.")) == 4 * MOE_CONFIG.n_expert


def test_the_model_and_its_batches_are_the_same_on_every_build() -> None:
    source = model_source("moe", seed=5)
    source.validate(world=3, grad_accum=2)
    a, b = source.build("float64"), source.build("float64")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert torch.equal(source.batch(1, 2, 0, 2)[0], source.batch(1, 2, 0, 2)[0])
    assert not torch.equal(source.batch(1, 2, 0, 2)[0], source.batch(0, 2, 0, 2)[0])
    assert source.sizes() is MOE_CONFIG


def test_routing_takes_the_top_k_and_breaks_ties_to_the_lower_expert() -> None:
    scores = torch.tensor([[0.5, 2.0, 2.0, 2.0, -1.0], [3.0, 0.0, 1.0, 1.0, 0.2]], dtype=torch.float64)
    chosen, gates = route(scores, 2)
    assert chosen.tolist() == [[1, 2], [0, 2]]
    expected = torch.softmax(torch.tensor([[2.0, 2.0], [3.0, 1.0]], dtype=torch.float64), dim=-1)
    assert torch.equal(gates, expected)


def test_an_expert_no_token_reaches_has_a_zero_gradient_and_is_stepped() -> None:
    """Not None: the reference's optimizer decays it like any tensor (module docstring of model_moe)."""
    source = model_source("moe")
    model: Any = source.build("float64")
    with torch.no_grad():  # the router never picks expert 6: its score is far below every other
        model.moe.router.bias[6] = -1e3
    model(*source.batch(0, 1)).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.moe.experts[6].parameters())
    assert all(p.grad is not None and p.grad.any() for p in model.moe.experts[0].parameters())


# ---- the group diagnoses on an in-process computation ---------------------------------------------------


def moe_records(world: int, steps: int, bug: str | None = None) -> list[StepRecord]:
    """Records of a data-parallel SGD computation of the MoE model (each rank's gradient on its own
    micro-batch, averaged) beside the reference, with ``bug`` applied: ``experts-summed`` (expert
    gradients times world), ``router-local`` (each rank steps the router with its own gradient),
    ``everything-summed``, ``norm-without-experts`` (the logged norm leaves the experts out)."""
    source = model_source("moe")
    ref = Reference(source.build("float64"), SGD, world, source=source)
    bounds = ErrorModel(SGD, "float64", MOE_CONFIG, world)
    models = [source.build("float64") for _ in range(world)]
    optimizers = [make_optimizer(list(m.parameters()), SGD) for m in models]
    records = []
    for step in range(1, steps + 1):
        local = []
        for r in range(world):
            models[0].zero_grad(set_to_none=True)
            models[0](*source.batch(r, step, 0, world)).backward()
            local.append({n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                          for n, p in models[0].named_parameters()})
        mean: dict[str, Any] = {n: sum(g[n] for g in local) / world for n in local[0]}
        observations = []
        for r, (model, opt) in enumerate(zip(models, optimizers, strict=True)):
            for n, p in model.named_parameters():
                grad = mean[n]
                if bug == "everything-summed" or (bug == "experts-summed" and n.startswith("moe.experts.")):
                    grad = grad * world
                if bug == "router-local" and n.startswith("moe.router."):
                    grad = local[r][n]
                p.grad = grad.clone()
            opt.step()
            norm = math.sqrt(sum(float(mean[n].pow(2).sum()) for n in mean
                                 if bug != "norm-without-experts" or not n.startswith("moe.experts.")))
            observations.append(StepObservation(
                "sgd", step, r, 0.0, {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
                grad_norm=norm))
        reference = ref.step(step)
        records.append(StepRecord(reference, bounds.step(reference), observations, SGD))
    return records


def diagnosis_of(records: list[StepRecord]) -> list:
    contracts = {
        "C-ZERO-002": check_step_equivalence(records),
        "C-ZERO-003": check_replica_identity(records),
        "C-ZERO-008": check_logged_norm(records, {"sgd": 2.0**-53}),
    }
    return diagnose(records, contracts)


def test_the_correct_computation_is_diagnosed_with_nothing() -> None:
    records = moe_records(2, 2)
    assert diagnosis_of(records) == []


def test_experts_summed_is_gradient_scale_on_the_experts_named_as_a_group() -> None:
    found = diagnosis_of(moe_records(2, 1, "experts-summed"))
    classes = bug_classes(found)
    assert classes[0] == "gradient-scale", found
    evidence = found[0].evidence
    assert "moe.experts.* (28 tensors)" in evidence and "times 2 on 100%" in evidence, evidence
    assert "= the world size 2" in evidence and "every other tensor matches" in evidence, evidence


def test_the_factor_of_a_scaled_group_follows_the_world_size() -> None:
    found = diagnosis_of(moe_records(3, 1, "experts-summed"))
    scale = next(d for d in found if d.bug_class == "gradient-scale")
    assert "times 3 on" in scale.evidence and "world size 3" in scale.evidence, scale.evidence


def test_a_whole_model_scale_stays_the_model_wide_diagnosis() -> None:
    found = diagnosis_of(moe_records(2, 1, "everything-summed"))
    scales = [d for d in found if d.bug_class == "gradient-scale"]
    assert len(scales) == 1 and "large-gradient elements = the world size 2" in scales[0].evidence, found
    assert "tensors)" not in scales[0].evidence, scales[0].evidence


def test_a_router_not_reduced_is_named_and_not_taken_for_unreduced_replicas() -> None:
    found = diagnosis_of(moe_records(2, 1, "router-local"))
    classes = bug_classes(found)
    assert classes[0] == "gradient-not-reduced" and "replicas-not-reduced" not in classes, found
    assert "moe.router (2 tensors)" in found[0].evidence, found[0].evidence


def test_experts_left_out_of_the_logged_norm_are_named() -> None:
    found = diagnosis_of(moe_records(2, 1, "norm-without-experts"))
    assert bug_classes(found) == ["logged-norm"], found
    assert "every tensor but moe.experts.* (28 tensors)" in found[0].evidence, found[0].evidence


def test_a_group_is_named_by_its_most_specific_prefix() -> None:
    every = [f"moe.experts.{e}.{m}.{k}" for e in range(3) for m in ("fc", "out") for k in ("weight", "bias")]
    every += ["moe.router.weight", "head.weight"]
    experts_1_2 = [n for n in every if n.startswith(("moe.experts.1.", "moe.experts.2."))]
    idle = {n for n in every if n.startswith("moe.experts.0.")}
    assert name_group(experts_1_2, every, idle) == "moe.experts.* (12 tensors)"
    assert name_group(experts_1_2, every, set()) == ", ".join(experts_1_2[:3]) + " and 5 more"
    assert name_group(["moe.router.weight"], every, set()) == "moe.router (1 tensors)"


# ---- launches -------------------------------------------------------------------------------------------


def launch(target: str, world: int, **kw):
    from zerosim.verify import verify

    return verify(target, world=world, model="moe", timeout_s=LAUNCH_TIMEOUT_S, **kw)


@pytest.mark.torchdist
@pytest.mark.parametrize(("world", "steps"), [(2, 8), (3, 4)])
def test_the_expert_parallel_example_passes_against_the_unsharded_reference(world: int, steps: int) -> None:
    report = launch("examples.expert_parallel_trainer:make_trainer", world, steps=steps)
    assert report.verdict == "pass", failure_message(report)
    for cid in ("C-ZERO-002", "C-ZERO-003", "C-ZERO-008"):
        assert report.contracts[cid].status == "pass", cid


def failing_tensors(report, contract: str, step: int) -> set[str]:
    return {v["tensor"] for v in report.contracts[contract].violations if v["step"] == step}


@pytest.mark.torchdist
def test_summed_expert_gradients_are_gradient_scale_on_the_experts() -> None:
    report = launch(f"{EP}:summed_expert_gradients", 2, steps=2, optimizers="sgd")
    text = failure_message(report)
    assert report.contracts["C-ZERO-002"].status == "fail" and report.contracts["C-ZERO-003"].status == "pass"
    wrong = failing_tensors(report, "C-ZERO-002", 1)
    assert wrong and all(n.startswith("moe.experts.") for n in wrong), wrong
    classes = bug_classes(report.diagnosis)
    assert classes[0] == "gradient-scale", text
    assert "moe.experts.* (28 tensors)" in report.diagnosis[0].evidence, text


@pytest.mark.torchdist
def test_a_router_gradient_not_reduced_is_named() -> None:
    report = launch(f"{EP}:router_gradient_not_reduced", 2, steps=2, optimizers="sgd")
    text = failure_message(report)
    assert report.contracts["C-ZERO-003"].status == "fail", text
    assert {n.split(".")[1] for n in failing_tensors(report, "C-ZERO-003", 1)} == {"router"}, text
    classes = bug_classes(report.diagnosis)
    assert classes[0] == "gradient-not-reduced" and "replicas-not-reduced" not in classes, text
    assert "moe.router (2 tensors)" in report.diagnosis[0].evidence, text


@pytest.mark.torchdist
def test_experts_left_out_of_the_logged_norm_fail_c_zero_008_only() -> None:
    report = launch(f"{EP}:experts_left_out_of_logged_norm", 2, steps=2, optimizers="sgd")
    text = failure_message(report)
    assert report.contracts["C-ZERO-002"].status == "pass" and report.contracts["C-ZERO-003"].status == "pass"
    assert report.contracts["C-ZERO-008"].status == "fail", text
    assert min(v["step"] for v in report.contracts["C-ZERO-008"].violations) == 1, text
    assert bug_classes(report.diagnosis) == ["logged-norm"], text
    assert "every tensor but moe.experts.*" in report.diagnosis[0].evidence, text


def test_summed_factor_is_exact_in_the_synthetic_records() -> None:
    """The implied factor of the experts' first update is the world size to rounding: the SGD step
    replayed from the reference's own lr and weight decay."""
    rec = moe_records(2, 1, "experts-summed")[0]
    obs = rec.ranks[0]
    name = "moe.experts.1.fc.weight"
    lr, wd = SGD["lr"], SGD["weight_decay"]
    before = rec.ref.params_before[name]
    implied = (before - obs.params[name]) / lr - wd * before
    assert np.allclose(implied, 2 * rec.ref.grad[name], rtol=1e-9, atol=1e-14)
