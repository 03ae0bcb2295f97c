"""zerosim.monitor on DeepSpeed engines (``zerosim.monitor.deepspeed.attach``, ZeRO stages 1-3) and in a
Hugging Face ``Trainer`` run (``zerosim.monitor.hf.ZeroMonitorCallback``), under torchrun at world 2 on
the CPU: fault-free runs give no violation; DeepSpeed's optimizer state zeroed on one rank (a bad load)
is caught at the next check, naming the rank. One launch per framework, shared by its tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason

PROGRAMS = Path(__file__).parent / "monitor_programs"
BOUND_S = 240.0


def _launch(argv: list[str]) -> None:
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    run = run_ranks(2, argv, BOUND_S, env={"PYTHONWARNINGS": "ignore"})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    pytest.importorskip("deepspeed")
    results = tmp_path_factory.mktemp("ds") / "results.jsonl"
    _launch([str(PROGRAMS / "deepspeed_run.py"), str(results), "s1=1,11,5", "s3=3,11,5",
             "zero2=2,11,5,zero-state;rank=1;step=7"])
    return {r["name"]: r["summary"] for r in map(json.loads, results.read_text().splitlines())}


def test_deepspeed_stages_1_and_3_run_clean(deepspeed_runs):
    for name, adapter in (("s1", "deepspeed-1"), ("s3", "deepspeed-3")):
        summary = deepspeed_runs[name]
        assert summary["adapter"] == adapter and summary["checks"] == 3, summary
        assert summary["violation_count"] == 0, summary["violations"][:3]
        # the norm DeepSpeed logged cannot be recomputed (its gradient partitions are freed): said once
        assert len(summary["notes"]) == 1 and "DeepSpeed frees its gradient" in summary["notes"][0], summary


def test_deepspeed_state_zeroed_on_one_rank_is_caught_at_the_next_check(deepspeed_runs):
    summary = deepspeed_runs["zero2"]
    assert summary["adapter"] == "deepspeed-2"
    first = summary["violations"][0]
    assert (first["step"], first["contract"], first["clause"], first["ranks"]) == \
        (10, "C-ZERO-002", "step_counter", [1]), first
    assert first["tensor"] is not None


def test_a_hugging_face_trainer_run_is_monitored_by_one_callback(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _launch([str(PROGRAMS / "hf_run.py"), str(tmp_path / "summary.json"), str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["enabled"] and summary["checks"] == 2 and summary["violation_count"] == 0, summary
    files = sorted(p.name for p in (tmp_path / "monitor").iterdir())
    assert files == ["rank-00000.jsonl", "rank-00001.jsonl", "summary.json"]
