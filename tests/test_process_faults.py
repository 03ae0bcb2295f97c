"""Process faults on every backend end the run with exit 3 and one zerosim line naming the rank.

``zerosim simulate`` runs as the user runs it (a subprocess), on the in-process simulator, under
``mpiexec`` and under ``torchrun``, with one fault injected through ``ZEROSIM_FAULT``
(zerosim/comm/fault_plan.py): a NaN or an Inf in one rank's gradient, a rank that raises, a rank
that never arrives at a collective (caught by a short ``--timeout``), a rank whose process is killed
by SIGKILL (MPI and torch). Each run must end with exit 3, print nothing on stdout (no verdict table,
no JSON), leave no file in its working directory, and show the user exactly one line on stderr: the
launcher's own noise goes to a log file named in that line. A closed stdout ends every backend's run
quietly with exit 141.

Launches are real and take seconds each (torchrun the most); every run has a generous wall-clock guard
and no test asserts a duration.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from zerosim.comm.fault_plan import FaultCounter, FaultPlan
from zerosim.engine.config import NanInjection, RunConfig
from zerosim.errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE, EXIT_RUN_FAILED, ConfigError
from zerosim.mpi.launch import diagnose_mpich_death, is_mpich_banner, mpi_unavailable_reason

GUARD_S = 150  # a launch that has not ended by then has hung
MPI_REASON = mpi_unavailable_reason()


def _torch_reason() -> str | None:
    try:
        from zerogpu.launch import torch_unavailable_reason
    except ImportError as e:
        return str(e)
    return torch_unavailable_reason()


TORCH_REASON = _torch_reason()
BACKENDS = [
    pytest.param("sim", id="sim"),
    pytest.param("mpi", id="mpi", marks=[pytest.mark.mpi, pytest.mark.slow, pytest.mark.skipif(
        MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")]),
    pytest.param("torch", id="torch", marks=[pytest.mark.torchdist, pytest.mark.slow, pytest.mark.skipif(
        TORCH_REASON is not None, reason=f"torch unavailable: {TORCH_REASON}")]),
]
PROCESS_BACKENDS = BACKENDS[1:]

#: fault -> (ZEROSIM_FAULT, extra options, what the one line must say)
FAULTS = {
    "nan": ("nan:rank=1:step=0", (), "non-finite gradient on rank 1, tensor 'embedding.weight' at step 0"),
    "inf": ("inf:rank=1:step=1:tensor=blocks.0.mlp.w_in", (),
            "non-finite gradient on rank 1, tensor 'blocks.0.mlp.w_in' at step 1"),
    "raise": ("raise:rank=1:call=3", (), "rank 1 failed: RuntimeError: injected fault ZEROSIM_FAULT=raise"),
    "stall": ("hang:rank=1:call=5", ("--timeout", "2"), "timed out after 2s; ranks that never arrived: [1]"),
}


def zerosim_simulate(backend: str, tmp_path: Path, fault: str | None, *options: str,
                     stdout: int | None = subprocess.PIPE) -> tuple[int, str, list[str]]:
    """Run ``zerosim simulate`` as a user does; (exit status, stdout, the non-empty stderr lines).
    Works in an empty folder (asserted to stay empty); launch logs go to ``tmp_path/tmp``."""
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("ZEROSIM_FAULT", None)
    if fault is not None:
        env["ZEROSIM_FAULT"] = fault
    argv = [sys.executable, "-m", "zerosim", "simulate", "--backend", backend, "--world-size", "2",
            "--model", "tiny", "--steps", "2", "--strategy", "zero3", "--json", *options]
    proc = subprocess.run(argv, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=GUARD_S)
    assert list(cwd.iterdir()) == [], "the run wrote files into its working folder"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, proc.stdout or "", lines


def assert_one_line_naming(backend: str, lines: list[str], expected: str) -> str:
    assert len(lines) == 1, "\n".join(lines)
    line = lines[0]
    assert expected in line, line
    assert "Traceback" not in line and "ChildFailedError" not in line and "BAD TERMINATION" not in line
    if backend == "sim":
        assert line.startswith("error: "), line
    else:  # the ranks' line, with the launcher's log named at its end
        assert line.startswith("rank "), line
        log = re.search(r" output: (\S+\.log)\)$", line)
        assert log is not None and Path(log.group(1)).is_file(), line
    return line


# ---- (a)-(d) on every backend -----------------------------------------------------------------------

@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fault_on_one_rank_ends_the_run_with_exit_3_and_one_line_naming_the_rank(
        backend: str, fault: str, tmp_path: Path) -> None:
    description, options, expected = FAULTS[fault]
    code, stdout, lines = zerosim_simulate(backend, tmp_path, description, *options)
    assert code == EXIT_RUN_FAILED, lines
    assert stdout == ""  # no verdicts, no JSON: the run never finished
    assert_one_line_naming(backend, lines, expected)


# ---- a rank killed by a signal --------------------------------------------------------------------

@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_a_rank_killed_by_sigkill_is_named_in_one_line_with_exit_3(backend: str, tmp_path: Path) -> None:
    code, stdout, lines = zerosim_simulate(backend, tmp_path, "kill:rank=1:call=4")
    assert code == EXIT_RUN_FAILED, lines
    assert stdout == ""
    line = assert_one_line_naming(backend, lines, "rank 1 failed: killed by signal 9 (SIGKILL)")
    log = Path(re.search(r" output: (\S+\.log)\)$", line).group(1))  # type: ignore[union-attr]
    assert log.read_text().strip(), "the launcher's own report is kept in the log"


def test_the_simulator_refuses_a_kill_fault_as_bad_input(tmp_path: Path) -> None:
    code, stdout, lines = zerosim_simulate("sim", tmp_path, "kill:rank=1:call=4")
    assert code == EXIT_BAD_INPUT and stdout == ""
    assert len(lines) == 1 and lines[0].startswith("error: invalid ZEROSIM_FAULT='kill:rank=1:call=4'"), lines


# ---- a closed stdout ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", PROCESS_BACKENDS)
def test_a_closed_stdout_ends_the_run_quietly_with_exit_141(backend: str, tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (``| head -1``) has gone before the first write
    try:
        code, _, lines = zerosim_simulate(backend, tmp_path, None, "--steps", "1", stdout=write_end)
    finally:
        os.close(write_end)
    assert code == EXIT_BROKEN_PIPE
    assert lines == []
    assert list((tmp_path / "tmp").glob("*.log")) == []  # nothing went wrong: no log left behind


# ---- the description language and the launchers' diagnoses (no launch) ----------------------------

def test_one_description_language_for_every_fault() -> None:
    assert FaultPlan.from_env("raise:rank=1:call=3") == FaultPlan("raise", 1, call=3)
    assert FaultPlan.from_env("kill:rank=0:call=0").is_collective
    plan = FaultPlan.from_env("-inf:rank=2:step=1:micro=1:tensor=blocks.0.mlp.w_in")
    assert plan == FaultPlan("-inf", 2, step=1, micro=1, tensor="blocks.0.mlp.w_in")
    assert not plan.is_collective
    assert FaultPlan.from_env(plan.text) == plan
    assert FaultPlan.from_env("") is None
    for bad in ("explode:rank=1", "raise:rank=x", "raise:step=1", "nan:rank=1:call=2", "hang:rank=-1"):
        with pytest.raises(ConfigError, match="ZEROSIM_FAULT"):
            FaultPlan.from_env(bad)


def test_gradient_faults_are_not_fired_by_the_communicators() -> None:
    counter = FaultCounter(FaultPlan.from_env("nan:rank=0:step=0"), 0)
    assert counter.plan is None
    counter.tick("all_reduce", "world")  # nothing happens
    counter = FaultCounter(FaultPlan.from_env("raise:rank=0:call=1"), 0)
    counter.tick("all_reduce", "world")  # collective #0: not yet
    with pytest.raises(RuntimeError, match="injected fault .* before all_gather on group world"):
        counter.tick("all_gather", "world")
    assert FaultCounter(FaultPlan.from_env("raise:rank=0:call=0"), 1).plan is None  # another rank's


def test_an_inf_injection_is_configured_by_value_or_by_zerosim_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    run = RunConfig(world_size=2, steps=2, inject_nan={"rank": 1, "step": 1, "tensor": "lm_head.weight",
                                                        "value": "inf"}).resolve()
    assert run.inject_nan == NanInjection(1, 1, "lm_head.weight", 0, "inf")
    default = RunConfig(world_size=2, inject_nan=NanInjection(0, 0, "lm_head.weight")).resolve().inject_nan
    assert default is not None and default.value == "nan"  # existing users: a NaN, as before
    with pytest.raises(ConfigError, match="inject_nan.value"):
        RunConfig(world_size=2, inject_nan={"rank": 0, "step": 0, "tensor": "lm_head.weight",
                                            "value": "1e9"}).resolve()
    monkeypatch.setenv("ZEROSIM_FAULT", "-inf:rank=1:step=0")
    assert RunConfig(world_size=2).resolve().inject_nan == NanInjection(1, 0, "embedding.weight", 0, "-inf")
    with pytest.raises(ConfigError, match="ZEROSIM_FAULT.rank"):
        RunConfig(world_size=1).resolve()
    with pytest.raises(ConfigError, match="inject_nan is set too"):
        RunConfig(world_size=2, inject_nan={"rank": 0, "step": 0, "tensor": "lm_head.weight"}).resolve()


MPICH_BANNER = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 4242 RUNNING AT host
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
"""


