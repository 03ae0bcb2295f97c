"""C-ZERO-002's mixed-precision mode and its diagnosis as pure functions on synthetic arrays: a trainer
within the perturbed reference's noise passes; a wrong input fails with a diagnostic naming the step,
the rank and the tensor, and the diagnosis names its class."""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.checks.equivalence import check_step_equivalence
from zerosim.checks.logged_norm import check_logged_norm
from zerosim.checks.mixed_precision import (
    MIN_MOVED,
    SAFETY,
    MixedPrecisionStep,
    compute_dtype_values,
    normwise_error,
    round_to_compute_dtype,
    update_bound,
)
from zerosim.values.observe import TrainerObservation
from zerosim.verify.diagnosis import diagnose_mixed

RNG = np.random.default_rng(7)
NAMES = ("w", "v", "b")
SHAPES = {"w": (8, 6), "v": (40,), "b": (5,)}


def _step(noise: float = 1e-3, world: int = 2, change=None, scale=None, skipped=False, overflow=False,
          state=False, step=1) -> MixedPrecisionStep:
    """Masters ``before``; the reference moves each tensor by an update ``u``; the perturbed reference
    by ``u`` with relative noise 1e-2; each rank by ``u`` with relative ``noise`` (``change(name, dp)``
    alters the trainers' update)."""
    before = {n: RNG.normal(size=SHAPES[n]).astype(np.float32).astype(np.float64) for n in NAMES}
    update = {n: 1e-2 * RNG.normal(size=SHAPES[n]) for n in NAMES}
    ref = {n: before[n] + update[n] for n in NAMES}
    pert = {n: before[n] + update[n] * (1 + 1e-2 * RNG.normal(size=SHAPES[n])) for n in NAMES}
    got = {}
    for n in NAMES:
        dp = update[n] * (1 + noise * RNG.normal(size=SHAPES[n]))
        if change is not None:
            dp = change(n, dp)
        got[n] = (before[n] + dp).astype(np.float32)
    if skipped:
        got = {n: before[n].astype(np.float32) for n in NAMES}
    st = None
    ref_state, pert_state = {}, {}
    if state:
        ref_state = {n: {"momentum_buffer": update[n] / -0.1} for n in NAMES}
        pert_state = {n: {"momentum_buffer": (pert[n] - before[n]) / -0.1} for n in NAMES}
        st = {n: {"momentum_buffer": ((got[n] - before[n]) / -0.1).astype(np.float32)} for n in NAMES}
    def own_state():
        return None if st is None else {n: {k: a.copy() for k, a in e.items()} for n, e in st.items()}

    ranks = [TrainerObservation("sgd", step, r, 1.0, {n: a.copy() for n, a in got.items()}, own_state())
             for r in range(world)]
    return MixedPrecisionStep(step, "sgd", before, ref, pert, ranks, ref_state=ref_state,
                              perturbed_state=pert_state, trainer_skipped=skipped, ref_overflow=overflow,
                              scale=scale, grad_norm=1.0, perturbed_grad_norm=1.0 + 1e-4, grad_deviation=1e-3,
                              extra={"optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9}})


def test_a_trainer_within_the_noise_passes_with_its_ratio_reported() -> None:
    verdict = check_step_equivalence([_step(noise=1e-3, state=True), _step(noise=1e-3, step=2)])
    assert verdict.passed, [str(v) for v in verdict.violations]
    assert 0 < verdict.details["error_over_tolerance"] < 1
    assert verdict.details["median_update_error"] < 1e-2


def test_a_bug_in_one_tensor_on_one_rank_fails_naming_step_rank_and_tensor() -> None:
    rec = _step(noise=1e-3)
    rec.ranks[1].params["b"] = (rec.before["b"] + 0.5 * (rec.ref["b"] - rec.before["b"])).astype(np.float32)
    verdict = check_step_equivalence([rec])
    assert not verdict.passed
    (v,) = verdict.violations
    assert (v.clause, v.step, v.ranks, v.tensor) == ("normwise_update", 1, (1,), "b")
    assert "step 1 on rank 1" in v.message and "b's update" in v.message
    assert v.error == pytest.approx(0.5, rel=1e-2) and v.error > v.tolerance


def test_a_wrong_optimizer_state_fails_naming_the_state() -> None:
    rec = _step(noise=1e-3, state=True)
    rec.ranks[0].state["w"]["momentum_buffer"] *= 2
    verdict = check_step_equivalence([rec])
    assert [(v.tensor, v.context.get("state"), v.ranks) for v in verdict.violations] == [
        ("w", "momentum_buffer", (0,))]


def test_the_bound_is_safety_times_the_perturbed_deviation_plus_master_rounding() -> None:
    before = np.ones(100)
    ref = before + 1e-3
    pert = ref + 1e-6
    e_pert = normwise_error(pert, ref, before)
    assert e_pert == pytest.approx(1e-3)
    bound = update_bound(e_pert, 0.0, ref, before)
    rounding = 4 * 2.0**-24 * np.linalg.norm(ref) / np.linalg.norm(ref - before)
    assert bound == pytest.approx(SAFETY * 1e-3 + rounding)
    # the whole model's deviation is the floor of every tensor's
    assert update_bound(0.0, 2e-3, ref, before) == pytest.approx(SAFETY * 2e-3 + rounding)


def test_masters_held_in_bf16_fail_as_no_fp32_master() -> None:
    def to_bf16(_name, dp):
        return dp

    rec = _step(noise=1e-3, change=to_bf16)
    for obs in rec.ranks:
        for n in NAMES:
            x = np.ascontiguousarray(obs.params[n], dtype=np.float32)
            obs.params[n] = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    assert compute_dtype_values(rec.ranks[0].params["w"], "bfloat16").all()
    verdict = check_step_equivalence([rec])
    clauses = {v.clause for v in verdict.violations}
    assert "master_dtype" in clauses
    first = next(v for v in verdict.violations if v.clause == "master_dtype")
    assert first.step == 1 and first.ranks == (0,) and first.tensor in ("w", "v")
    outcome = verdict
    assert [d.bug_class for d in diagnose_mixed([rec], {"C-ZERO-002": outcome})] == ["no-fp32-master"]


def test_masters_started_from_the_bf16_cast_fail_as_master_init() -> None:
    """A trainer whose step began from bf16-rounded masters: its update is the reference's plus the
    rounding of ``before`` (relative 2^-9 of the weight, here a fifth of the update); diagnosed as such."""
    rec = _step(noise=1e-4)
    for obs in rec.ranks:
        for n in NAMES:
            shift = round_to_compute_dtype(rec.before[n], "bfloat16") - rec.before[n]
            obs.params[n] = (obs.params[n] + shift).astype(np.float32)
    verdict = check_step_equivalence([rec])
    first = verdict.violations[0]
    assert first.clause == "master_init" and first.step == 1 and first.ranks == (0, 1)
    found = diagnose_mixed([rec], {"C-ZERO-002": verdict})
    assert [d.bug_class for d in found] == ["master-init"], found
    assert "bfloat16-cast weights" in found[0].evidence


def test_a_rounded_start_too_small_for_the_normwise_bound_still_fails_master_init() -> None:
    """Updates ten times larger: the rounding is within the normwise bound, and still exactly what
    the trainer's offset is."""
    rec = _step(noise=1e-5)
    for n in NAMES:
        rec.ref[n] = rec.before[n] + 10 * (rec.ref[n] - rec.before[n])
        rec.perturbed[n] = rec.before[n] + 10 * (rec.perturbed[n] - rec.before[n])
        shift = round_to_compute_dtype(rec.before[n], "bfloat16") - rec.before[n]
        for obs in rec.ranks:
            obs.params[n] = rec.before[n] + 10 * (obs.params[n] - rec.before[n]) + shift
    verdict = check_step_equivalence([rec])
    assert {v.clause for v in verdict.violations} == {"master_init"}, verdict.violations


def test_an_unrelated_offset_is_not_called_master_init() -> None:
    rec = _step(noise=0.5)
    verdict = check_step_equivalence([rec])
    assert not verdict.passed
    found = diagnose_mixed([rec], {"C-ZERO-002": verdict})
    assert "master-init" not in [d.bug_class for d in found]


def test_round_to_compute_dtype_is_torchs_cast() -> None:
    torch = pytest.importorskip("torch")
    x = RNG.normal(size=4000).astype(np.float32)
    x[:4] = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.0e38]  # ties to even, and the top
    for dtype, tdtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        expected = torch.from_numpy(x).to(tdtype).double().numpy()
        np.testing.assert_array_equal(round_to_compute_dtype(x, dtype), expected)


def test_a_small_tensor_never_triggers_the_master_dtype_clause() -> None:
    rec = _step(noise=1e-3)
    x = np.ascontiguousarray(rec.ranks[0].params["b"], dtype=np.float32)
    rec.ranks[0].params["b"] = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    assert SHAPES["b"][0] < MIN_MOVED
    assert not [v for v in check_step_equivalence([rec]).violations if v.clause == "master_dtype"]


@pytest.mark.parametrize("factor, words", [(1024.0, "not unscaled"), (1 / 1024.0, "unscaled twice")])
def test_an_update_off_by_the_loss_scale_is_diagnosed_loss_scale(factor: float, words: str) -> None:
    rec = _step(noise=1e-4, scale=1024.0, state=True, change=lambda _n, dp: dp * factor)
    verdict = check_step_equivalence([rec])
    assert not verdict.passed
    found = diagnose_mixed([rec], {"C-ZERO-002": verdict})
    assert found and found[0].bug_class == "loss-scale" and words in found[0].evidence


def test_a_skip_without_overflow_and_a_non_finite_master_fail_loss_scale() -> None:
    legit = _step(skipped=True, overflow=True, scale=65536.0)
    assert check_step_equivalence([legit]).passed
    wrong = _step(skipped=True, overflow=False, scale=65536.0)
    verdict = check_step_equivalence([wrong])
    assert [v.clause for v in verdict.violations] == ["loss_scale"] and "without an overflow" in (
        verdict.violations[0].message)
    taken = _step(scale=65536.0)
    taken.ranks[1].params["w"][0, 0] = np.nan
    verdict = check_step_equivalence([taken])
    assert [(v.clause, v.ranks) for v in verdict.violations] == [("loss_scale", (1,))]
    found = diagnose_mixed([taken], {"C-ZERO-002": verdict})
    assert [d.bug_class for d in found] == ["loss-scale"]


def test_logged_norm_under_the_policy_has_its_estimated_bound() -> None:
    rec = _step()
    for obs in rec.ranks:
        obs.grad_norm = 1.0 + 2e-3
    assert check_logged_norm([rec], {}).passed
    rec.ranks[1].grad_norm = 1.5
    verdict = check_logged_norm([rec], {})
    assert [(v.clause, v.step, v.ranks) for v in verdict.violations] == [("logged_norm", 1, (1,))]
