"""The torch.distributed backend under real torchrun launches (gloo on the CPU).

- every strategy passes C-ZERO-002..005 under torchrun at world 2 and agrees with the in-process
  simulator bit for bit (engine arrays numpy, every reduction over <= 2 ranks), run through the GPU
  report's entry point with ``--cpu`` (JSON + markdown written); at world 4 with the
  engine on torch tensors, within the derived agreement bound (zerosim/checks/agreement.py);
- ``zerosim simulate --backend torch`` launches torchrun; a deliberately broken engine exits 1 naming
  the contract;
- the TorchCommunicator's own self-check command (``selftest-comm``) passes on gloo.

A raising or hung rank under torchrun, and every collective of the TorchCommunicator, are covered by
the Communicator conformance suite (tests/test_comm_conformance.py).

Each launch has a wall-clock bound; one torchrun start costs a few seconds, so launches are shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason

REASON = torch_unavailable_reason()
pytestmark = [
    pytest.mark.torchdist,
    pytest.mark.skipif(REASON is not None, reason=f"torch unavailable: {REASON}"),
]
BOUND_S = 90.0  # every launch, faulty or not, must end well within this
CONTRACTS = ("C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005")
QUIET = {"PYTHONWARNINGS": "ignore"}


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("rank ") and " failed: " in line]


def equivalence(n: int, tmp_path: Path, *options: str) -> dict:
    out = tmp_path / "equivalence.json"
    result = run_ranks(
        n,
        [
            "-m",
            "zerogpu",
            "equivalence",
            "--model",
            "tiny",
            "--seed",
            "7",
            "--out",
            str(out),
            "--json",
            *options,
        ],
        BOUND_S,
        env=QUIET,
    )
    assert not result.timed_out, result.stderr
    doc = json.loads(out.read_text())
    assert json.loads(result.stdout) == doc  # one document on stdout: rank 0 alone prints
    assert result.returncode == (0 if doc["passed"] else 1), result.stderr
    return doc


def test_every_strategy_at_world_2_passes_and_agrees_bitwise_with_the_simulator(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from zerogpu.gpu_report import report as gpu_report
    from zerosim.cli.gpu import report_parser

    def report(argv: list[str]) -> int:
        return gpu_report(report_parser().parse_args(argv))

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # the GPU report's entry point, on gloo (--cpu): torchrun -m zerogpu equivalence, then JSON + markdown
    assert report(["--cpu", "--world-size", "2", "--xp", "numpy", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "equivalence.json").read_text())
    table = (tmp_path / "equivalence.md").read_text()
    assert table in capsys.readouterr().out
    assert doc["environment"]["dist_backend"] == "gloo" and doc["world_size"] == 2
    runs = {r["strategy"]: r for r in doc["runs"]}
    assert list(runs) == ["no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2"]
    for name, r in runs.items():
        for cid in CONTRACTS:
            assert r["verdicts"][cid]["passed"] and not r["verdicts"][cid]["skipped"], (
                name,
                cid,
                r["verdicts"][cid],
            )
        agreement = r["vs_simulator"]
        assert agreement["bitwise_required"] and agreement["bitwise_equal"], (name, agreement)
        assert agreement["elements_compared"] > 0 and agreement["max_abs_diff"] == 0.0
        assert 0 <= r["max_abs_error_vs_ground_truth"] < 1e-5  # C-ZERO-002's fp32 scale on `tiny`
    assert doc["passed"]
    assert all(f"| {name} |" in table for name in runs) and "**FAIL**" not in table and "bitwise" in table


def test_world_4_with_torch_arrays_passes_and_agrees_within_the_derived_bound(tmp_path: Path) -> None:
    doc = equivalence(4, tmp_path, "--xp", "torch", "--strategies", "zero3,hybrid_shard:2", "--steps", "1")
    assert [(r["strategy"], r["shard_group_size"], r["replicas"]) for r in doc["runs"]] == [
        ("zero3", 4, 1), ("hybrid_shard:2", 2, 2)]
    for r in doc["runs"]:
        assert all(r["verdicts"][cid]["passed"] for cid in CONTRACTS), r["verdicts"]
        agreement = r["vs_simulator"]
        # torch's BLAS vs numpy's, gloo's reduction order over 4 ranks: within the bound, not bits
        assert agreement["agrees"] and not agreement["bitwise_required"], agreement
        assert agreement["bound"].startswith("derived") and 0 < agreement["max_diff_over_bound"] <= 1
        assert 0 < agreement["max_abs_diff"] < 1e-5  # torch's BLAS is not numpy's: close, not equal


def test_zerosim_simulate_backend_torch_exits_1_naming_the_broken_contract(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerosim.cli import main

    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    code = main(["simulate", "--backend", "torch", "--world-size", "2", "--strategy", "zero2", "--steps", "1",
                 "--fault", "sum-instead-of-avg", "--json"])
    out, err = capfd.readouterr()
    result = json.loads(out)  # rank 0 alone renders
    assert code == 1 and result["passed"] is False
    assert result["config"]["world_size"] == 2 and result["config"]["strategy"] == "shard_grad_op"
    assert result["verdicts"]["C-ZERO-002"]["passed"] is False
    assert "C-ZERO-002" in json.dumps(result["verdicts"]["C-ZERO-002"]["violations"][0])
    assert all(result["verdicts"][c]["passed"] for c in ("C-ZERO-003", "C-ZERO-004", "C-ZERO-005"))
    assert "ChildFailedError" not in err and failure_lines(err) == []  # an agreed verdict, not a crash


def test_the_communicator_selftest_passes_on_gloo() -> None:
    result = run_ranks(
        2, ["-m", "zerogpu", "selftest-comm", "--device", "cpu", "--json"], BOUND_S, env=QUIET
    )
    assert result.returncode == 0, result.stdout + (result.stderr or "")
    doc = json.loads(result.stdout)
    assert doc["passed"] and doc["backend"] == "gloo" and doc["world_size"] == 2
    assert len(doc["checks"]) >= 15 and not any(doc["checks"].values())


def test_outside_torchrun_the_entry_point_says_so_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR", "RANK")}
    proc = subprocess.run([sys.executable, "-m", "zerogpu", "simulate"], capture_output=True, text=True,
                          timeout=BOUND_S, env={**env, **QUIET})
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(
        "error: invalid launcher='no WORLD_SIZE/MASTER_ADDR': run under torchrun"
    ), proc.stderr
    assert "zerosim simulate --backend torch --world-size N" in lines[0]
