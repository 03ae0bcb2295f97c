"""C-ZERO-005 ``reduce_dtype``: every gradient reduction moves the dtype the run's policy names.

The traffic records carry each collective's element dtype, read from the real tensor where
torch.distributed's collectives are intercepted (zerosim.verify.traffic.TrafficCounter);
zerosim.checks.traffic.check_communication judges them. Pure cases on hand-written records, one
single-rank gloo process for the interception, and one broken trainer through ``zerosim verify``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from zerosim.checks.traffic import check_communication

ROOT = Path(__file__).resolve().parents[1]


def _call(function: str, kind: str, cls: str, dtype: str, payload_bytes: int = 64) -> dict:
    return {"function": function, "kind": kind, "class": cls, "dtype": dtype, "payload_bytes": payload_bytes,
            "group": [0, 1]}


def _summary(*calls: dict) -> dict:
    return {"collectives": list(calls)}


def test_a_gradient_reduction_in_another_dtype_fails_naming_collective_step_rank_and_dtypes() -> None:
    right = _summary(_call("reduce_scatter_tensor", "reduce_scatter", "reduce", "float32"))
    wrong = _summary(
        _call("reduce_scatter_tensor", "reduce_scatter", "reduce", "bfloat16", 32),
        _call("reduce_scatter_tensor", "reduce_scatter", "reduce", "bfloat16", 32),
    )
    verdict = check_communication([[right, right], [right, wrong]], reduce_dtype="float32", phase="adamw",
                                  first_step=7)
    assert not verdict.passed
    (v,) = verdict.violations
    where = (v.contract, v.clause, v.step, v.ranks, v.phase)
    assert where == ("C-ZERO-005", "reduce_dtype", 8, (1,), "adamw")
    assert (v.tensor, v.expected, v.got) == ("reduce_scatter_tensor", "float32", "bfloat16")
    assert v.context == {"collective": "reduce_scatter", "calls": 2, "dtype": "bfloat16"}
    assert "bfloat16" in v.message and "float32" in v.message and "step 8" in v.message
    assert "2 reduce_scatter_tensor call(s), 64 bytes" in v.message
    assert verdict.checked == 5  # every gradient reduction of every rank and step was looked at


def test_parameter_exchange_control_scalars_and_unrecorded_steps_are_not_gradient_reductions() -> None:
    calls = _summary(
        _call("all_gather_into_tensor", "all_gather", "gather", "bfloat16"),
        _call("all_reduce", "all_reduce", "control", "float64", 8),  # a gradient norm
        _call("all_reduce", "all_reduce", "reduce", "float32"),
    )
    verdict = check_communication([[calls, None, {"reduce": {}}]], reduce_dtype="float32")
    assert verdict.passed and verdict.checked == 1
    # the same records under a policy that names float64: the one gradient reduction fails
    float64 = check_communication([[calls]], reduce_dtype="float64", first_step=3)
    assert [v.step for v in float64.violations] == [3]


_COUNTING = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch, torch.distributed as dist
    from zerosim.verify.traffic import TrafficCounter
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    with TrafficCounter() as counter:
        dist.all_reduce(torch.ones(6, dtype=torch.bfloat16))
        dist.all_reduce(torch.ones(1, dtype=torch.float64))
        dist.all_gather_into_tensor(torch.zeros(4, dtype=torch.float32), torch.ones(4, dtype=torch.float32))
    dist.destroy_process_group()
    print(json.dumps(counter.summary()["collectives"]))
    """
)


def test_the_counter_records_each_collectives_dtype_from_the_real_tensor() -> None:
    pytest.importorskip("torch")
    run = subprocess.run([sys.executable, "-c", _COUNTING], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    records = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["function"], r["class"], r["dtype"], r["payload_bytes"]) for r in records] == [
        ("all_reduce", "reduce", "bfloat16", 6 * 2),
        ("all_reduce", "control", "float64", 8),
        ("all_gather_into_tensor", "gather", "float32", 4 * 4),
    ]