def test_mpich_s_banner_names_the_rank_by_its_process_id() -> None:
    assert is_mpich_banner(MPICH_BANNER.splitlines()[1] + "\n") and not is_mpich_banner("a = b\n")
    killed = diagnose_mpich_death(MPICH_BANNER, {4241: 0, 4242: 1})
    assert killed == "rank 1 failed: killed by signal 9 (SIGKILL)"
    exited = MPICH_BANNER.replace("Killed (signal 9)", "exit").replace("CODE: 9", "CODE: 5")
    assert diagnose_mpich_death(exited, {4242: 1}) == "rank 1 failed: exited with status 5 without a message"
    assert diagnose_mpich_death(exited, {4242: 1}, said_why=True) is None
    assert diagnose_mpich_death("Abort(3) on node 1", {4242: 1}) is None


@pytest.mark.skipif(TORCH_REASON is not None, reason=f"torch unavailable: {TORCH_REASON}")
def test_the_rank_that_died_first_is_named_from_how_each_rank_ended() -> None:
    from zerogpu.spawn import RankExits, diagnose_rank_death

    # rank 1 killed by SIGKILL first, rank 0 then stopped by the launcher
    killed = RankExits([(1, -9), (0, -15)], {0})
    assert diagnose_rank_death(killed) == "rank 1 failed: killed by signal 9 (SIGKILL)"
    # rank 0 noticed first (status 3), but rank 1 had been killed by a signal nobody here sent
    peer_first = RankExits([(0, 3), (1, -9)], set())
    assert diagnose_rank_death(peer_first, said_why=True) == "rank 1 failed: killed by signal 9 (SIGKILL)"
    # rank 1 raised (status 3); the SIGTERM that ended rank 0 was the launcher's own
    raised = RankExits([(1, 3), (0, -15)], {0})
    assert diagnose_rank_death(raised, said_why=True) is None
    assert diagnose_rank_death(raised) == "rank 1 failed: exited with status 3 without a message"
    # a SIGTERM the launcher did not send is a death like any other
    assert diagnose_rank_death(RankExits([(0, 3), (1, -15)], set()), said_why=True) == (
        "rank 1 failed: killed by signal 15 (SIGTERM)")
