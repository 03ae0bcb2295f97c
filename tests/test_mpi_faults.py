"""Distributed runs never hang and fail loudly once: a raising rank, a hanging rank, a stuck launch.

Faults are injected with the test-only hook ``ZEROSIM_FAULT`` (see ``zerosim.comm.mpi``) into
tests/mpi_programs/comm_fault.py and into ``python -m zerosim.mpi simulate``. Every run is a real
``mpiexec``; bounds on elapsed time are generous (shared CI machines), but finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from zerosim.comm.base import DEFAULT_TIMEOUT_S
from zerosim.errors import EXIT_LAUNCH_TIMEOUT, EXIT_RUN_FAILED
from zerosim.mpi.launch import mpi_unavailable_reason, run_mpiexec

PROGRAMS = Path(__file__).parent / "mpi_programs"
REASON = mpi_unavailable_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(REASON is not None, reason=f"MPI unavailable: {REASON}")]
BOUND_S = 60.0  # every faulty run must end well within this (the default collective timeout is 60 s)


def failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " failed: " in line and line.startswith("rank ")]


def run_fault(fault: str, *args: str, ranks: int = 4) -> tuple[int, str, float]:
    result = run_mpiexec(ranks, [str(PROGRAMS / "comm_fault.py"), *args], timeout_s=BOUND_S + 30,
                         env={"ZEROSIM_FAULT": fault})
    assert not result.timed_out, f"the launch hung: {result.stderr}"
    return result.returncode, result.stderr, result.elapsed_s


@pytest.mark.parametrize("mode", ["abort", "raise"])
def test_a_rank_that_raises_mid_step_ends_every_rank_and_is_reported_once(mode: str) -> None:
    # collective #2 of rank 1 is the shard all_reduce of the first step: mid-step
    code, stderr, elapsed = run_fault("raise:rank=1:call=2", mode, str(DEFAULT_TIMEOUT_S))
    assert code == EXIT_RUN_FAILED
    lines = failure_lines(stderr)
    assert len(lines) == 1, stderr
    assert (
        lines[0].startswith("rank 1 failed: RuntimeError: injected fault")
        and "all_reduce on group shard[0]" in lines[0]
    )
    assert elapsed < BOUND_S  # the peers are killed by the abort, not by their 60 s timeout


@pytest.mark.parametrize("mode", ["abort", "raise"])
def test_a_hanging_rank_is_caught_by_the_timeout_naming_the_collective_and_the_rank(mode: str) -> None:
    timeout_s = 1.5
    # rank 1 never enters its collective #4: the world reduce_scatter of the second step
    code, stderr, elapsed = run_fault("hang:rank=1:call=4", mode, str(timeout_s))
    assert code == EXIT_RUN_FAILED
    lines = failure_lines(stderr)
    assert len(lines) == 1, stderr
    assert ("CollectiveTimeout: reduce_scatter on group world timed out after 1.5s; "
            "ranks that never arrived: [1]") in lines[0], lines[0]
    assert "rank 1: not in any collective" in lines[0]
    assert timeout_s <= elapsed < BOUND_S


def test_a_rank_hanging_before_the_first_collective_is_named() -> None:
    code, stderr, _ = run_fault("hang:rank=0:call=0", "abort", "1.0", ranks=3)
    assert code == EXIT_RUN_FAILED
    lines = failure_lines(stderr)
    assert len(lines) == 1 and "ranks that never arrived: [0]" in lines[0], stderr


def test_the_same_error_on_every_rank_is_printed_once() -> None:
    result = run_mpiexec(4, [str(PROGRAMS / "comm_fault.py"), "abort", "30", "all-raise"], timeout_s=BOUND_S)
    assert result.returncode == EXIT_RUN_FAILED
    lines = failure_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("rank 0 failed: NonFiniteGradientError: non-finite gradient on rank 0")


def test_a_run_without_faults_finishes() -> None:
    result = run_mpiexec(4, [str(PROGRAMS / "comm_fault.py"), "abort", "30"], timeout_s=BOUND_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "finished"
    assert failure_lines(result.stderr) == []


def test_the_launch_timeout_kills_mpiexec_and_every_rank() -> None:
    marker = f"zerosim-test-{uuid.uuid4().hex}"
    start = time.monotonic()
    # rank 2 hangs; the collective timeout (600 s) is far beyond the launch timeout (3 s)
    result = run_mpiexec(3, [str(PROGRAMS / "comm_fault.py"), "abort", "600", marker], timeout_s=3.0,
                         env={"ZEROSIM_FAULT": "hang:rank=2:call=0"})
    assert result.timed_out and result.returncode == EXIT_LAUNCH_TIMEOUT
    assert time.monotonic() - start < 20
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert [pid for pid in left if int(pid) != os.getpid()] == [], "ranks outlived the launch"


# ---- the simulate entry point: exit status on every rank, faults inside the engine -------------------

def simulate(ranks: int, *options: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    argv = ["-m", "zerosim.mpi", "simulate", "--model", "tiny", "--steps", "2", *options]
    result = run_mpiexec(ranks, argv, timeout_s=BOUND_S + 30, env=env)
    assert not result.timed_out, result.stderr
    return result.returncode, result.stdout, result.stderr


def test_a_failed_contract_exits_1_and_a_passing_run_0() -> None:
    code, stdout, _ = simulate(2, "--strategy", "zero2", "--json")
    assert code == 0 and json.loads(stdout)["passed"] is True  # one document: rank 0 alone renders
    code, stdout, _ = simulate(2, "--strategy", "zero2", "--fault", "sum-instead-of-avg", "--json")
    result = json.loads(stdout)
    assert code == 1 and result["passed"] is False and result["verdicts"]["C-ZERO-002"]["passed"] is False


def test_bad_input_is_one_line_and_exit_2_before_any_collective() -> None:
    code, _, stderr = simulate(3, "--strategy", "hybrid_shard:2")
    assert code == 2
    assert [line for line in stderr.splitlines() if line.strip()] == [
        "error: invalid strategy='hybrid_shard:2': the shard group size 2 does not divide world_size=3"]
    code, _, stderr = simulate(2, "--world-size", "4")
    assert code == 2 and stderr.count("error: invalid world_size=4: mpiexec started 2 rank(s)") == 1


def test_a_rank_raising_inside_the_engine_ends_the_run() -> None:
    code, stdout, stderr = simulate(4, "--strategy", "zero3", env={"ZEROSIM_FAULT": "raise:rank=2:call=9"})
    assert code == EXIT_RUN_FAILED
    lines = failure_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("rank 2 failed: RuntimeError: injected fault"), stderr
    assert "contracts" not in stdout


def test_a_rank_hanging_inside_the_engine_times_out() -> None:
    code, _, stderr = simulate(4, "--strategy", "hybrid_shard:2", "--timeout", "2",
                               env={"ZEROSIM_FAULT": "hang:rank=3:call=12"})
    assert code == EXIT_RUN_FAILED
    lines = failure_lines(stderr)
    assert (
        len(lines) == 1 and "CollectiveTimeout" in lines[0] and "ranks that never arrived: [3]" in lines[0]
    ), stderr


def test_zerosim_simulate_backend_mpi_launches_mpiexec(capfd: pytest.CaptureFixture[str]) -> None:
    from zerosim.cli import main

    assert main(["simulate", "--backend", "mpi", "--world-size", "2", "--strategy", "zero1", "--steps", "1",
                 "--json"]) == 0
    out = capfd.readouterr().out
    assert '"strategy": "shard_optimizer"' in out and '"world_size": 2' in out and '"passed": true' in out
    assert main(["simulate", "--backend", "mpi", "--world-size", "2", "--fault", "sum-instead-of-avg",
                 "--json"]) == 1
