"""The example ZeRO-1 trainer passes ``zerosim verify``, and the pytest helper reports like a test should.

``examples/zero1_trainer.py`` must hold C-ZERO-001..003 at world 2, 3 and 4 in float64 (world sizes
that do not divide the model's parameter count, so the last slice is padded). The helper
``zerosim.testing.assert_trainer_verifies`` returns the report on a pass and raises AssertionError
carrying the diagnostic on a failure.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zerosim.errors import ConfigError  # noqa: E402
from zerosim.testing import assert_trainer_verifies  # noqa: E402
from zerosim.testing.verify import failure_message  # noqa: E402
from zerosim.verify import Diagnosis, VerifyReport, verify  # noqa: E402
from zerosim.verify.model import build_model, parameter_count  # noqa: E402
from zerosim.verify.outcome import stated  # noqa: E402

EXAMPLE = "examples.zero1_trainer:make_trainer"
VALUE_CONTRACTS = ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003")


def assert_example_holds(report: VerifyReport, world: int) -> None:
    assert report.verdict == "pass", failure_message(report)
    assert report.world == world
    for cid in VALUE_CONTRACTS:
        assert report.contracts[cid].status == "pass", f"{cid}: {report.contracts[cid].reason}"
    details = report.contracts["C-ZERO-002"].details
    assert details["max_error"] <= details["tolerance"], details
    ran = [p["name"] for p in report.phases if p.get("status") != "skipped"]
    assert ran == ["sgd", "adamw"], report.phases


@pytest.mark.torchdist
@pytest.mark.slow
def test_example_passes_through_the_pytest_helper_at_world_2() -> None:
    report = assert_trainer_verifies(EXAMPLE, world=2, steps=8)
    assert_example_holds(report, 2)


@pytest.mark.torchdist
@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_example_passes_at_world_sizes_that_do_not_divide_the_model(world: int) -> None:
    assert parameter_count(build_model("gpt")) % world != 0
    assert_example_holds(verify(EXAMPLE, world=world, steps=8), world)


@pytest.mark.torchdist
@pytest.mark.slow
def test_helper_raises_with_the_diagnostic_of_a_broken_trainer() -> None:
    """A gradient summed, not averaged: the message names the contract, the first step, the rank, the
    tensor and its element range, and the bug class."""
    with pytest.raises(AssertionError) as caught:
        assert_trainer_verifies("tests.verify_trainers.broken:summed_gradient", world=2, steps=4)
    message = str(caught.value)
    first_tensor = next(name for name, _ in build_model("gpt").named_parameters())
    for needle in (
        "C-ZERO-002 failed",
        "step 1 (sgd)",
        "rank 0",
        f"tensor {first_tensor!r} elements [",
        "likely bug: gradient-scale",
    ):
        assert needle in message, f"{needle!r} missing from:\n{message}"


@pytest.mark.torchdist
def test_helper_turns_a_protocol_breach_into_an_assertion() -> None:
    """A factory that does not exist is the trainer's fault: AssertionError carrying the one-line reason
    (the ranks resolve it and agree on the error before any of them trains)."""
    with pytest.raises(AssertionError, match="no_such_factory"):
        assert_trainer_verifies("tests.verify_trainers.bad:no_such_factory", world=2)


@pytest.mark.torchdist
@pytest.mark.slow
def test_helper_turns_a_failing_rank_into_an_assertion_naming_it() -> None:
    from tests.verify_trainers import bad

    with pytest.raises(AssertionError) as caught:
        assert_trainer_verifies("tests.verify_trainers.bad:rank_raises_mid_run", world=2, steps=4)
    message = str(caught.value)
    assert f"rank {bad.MISBEHAVING_RANK}" in message and bad.RAISED_MESSAGE in message, message


def test_helper_leaves_a_bad_option_a_config_error() -> None:
    with pytest.raises(ConfigError, match="world"):
        assert_trainer_verifies(EXAMPLE, world=0)


def test_failure_message_names_every_failed_contract_and_the_classes() -> None:
    """The message is built from the report alone: first violation of each failed contract (lowest step,
    then rank), the violation count (all of them, not only those listed), then every diagnosis in order."""
    late = {
        "contract": "C-ZERO-002",
        "phase": "adamw",
        "step": 6,
        "rank": 0,
        "tensor": "h.0.w",
        "start": 4,
        "stop": 9,
        "expected": 1.0,
        "got": 1.5,
        "error": 0.5,
        "tolerance": 1e-12,
        "message": "parameter",
    }
    early = dict(late, step=5, rank=1, tensor="h.1.b", start=0, stop=3)
    report = VerifyReport(
        "pkg:make",
        2,
        8,
        "float64",
        {
            "C-ZERO-001": stated("pass"),
            "C-ZERO-002": stated("fail", "first at step 5", [late, early], {"violation_count": 40}),
            "C-ZERO-003": stated(
                "fail", "ranks differ", [dict(late, contract="C-ZERO-003", rank=1)]
            ),
        },
        [Diagnosis("clip-norm", "starts where the clip binds"), Diagnosis("ranks-agree-wrong", "all agree")],
    )
    lines = failure_message(report).splitlines()
    assert lines[0] == "zerosim verify pkg:make: fail (world 2, 8 steps, float64)"
    assert lines[1] == "C-ZERO-002 failed: first at step 5"
    assert lines[2].startswith("  first violation: step 5 (adamw), rank 1, tensor 'h.1.b' elements [0, 3): ")
    assert "error 0.5, tolerance 1e-12" in lines[2]
    assert lines[3] == "  (40 violations in all)"
    assert lines[4] == "C-ZERO-003 failed: ranks differ"
    assert lines[-2:] == [
        "likely bug: clip-norm: starts where the clip binds",
        "likely bug: ranks-agree-wrong: all agree",
    ]
    assert not any("C-ZERO-001" in line for line in lines)
