"""The references computed in a child process while the ranks train are the references evaluate would
compute itself, bit for bit, and a job that delivers nothing leaves evaluate computing them."""

from __future__ import annotations

import numpy as np

from zerosim.engine.config import RunConfig
from zerosim.engine.reference import independent_reference, ordered_reference
from zerosim.engine.run_result import ReferenceJob, evaluate
from zerosim.engine.spmd import simulate_observations


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return False
        return all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_child_references_equal_in_process_ones() -> None:
    run = RunConfig(model="tiny", world_size=4, strategy="hybrid_shard:2", micro_batches=2, steps=2,
                    precision="bf16").validate()
    job = ReferenceJob(run, ordered=True)
    got = job.get()
    assert got is not None
    refs, timings = got
    assert set(refs) == {"independent", "ordered"}
    assert set(timings) == {"ground_truth_s", "ordered_reference_s"}
    assert _same(refs["independent"], independent_reference(run))
    assert _same(refs["ordered"], ordered_reference(run))


def test_evaluate_with_a_job_matches_evaluate_without() -> None:
    run = RunConfig(model="tiny", world_size=4, steps=2).validate()
    obs = simulate_observations(run)
    plain = evaluate(run, obs)
    with_job = evaluate(run, obs, references=ReferenceJob(run, ordered=True))
    assert "references_wait_s" in with_job.timings
    assert {k: v.to_json() for k, v in plain.verdicts.items()} == {
        k: v.to_json() for k, v in with_job.verdicts.items()
    }


def test_a_job_that_delivers_nothing_leaves_evaluate_computing() -> None:
    run = RunConfig(model="tiny", world_size=2, steps=1).validate()
    obs = simulate_observations(run)
    job = ReferenceJob(run, ordered=True)
    job.cancel()
    assert job.get() is None
    result = evaluate(run, obs, references=job)
    assert result.passed and "ground_truth_s" in result.timings and "references_wait_s" not in result.timings