@pytest.mark.torchdist
@pytest.mark.slow
def test_a_trainer_that_reduces_in_float32_under_float64_fails_c_zero_005() -> None:
    pytest.importorskip("torch")
    from zerosim.verify import verify

    report = verify("tests.verify_trainers.broken:reduces_in_float32", world=2, steps=2,
                    optimizers=("sgd",), timeout_s=60.0)
    assert report.verdict == "fail" and report.exit_code == 1
    c5 = report.contracts["C-ZERO-005"]
    wrong = [v for v in c5.violations if v["clause"] == "reduce_dtype"]
    # the one gradient all-reduce of each rank and step, named with both dtypes
    assert {(v["rank"], v["step"]) for v in wrong} == {(0, 1), (1, 1), (0, 2), (1, 2)}
    assert {(v["tensor"], v["expected"], v["got"]) for v in wrong} == {("all_reduce", "float64", "float32")}
    assert c5.reason.startswith("rank 0 reduced gradients in float32 in step 1")


def test_the_engines_counters_record_each_collectives_dtype() -> None:
    import numpy as np

    from zerosim.comm.base import TrafficCounter
    from zerosim.comm.mpi_traffic import DeferredTrafficCounter

    plain = TrafficCounter()
    plain.record("world", "all_reduce", 16, 2, dtype="float32")
    plain.record("world", "all_reduce", 16, 2, dtype="bfloat16")
    plain.record("world", "barrier", 0, 2)
    deferred = DeferredTrafficCounter()
    deferred.tally("world", "all_reduce", 2)[(16, np.dtype(np.float32))] += 1  # the MPI hot path
    deferred.record("world", "all_reduce", 16, 2, dtype="bfloat16")
    deferred.record("world", "barrier", 0, 2)
    assert plain.records == deferred.records  # the ring model's numbers, dtypes aside
    for counter in (plain, deferred):
        assert counter.records[("world", "all_reduce")].dtypes == {"float32": 1, "bfloat16": 1}
        assert counter.records[("world", "barrier")].dtypes == {}


def test_a_simulated_step_reports_the_dtype_of_its_gradient_reductions() -> None:
    from zerosim.engine.config import RunConfig
    from zerosim.engine.spmd import simulate_observations

    obs = simulate_observations(RunConfig(strategy="full_shard", world_size=2, steps=1))
    items = {(t.group, t.collective): t for t in obs[0].steps[0].traffic}
    reduce = items[("world", "reduce_scatter")]
    # the engine reduces float32 gradients: every reduce-scatter call moved float32
    assert reduce.dtypes == {"float32": reduce.calls} and reduce.to_json()["dtypes"] == reduce.dtypes


def test_the_engines_check_judges_the_reduce_dtype_with_the_same_function() -> None:
    import dataclasses

    from zerosim.cost.comm_model import comm_for_run
    from zerosim.engine.config import RunConfig
    from zerosim.engine.spmd import simulate_observations

    cfg = RunConfig(strategy="full_shard", world_size=2, steps=2)
    obs = simulate_observations(cfg)
    estimate = comm_for_run(cfg.resolve())
    assert check_communication(obs, estimate, reduce_dtype="float32").passed
    # rank 1's second step: its reduce-scatters claim to have moved bfloat16 (a deliberately wrong record)
    step = obs[1].steps[1]
    wrong = [dataclasses.replace(t, dtypes={"bfloat16": t.calls}) if t.collective == "reduce_scatter" else t
             for t in step.traffic]
    obs[1].steps[1] = dataclasses.replace(step, traffic=wrong)
    verdict = check_communication(obs, estimate, reduce_dtype="float32")
    (v,) = verdict.violations  # the bytes still match the ring model: only the dtype is wrong
    assert (v.clause, v.step, v.ranks, v.expected, v.got) == ("reduce_dtype", step.step, (1,), "float32",
                                                              "bfloat16")
    assert "rank 1 reduced gradients in bfloat16" in v.message
