"""``zerosim bench offload`` as a user runs it: both trainers side by side, the budget held, bitwise equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.test_outputs import ROOT, clone_like, tracked_hashes  # noqa: E402


def _bench(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerosim", "bench", "offload", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_offload_bench_reports_the_budget_held_and_bitwise_equal_training(tmp_path: Path) -> None:
    """Run as the docs show it, in a clone: the report goes to a fresh folder, no tracked file changes."""
    clone = clone_like(tmp_path)
    before = tracked_hashes(clone)
    run = _bench("--steps", "2", "--warmup", "0", cwd=clone)
    assert run.returncode == 0, run.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True)
    assert status.stdout == "" and {k: v for k, v in tracked_hashes(clone).items() if k in before} == before
    (out,) = clone.glob("reports/bench-offload-*/bench_offload.json")
    report = json.loads(out.read_text())
    assert report["bitwise_equal"] is True
    assert 0 < report["device_peak_bytes"] <= report["device_budget_bytes"]
    assert report["device_budget_bytes"] == sum(sorted(report["unit_shard_bytes"])[-2:])
    perf = report["performance_stats"]
    assert perf["hits"] + perf["misses"] == perf["fetches"] > 0
    assert perf["evictions"] > 0  # the budget holds two of the three units
    assert len(report["samples_s"]["plain"]) == len(report["samples_s"]["offload"]) == 2
    plan = report["schedule_plan"]
    assert 0 < plan["device_peak"] <= plan["budget"] == report["device_budget_bytes"]
    assert plan["bytes_device_to_host"] == sum(report["unit_shard_bytes"])  # every gradient shard, once
    assert 0 < plan["ahead_fraction"] < 1
    for row in report["schedule_sweep"]:  # budgets of 2, 3 and every unit, prefetch depths 1 and 2
        assert 0 < row["device_peak"] <= row["budget"] and row["prefetch_depth"] in (1, 2)
    med = report["median_step_s"]
    assert report["offload_over_plain"] == med["offload"] / med["plain"]
    assert "bitwise equal to the run without offload: yes" in run.stdout


@pytest.mark.parametrize(("args", "line"), [
    (["--steps", "0"], "error: invalid steps=0: must be a positive integer"),
    (["--device", "tpu"], "error: invalid device='tpu': must be one of cpu, cuda"),
    (["--model", "nope"], "error: invalid model='nope'"),
    (["--budget-units", "-1"], "error: invalid budget_units=-1"),
])
def test_offload_bench_bad_input_is_one_line_and_exit_2(args: list[str], line: str) -> None:
    run = _bench(*args)
    assert run.returncode == 2
    assert run.stderr.strip().startswith(line) and len(run.stderr.strip().splitlines()) == 1, run.stderr
