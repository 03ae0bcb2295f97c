"""``zerosim verify --precision`` end to end at world 2 on the SGD phase (a few steps each): the
handwritten correct trainer (not built on this project's adapters) passes, and the broken ones fail
with their class named. The judge itself is tested as pure functions in test_mixed_precision_judge.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from zerosim.verify import verify  # noqa: E402

HERE = "tests.mixed_precision_trainers"


def _run(factory: str, precision: str, steps: int = 3):
    return verify(f"{HERE}:{factory}", world=2, steps=steps, optimizers="sgd", precision=precision)


def test_a_correct_handwritten_bf16_trainer_passes_and_received_the_policy() -> None:
    report = _run("correct", "bf16")
    assert report.verdict == "pass", report.to_json()
    # the trainer raises NotImplementedError without optim["mixed_precision"]: a pass means it arrived
    assert report.phases[0]["status"] == "ran"
    assert report.extra["mixed_precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert 0 <= report.contracts["C-ZERO-002"].details["error_over_tolerance"] < 1


@pytest.mark.parametrize(
    "factory, precision, bug_class, contract",
    [("no_master", "bf16", "no-fp32-master", "C-ZERO-002"),
     ("reduce_bf16", "bf16", "reduce-dtype", "C-ZERO-005"),
     ("no_unscale", "fp16", "loss-scale", "C-ZERO-002")],
)
def test_a_broken_trainer_fails_with_its_class_named(factory: str, precision: str, bug_class: str,
                                                     contract: str) -> None:
    report = _run(factory, precision)
    assert report.verdict == "fail"
    assert report.contracts[contract].status == "fail", report.contracts[contract]
    assert report.diagnosis and report.diagnosis[0].bug_class == bug_class, report.diagnosis
