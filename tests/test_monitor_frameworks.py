"""zerosim.monitor on DeepSpeed engines (``zerosim.monitor.deepspeed.attach``, ZeRO stages 1-3) and in a
Hugging Face ``Trainer`` run (``zerosim.monitor.hf.ZeroMonitorCallback``), under torchrun at world 2 on
the CPU: fault-free runs of 200 steps give no violation, with DeepSpeed's logged norm compared with the
norm recomputed from its gradient partitions, and the same parameters bit for bit as without the monitor;
DeepSpeed's optimizer state zeroed on one rank (a bad load), and each rank logging its own partition's
norm, are caught at the next check, naming the rank. One launch per framework, shared by its tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason

PROGRAMS = Path(__file__).parent / "monitor_programs"
BOUND_S = 240.0
SOAK_STEPS, EVERY = 200, 5  #: the fault-free runs
STEPS = 11  #: the runs with a fault, and the run without the monitor the fault-free ones are compared with


def _launch(argv: list[str]) -> None:
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    run = run_ranks(2, argv, BOUND_S, env={"PYTHONWARNINGS": "ignore", "MONITOR_COMPARE_AFTER": str(STEPS)})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    tmp = tmp_path_factory.mktemp("ds")
    results = tmp / "results.jsonl"
    soak, short = f"{SOAK_STEPS},{EVERY}", f"{STEPS},{EVERY}"
    _launch([str(PROGRAMS / "deepspeed_run.py"), str(results), str(tmp), f"s1=1,{soak}", f"s3=3,{soak}",
             f"s2=2,{soak},own-loop", f"plain2=2,{short},unmonitored", f"local2=2,{short},local-norm@7",
             f"zero2=2,{short},zero-state;rank=1;step=7"])
    runs = {r["name"]: r for r in map(json.loads, results.read_text().splitlines())}
    for name, run in runs.items():
        files = sorted((tmp / name).glob("rank-*.jsonl")) if (tmp / name).is_dir() else []
        run["observations"] = [json.loads(line) for f in files for line in f.read_text().splitlines()]
    return runs


#: the parameters of deepspeed_run.py's model: Linear(6, 10), two Linear(10, 10), Linear(10, 3)
TINY_PARAMETERS = 6 * 10 + 10 + 2 * (10 * 10 + 10) + 10 * 3 + 3


def test_deepspeed_stages_1_to_3_run_clean_with_the_norm_recomputed_from_the_partitions(deepspeed_runs):
    for name, adapter in (("s1", "deepspeed-1"), ("s2", "deepspeed-2"), ("s3", "deepspeed-3")):
        run = deepspeed_runs[name]
        summary = run["summary"]
        assert summary["adapter"] == adapter and summary["checks"] == SOAK_STEPS // EVERY, summary
        assert summary["violation_count"] == 0, summary["violations"][:3]
        assert summary["notes"] == [], summary  # nothing left uncompared
        # every check compared the logged norm with squares measured on every rank, covering every
        # element of the model once
        by_step: dict[int, list[dict]] = {}
        for obs in run["observations"]:
            by_step.setdefault(obs["step"], []).append(obs)
        assert sorted(by_step) == list(range(0, SOAK_STEPS, EVERY)), (name, sorted(by_step))
        for step, rows in by_step.items():
            assert len(rows) == 2 and all(o["grad_sq"] is not None and o["grad_norm"] for o in rows), rows
            assert sum(o["grad_numel"] for o in rows) == TINY_PARAMETERS, (name, step, rows)


def test_deepspeed_measuring_the_gradient_changes_no_training_number(deepspeed_runs):
    assert deepspeed_runs["s2"]["params_after"] == deepspeed_runs["plain2"]["params"]


def test_deepspeed_logging_each_ranks_partition_norm_is_caught_naming_rank_and_step(deepspeed_runs):
    summary = deepspeed_runs["local2"]["summary"]
    assert summary["adapter"] == "deepspeed-2" and summary["checks"] == 3, summary
    found = summary["violations"]
    assert found and {v["step"] for v in found} == {10}, found  # logged wrong from step 7, checked at 10
    assert all((v["contract"], v["clause"]) == ("C-ZERO-002", "grad_norm") for v in found), found
    # rank 0's value is the majority of two across ranks, so only the recomputed norm can name it
    recomputed = [v for v in found if "recomputed from the shards" in v["message"]]
    assert sorted(r for v in recomputed for r in v["ranks"]) == [0, 1], found


def test_deepspeed_state_zeroed_on_one_rank_is_caught_at_the_next_check(deepspeed_runs):
    summary = deepspeed_runs["zero2"]["summary"]
    assert summary["adapter"] == "deepspeed-2"
    first = summary["violations"][0]
    # two ranks, two counters: no majority, so the ranks are said to disagree rather than one named
    assert (first["step"], first["contract"], first["clause"], first["ranks"]) == \
        (10, "C-ZERO-002", "step_counter", [0, 1]), first
    assert first["tensor"] is not None


def test_a_hugging_face_trainer_run_is_monitored_by_one_callback(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _launch([str(PROGRAMS / "hf_run.py"), str(tmp_path / "summary.json"), str(tmp_path), str(SOAK_STEPS),
             str(EVERY)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["enabled"] and summary["violation_count"] == 0, summary
    assert summary["checks"] == SOAK_STEPS // EVERY, summary
    files = sorted(p.name for p in (tmp_path / "monitor").iterdir())
    assert files == ["rank-00000.jsonl", "rank-00001.jsonl", "summary.json"]
