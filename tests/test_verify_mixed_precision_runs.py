"""``zerosim verify --precision`` end to end at world 2 on the SGD phase (a few steps each): the
handwritten correct trainer (not built on this project's adapters) passes, and the broken ones fail
with their class named. The judge itself is tested as pure functions in test_mixed_precision_judge.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from zerosim.verify import verify  # noqa: E402
from zerosim.verify.render import render_text  # noqa: E402

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
    header, *rest = render_text(report).splitlines()
    assert "bf16 compute (bfloat16 parameters and gradients), float32 master weights, gradients reduced in " \
        "float32" in header, header
    closest = next(line for line in rest if line.startswith("C-ZERO-002: "))
    assert "normwise" in closest and "median update error" in closest and " -" not in closest, closest


@pytest.mark.parametrize(
    "factory, precision, bug_class, contract",
    [("no_master", "bf16", "no-fp32-master", "C-ZERO-002"),
     ("master_init", "bf16", "master-init", "C-ZERO-002"),
     ("reduce_bf16", "bf16", "reduce-dtype", "C-ZERO-005"),
     ("no_unscale", "fp16", "loss-scale", "C-ZERO-002")],
)
def test_a_broken_trainer_fails_with_its_class_named(factory: str, precision: str, bug_class: str,
                                                     contract: str) -> None:
    report = _run(factory, precision)
    assert report.verdict == "fail"
    assert report.contracts[contract].status == "fail", report.contracts[contract]
    assert report.diagnosis and report.diagnosis[0].bug_class == bug_class, report.diagnosis


def test_ddp_reducing_in_the_policys_bf16_passes_its_dtype_check() -> None:
    """The ddp adapter's cast hook reduces in bfloat16 when the policy says so: C-ZERO-005's reduce_dtype
    clause holds (the byte counts of the float32 ring model are findings, not failures)."""
    report = verify("ddp", world=2, steps=2, optimizers="sgd", precision="bf16", reduce_dtype="bfloat16")
    assert report.verdict == "pass", report.to_json()
    assert not [v for v in report.contracts["C-ZERO-005"].violations if "bfloat16" in v.get("message", "")
                and "policy" in v.get("message", "")]
