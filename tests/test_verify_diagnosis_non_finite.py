"""A trainer whose weights go non-finite while the float64 reference stays finite fails C-ZERO-002.

Such a trainer is broken, not the harness: ``zerosim verify`` exits 1 (a contract failed), not 2
(bad input) nor 3 (a rank failed), and the diagnosis ``non-finite-weights`` names the tensor, the
first non-finite element and the step. Its twin without the fault passes. Each test runs the real
command line in a subprocess (``tests.test_verify_bad_input.run_verify``); the trainers are in
``tests/verify_trainers/non_finite.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.test_verify_bad_input import run_verify  # noqa: E402
from tests.verify_trainers.non_finite import BROKEN_ELEMENT, BROKEN_STEP, BROKEN_TENSOR  # noqa: E402
from zerosim.values.observe import TrainerObservation  # noqa: E402
from zerosim.verify.diagnosis import bug_classes, non_finite  # noqa: E402

TARGET = "tests.verify_trainers.non_finite"
FAILED = 1  # verify's exit status when a contract failed
RUN = ("--world", "2", "--steps", "4", "--optimizers", "sgd", "--json")


def _report(factory: str, code: int) -> dict:
    result = run_verify(f"{TARGET}:{factory}", *RUN)
    both = result.stdout + result.stderr
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{both}"
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    return json.loads(result.stdout)


@pytest.mark.torchdist
def test_weights_turned_minus_inf_fail_c_zero_002_naming_tensor_element_and_step() -> None:
    report = _report("inf_at_step", FAILED)
    assert report["verdict"] == "fail"
    equivalence = report["contracts"]["C-ZERO-002"]
    assert equivalence["status"] == "fail"
    first = equivalence["violations"][0]
    assert (first["step"], first["tensor"], first["start"]) == (BROKEN_STEP, BROKEN_TENSOR, BROKEN_ELEMENT)
    top = report["diagnosis"][0]
    assert top["bug_class"] == "non-finite-weights", report["diagnosis"]
    assert f"at step {BROKEN_STEP} " in top["evidence"], top
    assert f"-inf in {BROKEN_TENSOR}[{BROKEN_ELEMENT}]" in top["evidence"], top


@pytest.mark.torchdist
def test_the_same_trainer_without_the_fault_passes() -> None:
    report = _report("finite_twin", 0)
    assert report["verdict"] == "pass"
    assert report["diagnosis"] == []


@pytest.mark.torchdist
@pytest.mark.slow
def test_nan_in_every_returned_parameter_set_is_a_contract_failure_not_bad_input() -> None:
    result = run_verify("tests.verify_trainers.bad:nan_parameters", *RUN)
    assert result.returncode == FAILED, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["contracts"]["C-ZERO-002"]["status"] == "fail"
    assert report["diagnosis"][0]["bug_class"] == "non-finite-weights", report["diagnosis"]
    assert "nan in " in report["diagnosis"][0]["evidence"]


def test_diagnosis_blames_only_values_where_the_reference_is_finite() -> None:
    """``non-finite-weights`` is a pure function of the step records: a value the reference itself holds
    non-finite is not the trainer's fault; one where the reference is finite is named."""
    rank0 = TrainerObservation("sgd", 1, 0, 0.0, {"w": np.array([np.inf, 1.0])})
    rec = SimpleNamespace(step=1, phase="sgd", ref=SimpleNamespace(params={"w": np.array([np.inf, 1.0])}),
                          ranks=[rank0])
    assert non_finite([rec]) == []
    rank0.params["w"] = np.array([np.inf, -np.inf])
    found = non_finite([rec])
    assert bug_classes(found) == ["non-finite-weights"]
    assert "at step 1 (sgd) rank 0's full_parameters() hold -inf in w[1]" in found[0].evidence


def test_c_zero_002_fails_a_one_sided_non_finite_value_and_passes_one_the_reference_shares() -> None:
    """The live-trainer comparison, pure: a non-finite value where the float64 reference is finite (or
    of another kind: +inf against NaN) is beyond any bound; the same non-finite value on both sides (the
    reference diverged too) is agreement, whatever the bound there says."""
    from zerosim.checks.equivalence import _trainer_equivalence

    ref = np.array([np.inf, np.nan, -np.inf, 1.0])
    bound = np.array([np.nan, np.nan, np.inf, 1e-6])

    def verdict(got: np.ndarray):
        rank0 = TrainerObservation("sgd", 1, 0, 0.0, {"w": got})
        rec = SimpleNamespace(step=1, phase="sgd", ranks=[rank0],
                              ref=SimpleNamespace(params={"w": ref}, state={}),
                              bounds=SimpleNamespace(params={"w": bound}, state={}))
        return _trainer_equivalence([rec], "C-ZERO-002")

    assert verdict(ref.copy()).passed
    for i, wrong in ((0, -np.inf), (1, np.inf), (2, 0.0), (3, np.nan)):
        got = ref.copy()
        got[i] = wrong
        broken = verdict(got)
        assert not broken.passed, (i, wrong)
        assert (broken.violations[0]["start"], broken.violations[0]["tensor"]) == (i, "w"), broken.violations
