"""Launches whose zygote a warm fork server forked (:mod:`zerogpu.fork_server`) behave as launches that
start the zygote as an interpreter of its own: the same output, statuses, sessions and environment;
a launcher killed by SIGKILL takes every rank and every rank's child with it; a launch whose import
environment differs, or whose server is gone, starts its zygote itself.

One server for the module; the rank programs are tiny ``python -c`` programs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_probes import alive, kill_and_expect_ranks_gone, sleeping_launch
from zerosim.launching import run_process_group

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux only")

from zerogpu import fork_server_process  # noqa: E402
from zerogpu.fork_protocol import LaunchRequest  # noqa: E402
from zerogpu.fork_server import (  # noqa: E402
    FORK_SERVER_ENV,
    ForkServer,
    ServedZygote,
    request_zygote,
    start_fork_server,
)
from zerogpu.fork_server_process import import_environment, refusal  # noqa: E402
from zerogpu.spawn import RANK_START_ENV, RankSpawn  # noqa: E402

GUARD_S = 120.0  # every launch here ends in seconds; reaching this is the failure (a hang)
_WHAT_A_RANK_SEES = """import os, sys
environ = open('/proc/self/environ', 'rb').read().split(b'\\0')
print(os.environ['RANK'], __name__, sys.argv[1:], repr(sys.path[0]), os.getpid() == os.getpgid(0),
      os.getcwd() == os.environ['EXPECT_CWD'], os.environ['WORLD_SIZE'], os.environ['MARK'],
      b'MARK=' + os.environ['MARK'].encode() in environ,
      any(e.startswith(b'ZEROSIM_OWNER_TOKENS=zerosim-') for e in environ))
if os.environ['RANK'] == '1':
    raise ValueError('rank 1 fails')
"""


_alive = alive


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    started = start_fork_server({"OMP_NUM_THREADS": "1", **os.environ})
    try:
        assert started.ready(GUARD_S), "the fork server never listened"
        yield started
    finally:
        started.stop()
    assert started.proc.returncode == 0


def _env(server: ForkServer, **extra: str) -> dict[str, str]:
    return {"OMP_NUM_THREADS": "1", **os.environ, FORK_SERVER_ENV: server.address, **extra}


def test_a_served_launch_matches_an_exec_d_one(server: ForkServer, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """Output, ``__main__``, argv, ``sys.path[0]``, session, folder, environment (also as /proc shows
    it), the failing rank's status and the report: the same with the server as without it."""
    monkeypatch.chdir(tmp_path)
    seen = {}
    for how in ("served", "exec'd"):
        address = server.address if how == "served" else "off"
        spawn = RankSpawn(2, ["-c", _WHAT_A_RANK_SEES, "a", "b"])
        env = _env(server, MARK=how.replace("'", ""), EXPECT_CWD=str(tmp_path), **{FORK_SERVER_ENV: address})
        run = run_process_group(spawn, GUARD_S, env, kill_grace_s=2.0)
        assert isinstance(spawn._zygote, ServedZygote) == (how == "served")
        assert run.returncode == 1 and spawn.exits.first_failure() == (1, 1), run.stderr
        assert "ValueError: rank 1 fails" in (run.stderr or "")
        assert "  rank 1: exited with status 1\n" in (run.stderr or "")
        lines = (run.stdout or "").splitlines()
        seen[how] = sorted(line.replace(how.replace("'", ""), "M") for line in lines)
    expected = [f"{r} __main__ ['a', 'b'] '' True True 2 M True True" for r in (0, 1)]
    assert seen["served"] == seen["exec'd"] == expected


_WARNS = ("import sys, warnings; warnings.warn('rank warning ' + __import__('os').environ['RANK']); "
          "print(sys.warnoptions, flush=True)")


def test_a_launch_that_silences_warnings_is_served_and_its_ranks_warn_as_exec_d_ones_do(
        server: ForkServer) -> None:
    """``$PYTHONWARNINGS`` is the launch's own (the server runs without it): a served rank has the
    filters and ``sys.warnoptions`` an exec'd one has, with the option and without it."""
    seen = {}
    for option in ("ignore", ""):
        for how in ("served", "exec'd"):
            address = server.address if how == "served" else "off"
            spawn = RankSpawn(2, ["-c", _WARNS])
            env = _env(server, **{FORK_SERVER_ENV: address, "PYTHONWARNINGS": option})
            run = run_process_group(spawn, GUARD_S, env, kill_grace_s=2.0)
            assert isinstance(spawn._zygote, ServedZygote) == (how == "served")
            assert run.returncode == 0, run.stderr
            seen[option, how] = (run.stdout, sorted(line for line in (run.stderr or "").splitlines()
                                                    if "rank warning" in line))
        assert seen[option, "served"] == seen[option, "exec'd"], seen
    assert seen["ignore", "served"] == ("['ignore']\n['ignore']\n", [])
    assert len(seen["", "served"][1]) == 2  # both ranks' warnings shown without the option


