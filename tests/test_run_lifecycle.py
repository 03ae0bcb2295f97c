"""The processes of a launch end with it, its output never passes through memory, and its failure line
says what happened.

Real launches (torchrun/gloo at world 2, mpiexec where the path is MPI's) of the trainers in
``tests/verify_trainers/lifecycle.py``: SIGTERM, SIGHUP and SIGINT sent to the real ``zerosim``
command end it with one line and 128 + the signal's number, and no process it started (ranks, the
children they started in sessions of their own) outlives it, nor does ``--out`` change after it
returned; a child that keeps a rank's stdout open does not keep the launch waiting, and a launch's
wall-clock limit holds whatever it started; a rank that leaves with ``os._exit(0)`` and a trainer
that destroys the process group are named for what they did; a rank printing 40 MiB leaves the
launching process's memory where it was and its log holds every byte. Every run has a generous
guard; no test asserts a duration except against the limit the launch itself was given.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerosim.mpi.launch import mpi_unavailable_reason
from zerosim.processes.launching import run_process_group, run_streamed

GUARD_S = 240  # a command that has not ended by then has hung
GONE_WITHIN_S = 5.0  # after the command returned, its processes are gone by then (SIGKILL is asynchronous)
VERIFY = ["--world", "2", "--optimizers", "sgd", "--steps", "4"]
TRAINERS = "tests.verify_trainers.lifecycle"
ROOT = Path(__file__).resolve().parents[1]


def _torch_reason() -> str | None:
    from zerogpu.launch import torch_unavailable_reason

    return torch_unavailable_reason()


needs_torch = pytest.mark.skipif(_torch_reason() is not None, reason=f"torch unavailable: {_torch_reason()}")
MPI_REASON = mpi_unavailable_reason()


def _alive(pid: int) -> bool:
    """Running (a zombie has ended; whoever its parent is reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _marked(mark: str) -> list[int]:
    """This user's running processes whose environment holds ``ZEROSIM_TEST_MARK=<mark>``."""
    needle = f"ZEROSIM_TEST_MARK={mark}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                environ = Path(f"/proc/{name}/environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0") and _alive(int(name)):
                out.append(int(name))
    return out


def _wait_until(condition, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _env(tmp_path: Path, mark: str, **extra: str) -> dict[str, str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
            "ZEROSIM_TEST_MARK": mark, **extra}


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- 1. a stop signal ends the command and everything it started -----------------------------------------


def _as_from_a_shell() -> None:
    """The stop signals as an interactive shell leaves them to a command it starts: default, unblocked
    (whatever this test process inherited or was left with; a command started with one ignored keeps
    ignoring it, as ``nohup`` asks)."""
    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in stops:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


def _stop_mid_run(argv: list[str], env: dict[str, str], ready, sig: int, mark: str):  # type: ignore[no-untyped-def]
    """Start ``zerosim *argv``, send ``sig`` once ``ready()``; (status, stderr lines)."""
    proc = subprocess.Popen([sys.executable, "-m", "zerosim", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_from_a_shell)
    try:
        assert _wait_until(lambda: ready() or proc.poll() is not None, GUARD_S), "the run never got going"
        assert proc.poll() is None, f"ended before the signal: {proc.stderr.read() if proc.stderr else ''}"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _marked(mark):  # never leave the machine littered, whatever the outcome
            os.kill(pid, signal.SIGKILL)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize(("sig", "status", "line"), [
    (signal.SIGTERM, 143, "terminated by SIGTERM"),
    (signal.SIGHUP, 129, "terminated by SIGHUP"),
    (signal.SIGINT, 130, "interrupted"),
], ids=["SIGTERM", "SIGHUP", "SIGINT"])
@pytest.mark.torchdist
@needs_torch
def test_a_stop_signal_ends_verify_its_ranks_and_their_children(tmp_path: Path, sig: int, status: int,
                                                                  line: str) -> None:
    pids, out = tmp_path / "pids", tmp_path / "out"
    pids.mkdir()
    mark = secrets.token_hex(8)
    env = _env(tmp_path, mark, ZEROSIM_TEST_PID_DIR=str(pids), ZEROSIM_TEST_STEP_DELAY_S="1")
    names = ("rank0.pid", "rank1.pid", "child0.pid", "child1.pid")
    code, lines = _stop_mid_run(["verify", f"{TRAINERS}:with_child", *VERIFY, "--out", str(out)], env,
                                lambda: all((pids / n).exists() for n in names), sig, mark)
    assert (code, lines) == (status, [line])
    started = {n: int((pids / n).read_text()) for n in names}
    assert _wait_until(lambda: not any(_alive(p) for p in started.values()), GONE_WITHIN_S), (
        f"still running after the command returned: {[n for n, p in started.items() if _alive(p)]}")
    assert _marked(mark) == []
    before = _snapshot(out)
    time.sleep(2.0)  # the ranks wrote into --out every second while they ran
    assert _snapshot(out) == before, "--out changed after the command returned"
    assert not (out / "report.json").exists()


@pytest.mark.mpi
@pytest.mark.skipif(MPI_REASON is not None, reason=f"MPI unavailable: {MPI_REASON}")
def test_sigterm_ends_simulate_under_mpiexec_with_every_rank(tmp_path: Path) -> None:
    mark = secrets.token_hex(8)
    # rank 1 stops at its 5th collective and the others wait for it for a minute: the run is mid-way
    env = _env(tmp_path, mark, ZEROSIM_FAULT="hang:rank=1:call=5")
    argv = ["simulate", "--backend", "mpi", "--world-size", "2", "--model", "tiny", "--steps", "2",
            "--strategy", "zero3", "--timeout", "60", "--json"]
    code, lines = _stop_mid_run(argv, env, lambda: len(_marked(mark)) >= 4, signal.SIGTERM, mark)
    assert (code, lines) == (143, ["terminated by SIGTERM"])
    assert _wait_until(lambda: _marked(mark) == [], GONE_WITHIN_S), f"left running: {_marked(mark)}"


# ---- 2. nothing a launch started keeps it waiting ----------------------------------------------------------

_ESCAPING_CHILD = (
    "import subprocess, sys, time; "
    "c = subprocess.Popen(['sleep', '100000'], start_new_session=True); "  # its own session, our stdout
    "open(sys.argv[1], 'w').write(str(c.pid)); print('started', flush=True); time.sleep(float(sys.argv[2]))"
)


@pytest.mark.parametrize("launch", ["process_group", "streamed"])
def test_a_child_in_its_own_session_holding_stdout_neither_hangs_nor_outlives_the_launch(
        tmp_path: Path, launch: str, capfd: pytest.CaptureFixture[str]) -> None:
    pidfile = tmp_path / "child.pid"
    command = [sys.executable, "-c", _ESCAPING_CHILD, str(pidfile), "0"]  # the launcher ends at once
    start = time.monotonic()
    if launch == "process_group":
        run = run_process_group(command, 60.0, dict(os.environ), kill_grace_s=1.0)
        assert (run.returncode, run.stdout) == (0, "started\n")
    else:
        streamed = run_streamed(command, 60.0, dict(os.environ), log_name="test", kill_grace_s=1.0)
        streamed.log_path.unlink()
        assert streamed.returncode == 0 and capfd.readouterr().out == "started\n"
    assert time.monotonic() - start < 30.0  # it waited neither for the child (100000 s) nor the limit (60 s)
    child = int(pidfile.read_text())
    assert _wait_until(lambda: not _alive(child), GONE_WITHIN_S), "the child outlived the launch"


def test_the_limit_holds_whatever_the_launcher_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    limit_s, grace_s = 3.0, 1.0
    command = [sys.executable, "-c", _ESCAPING_CHILD, str(pidfile), "100000"]  # the launcher never ends
    run = run_process_group(command, limit_s, dict(os.environ), kill_grace_s=grace_s)
    assert run.timed_out and run.returncode is None
    # the limit, then at most two grace periods for the group and two per round for the owned processes
    assert run.elapsed_s < limit_s + 12 * grace_s + 5.0
    child = int(pidfile.read_text())
    assert _wait_until(lambda: not _alive(child), GONE_WITHIN_S), "the child outlived the launch"


@pytest.mark.torchdist
@needs_torch
def test_verify_passes_and_ends_when_a_trainer_s_child_keeps_stdout_open(tmp_path: Path) -> None:
    pids, out = tmp_path / "pids", tmp_path / "out"
    pids.mkdir()
    mark = secrets.token_hex(8)
    env = _env(tmp_path, mark, ZEROSIM_TEST_PID_DIR=str(pids))
    try:
        proc = subprocess.run([sys.executable, "-m", "zerosim", "verify", f"{TRAINERS}:with_child", *VERIFY,
                               "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=GUARD_S)
    finally:
        for pid in _marked(mark):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, proc.stderr
    children = [int((pids / f"child{r}.pid").read_text()) for r in (0, 1)]
    assert _wait_until(lambda: not any(_alive(p) for p in children), GONE_WITHIN_S)
    assert json.loads((out / "report.json").read_text())["verdict"] == "pass"


# ---- 3. the failure line says what happened ------------------------------------------------------------


def _verify_failure(tmp_path: Path, factory: str) -> tuple[int, str, Path]:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "zerosim", "verify", f"{TRAINERS}:{factory}", *VERIFY,
                           "--out", str(out), "--timeout", "60"], cwd=ROOT, env=_env(tmp_path, "-"),
                          capture_output=True, text=True, timeout=GUARD_S)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    return proc.returncode, lines[0], out


@pytest.mark.torchdist
@needs_torch
def test_a_rank_that_exits_0_mid_run_is_named_for_it(tmp_path: Path) -> None:
    code, line, out = _verify_failure(tmp_path, "exits_mid_run")
    assert code == 3
    assert line.startswith("error: rank 1 failed: exited with status 0 mid-run without a message"), line
    assert "never reached" not in line
    assert f"rank output: {out / 'logs'}" in line
    assert (out / "logs" / "rank1.log").is_file()


@pytest.mark.torchdist
@needs_torch
def test_a_trainer_that_destroys_the_process_group_is_named_for_it(tmp_path: Path) -> None:
    code, line, _ = _verify_failure(tmp_path, "destroys_group")
    assert code == 3
    assert "failed: the trainer destroyed the process group" in line, line
    assert "waited ()" not in line


# ---- 4. a rank's output goes to its log, not through memory -----------------------------------------------

LOUD_BYTES = 40 * 1024 * 1024
_MEASURE = """
import json, resource, sys
import torch, zerogpu.launch, zerosim.cli  # imported before the baseline: their memory is not the run's
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
code = zerosim.cli.main(sys.argv[1:])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"code": code, "grew_kib": after - before}))
"""


@pytest.mark.torchdist
@needs_torch
def test_a_rank_printing_40_mib_leaves_the_launcher_s_memory_alone(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = _env(tmp_path, "-", ZEROSIM_TEST_LOUD_BYTES=str(LOUD_BYTES))
    proc = subprocess.run([sys.executable, "-c", _MEASURE, "verify", f"{TRAINERS}:loud", *VERIFY, "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=GUARD_S)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, proc.stderr
    # holding the output, even once as bytes, would raise the peak by LOUD_BYTES; half of it is the bound
    assert result["grew_kib"] * 1024 < LOUD_BYTES / 2, result
    assert (out / "logs" / "rank0.log").stat().st_size >= LOUD_BYTES


def _launch_result(rank_status: dict[int, int], exits: list[tuple[int, int]], stopped: tuple[int, ...] = (),
                   timed_out: bool = False):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    from zerogpu.spawn import RankExits

    return SimpleNamespace(returncode=3, launcher_returncode=None if timed_out else 1,
                           rank_status=rank_status, exits=RankExits(list(exits), set(stopped)), stderr="",
                           timed_out=timed_out)


def test_the_verdict_tells_a_rank_that_left_from_one_the_launcher_stopped(tmp_path: Path) -> None:
    from zerosim.verify.blame import blame_rank

    for r in (0, 1):
        (tmp_path / f"rank{r}.log").write_text("")
    reset = {"rank": 1, "reporter": 0, "kind": "peer",
             "message": "dropped its connection while rank 0 waited",
             "saw": "connection reset by peer during step 3", "last_in": {"1": "step 3 (sgd): step()"}}
    left = blame_rank(_launch_result({0: 3}, [(1, 0), (0, 3)]), 2, tmp_path, [reset], 60.0)
    assert left.rank == 1
    assert left.message.startswith("exited with status 0 mid-run without a message (it was last in step 3")
    assert "rank 0 then saw: connection reset by peer during step 3" in left.message
    # the same rank stopped by the launcher's SIGTERM after rank 0 failed did not leave on its own
    ended = _launch_result({0: 3}, [(0, 3), (1, -15)], stopped=(1,))
    stopped = blame_rank(ended, 2, tmp_path, [reset], 60.0)
    assert "mid-run" not in stopped.message and stopped.message.startswith("dropped its connection")
    # a rank that never started (no log) did not leave mid-run either
    (tmp_path / "rank1.log").unlink()
    assert "mid-run" not in blame_rank(_launch_result({0: 3}, [(1, 0), (0, 3)]), 2, tmp_path, [reset],
                                         60.0).message
    timed_out = blame_rank(_launch_result({}, [], timed_out=True), 2, tmp_path, [], 60.0)
    assert (timed_out.rank, timed_out.message.split(";")[0]) == (-1, "the run did not finish within 60s")