def test_a_launcher_killed_by_sigkill_takes_every_served_rank_with_it(server: ForkServer,
                                                                     tmp_path: Path) -> None:
    """No handler runs on SIGKILL: the server sees the launcher's connection close and ends the
    zygote's session (SIGTERM, passed on to every rank's session)."""
    with sleeping_launch(tmp_path, _env(server), GUARD_S) as (launcher, pids):
        # each rank's parent (field 4 of /proc/PID/stat) is a child of the server
        zygotes = {int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) for p in pids}
        served = Path(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read_text().split()
        assert zygotes <= {int(s) for s in served}, "the launch did not use the server"
        kill_and_expect_ranks_gone(launcher, pids, 15)


def test_a_rank_s_child_in_its_own_session_ends_with_the_launch(server: ForkServer, tmp_path: Path) -> None:
    """The launch's end finds a served rank's child by the owner token (/proc shows the launch's
    environment in a served rank and in what it forks or starts)."""
    program = ("import os, subprocess, sys, time; c = subprocess.Popen("
               "[sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
               f"open(os.path.join({str(tmp_path)!r}, os.environ['RANK']), 'w').write(str(c.pid))")
    spawn = RankSpawn(2, ["-c", program])
    run = run_process_group(spawn, GUARD_S, _env(server))
    assert isinstance(spawn._zygote, ServedZygote)
    assert run.returncode == 0
    children = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    deadline = time.monotonic() + 5
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(c) for c in children), "a rank's child outlived the launch"


def test_an_import_environment_that_differs_falls_back_to_an_exec_d_zygote(server: ForkServer) -> None:
    spawn = RankSpawn(2, ["-c", "import os; print(os.environ['OMP_NUM_THREADS'])"])
    run = run_process_group(spawn, GUARD_S, _env(server, OMP_NUM_THREADS="3"))
    assert not isinstance(spawn._zygote, ServedZygote)
    assert run.returncode == 0 and (run.stdout or "").split() == ["3", "3"]


def test_a_dead_server_falls_back_to_an_exec_d_zygote(tmp_path: Path) -> None:
    spawn = RankSpawn(2, ["-c", "pass"])
    run = run_process_group(spawn, GUARD_S, {**os.environ, FORK_SERVER_ENV: str(tmp_path / "gone")})
    assert not isinstance(spawn._zygote, ServedZygote)
    assert run.returncode == 0 and spawn.exits.status() == {0: 0, 1: 0}


def test_exec_ranks_never_use_the_server(server: ForkServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RANK_START_ENV, "exec")
    spawn = RankSpawn(1, ["-c", "pass"])
    assert run_process_group(spawn, GUARD_S, _env(server)).returncode == 0
    assert spawn._zygote is None and not spawn.forked


def test_a_closed_connection_ends_the_served_zygote_and_its_session(server: ForkServer) -> None:
    read_end, write_end = os.pipe()
    zygote = request_zygote(server.address, ["1", "--", "-c", "import time; time.sleep(60)"],
                            _env(server), (0, 1, 2, write_end))
    os.close(write_end)
    assert zygote is not None
    with os.fdopen(read_end) as report:
        lines = iter(report.readline, "")
        rank_pid = int(next(line for line in lines if line.startswith("fork ")).split()[2])  # "fork 0 PID"
        assert _alive(rank_pid) and os.getpgid(rank_pid) == rank_pid
        assert zygote.conn is not None
        zygote.conn.close()  # what a launcher killed by SIGKILL leaves
        deadline = time.monotonic() + 10
        while (_alive(rank_pid) or _alive(zygote.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not _alive(rank_pid) and not _alive(zygote.pid)


def test_refusal_names_what_would_differ(tmp_path: Path) -> None:
    """The rule (no launch): another python, an import variable, a module the folder would shadow."""
    env = dict(os.environ)
    request = LaunchRequest(("1", "--", "-c", "pass"), 1, env, str(tmp_path), sys.executable)

    def changed(**fields: object) -> LaunchRequest:
        return dataclasses.replace(request, **fields)  # type: ignore[arg-type]

    saved = dict(fork_server_process._BASE_ENV)
    fork_server_process._BASE_ENV.clear()
    fork_server_process._BASE_ENV.update(env)
    try:
        assert refusal(request) is None
        assert refusal(changed(python="/usr/bin/python3-other")) == (
            f"python /usr/bin/python3-other is not {sys.executable}")
        assert refusal(changed(env={**env, "MKL_NUM_THREADS": "9"})) == "$MKL_NUM_THREADS differs"
        assert refusal(changed(env={**env, "ZEROSIM_FAULT": "x", "TMPDIR": "/x"})) is None
        # set by DeepSpeed's import in a process that made it, read by torch only where CUDA is asked for
        assert refusal(changed(env={**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"})) is None
        (tmp_path / "torch.py").write_text("")
        assert refusal(request) == f"{tmp_path / 'torch.py'} shadows the imported torch"
    finally:
        fork_server_process._BASE_ENV.clear()
        fork_server_process._BASE_ENV.update(saved)
    assert set(import_environment({"PYTHONPATH": "x", "TORCHELASTIC_USE_AGENT_STORE": "True",
                                   "TORCH_HOME": "/t", "LD_PRELOAD": "y", "PATH": "/bin"})) == {"TORCH_HOME",
                                                                                                "LD_PRELOAD"}
