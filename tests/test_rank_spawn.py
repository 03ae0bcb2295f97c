"""Ranks started without torchrun (:mod:`zerogpu.spawn`): torchrun's environment, a store no other
launch can race for, a failing rank that ends the others, and ranks that end with their launcher.

Most ranks here are tiny ``python -c`` programs that never import torch, so each launch takes a
fraction of a second; one test starts a real ``torchrun`` to compare environments.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

from tests.launch_probes import alive, kill_and_expect_ranks_gone, sleeping_launch
from zerogpu.launch import torch_unavailable_reason
from zerosim.processes.launching import run_process_group
from zerosim.processes.owned_processes import new_owner_token

TORCH_REASON = torch_unavailable_reason()
pytestmark = pytest.mark.skipif(TORCH_REASON is not None, reason=f"torch unavailable: {TORCH_REASON}")

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 120.0  # every launch here ends in seconds; reaching this is the failure (a hang)
_ENV_PROGRAM = """import json, os, sys
with open(os.path.join(sys.argv[1], "env-" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump(dict(os.environ), f)
"""


_alive = alive


@pytest.mark.torchdist
def test_each_rank_gets_the_environment_torchrun_gives_its_workers(tmp_path: Path) -> None:
    from zerogpu.spawn import RankSpawn

    program = tmp_path / "env_program.py"
    program.write_text(_ENV_PROGRAM)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    theirs_dir, ours_dir = tmp_path / "torchrun", tmp_path / "spawn"
    theirs_dir.mkdir()
    ours_dir.mkdir()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(program), str(theirs_dir)]
    assert run_process_group(torchrun, GUARD_S, env).returncode == 0
    spawn = RankSpawn(2, [str(program), str(ours_dir)])
    assert run_process_group(spawn, GUARD_S, env).returncode == 0
    ports = set()
    for rank in (0, 1):
        theirs = json.loads((theirs_dir / f"env-{rank}.json").read_text())
        ours = json.loads((ours_dir / f"env-{rank}.json").read_text())
        # what torchrun adds for its workers; its elastic bookkeeping (run id, error file, restarts)
        # serves its agent, not the ranks, and the store's address is each launch's own
        added = {k for k in set(theirs) - set(env) if k != "_"}
        own = ("MASTER_ADDR", "MASTER_PORT", "ZEROSIM_OWNER_TOKENS")  # each launch's own
        same = {k for k in added if not k.startswith("TORCHELASTIC_") and k not in own}
        assert same >= {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK"}
        assert {k: ours.get(k) for k in same} == {k: theirs[k] for k in same}
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == theirs["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert ours["OMP_NUM_THREADS"] == "1"
        ports.add(int(ours["MASTER_PORT"]))
    assert len(ports) == 1 and 0 < ports.pop() < 65536


def test_the_store_listens_on_its_port_before_any_rank_starts_and_launches_never_share_one() -> None:
    from zerogpu.spawn import RankSpawn

    sleeper = ["-c", "import time; time.sleep(30)"]
    launches = [RankSpawn(2, sleeper) for _ in range(3)]
    token = new_owner_token()
    with tempfile.TemporaryFile() as out:
        try:
            for launch in launches:
                launch.start(dict(os.environ), token, out, out)
            ports = [launch.port for launch in launches]
            assert len(set(ports)) == len(ports), ports  # each launch holds its own port
            for port in ports:
                with socket.socket() as s:  # nobody else can take it while the launch runs
                    with pytest.raises(OSError) as taken:
                        s.bind(("127.0.0.1", port))
                    assert taken.value.errno == errno.EADDRINUSE
                from torch.distributed import TCPStore

                client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=GUARD_S))
                client.set("probe", str(port))  # and the job's store serves on it
                assert client.get("probe") == str(port).encode()
        finally:
            for launch in launches:
                launch.end(token, 2.0)
    assert all(code == -signal.SIGTERM for launch in launches for _, code in launch.exits.order)


def test_a_failing_rank_stops_the_others_and_the_launch_says_how_each_ended() -> None:
    from zerogpu.spawn import RankSpawn

    program = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(5)\ntime.sleep(60)"
    spawn = RankSpawn(3, ["-c", program])
    run = run_process_group(spawn, GUARD_S, dict(os.environ), kill_grace_s=2.0)
    assert run.returncode == 1 and not run.timed_out
    assert spawn.exits.first_failure() == (1, 5)
    assert spawn.exits.stopped == {0, 2}
    assert sorted(spawn.exits.status().items()) == [(0, -signal.SIGTERM), (1, 5), (2, -signal.SIGTERM)]
    assert run.elapsed_s < 30  # not the 60 s the others would have slept
    report = (run.stderr or "").splitlines()
    assert report[-3:] == ["  rank 1: exited with status 5",
                           "  rank 0: killed by signal 15 (SIGTERM) (stopped by the launcher)",
                           "  rank 2: killed by signal 15 (SIGTERM) (stopped by the launcher)"], run.stderr


def test_ranks_that_all_exit_0_end_the_launch_with_0_and_no_report() -> None:
    from zerogpu.spawn import RankSpawn

    spawn = RankSpawn(2, ["-c", "print('rank', __import__('os').environ['RANK'])"])
    run = run_process_group(spawn, GUARD_S, dict(os.environ))
    assert run.returncode == 0 and sorted(spawn.exits.status().items()) == [(0, 0), (1, 0)]
    assert sorted((run.stdout or "").split("\n")[:2]) == ["rank 0", "rank 1"]
    assert "ranks ended" not in (run.stderr or "")


@pytest.mark.torchdist
def test_ranks_end_when_their_launcher_is_killed_by_sigkill(tmp_path: Path) -> None:
    """No handler runs on SIGKILL: each rank asked the kernel for SIGTERM when its launcher dies (the
    launch's own forking process, not a fork server's: that path is tests/test_fork_server.py's)."""
    with sleeping_launch(tmp_path, {**os.environ, "ZEROGPU_FORK_SERVER": "off"}, GUARD_S) as (launcher, pids):
        kill_and_expect_ranks_gone(launcher, pids, 30)  # two hops: launcher -> zygote -> ranks


_WHAT_A_RANK_SEES = """import os, sys, time
print(os.environ['RANK'], __name__, sys.argv[2:], repr(sys.path[0]), os.getpid() == os.getpgid(0))
done = os.path.join(sys.argv[1], 'rank0-done')
if os.environ['RANK'] == '0':
    open(done, 'w').close()
else:
    while not os.path.exists(done):  # rank 0 has printed before rank 1 fails (and it is stopped)
        time.sleep(0.05)
    raise ValueError('rank 1 fails')
"""


def test_a_forked_rank_sees_what_an_interpreter_of_its_own_sees(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """The ranks forked from one warm process (the default on Linux) and ranks started as interpreters
    of their own (``ZEROGPU_RANK_START=exec``): same output, same session, same failure and status."""
    from zerogpu.spawn import RANK_START_ENV, RankSpawn

    seen = {}
    for mode in ("fork", "exec"):
        monkeypatch.setenv(RANK_START_ENV, mode)
        (tmp_path / mode).mkdir()
        spawn = RankSpawn(2, ["-c", _WHAT_A_RANK_SEES, str(tmp_path / mode), "a", "b"])
        assert spawn.forked == (mode == "fork")
        run = run_process_group(spawn, GUARD_S, dict(os.environ), kill_grace_s=2.0)
        assert run.returncode == 1 and spawn.exits.first_failure() == (1, 1), run.stderr
        assert "ValueError: rank 1 fails" in (run.stderr or "")
        seen[mode] = sorted((run.stdout or "").splitlines())
    assert seen["fork"] == seen["exec"] == ["0 __main__ ['a', 'b'] '' True", "1 __main__ ['a', 'b'] '' True"]


_TORCH_FREE_LAUNCHER = """import sys
from zerogpu.launch import run_ranks
rank = '''import os, sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                 timeout=timedelta(seconds=60))
store.add('ranks', 1)
give_up = time.monotonic() + 60
while int(store.add('ranks', 0)) < 2 and time.monotonic() < give_up:
    time.sleep(0.02)
sys.stdout.write(f"met {int(store.add('ranks', 0))}\\\\n")  # one write: the two ranks share a pipe'''
result = run_ranks(2, ["-c", rank], 120.0)
print(result.returncode, sorted((result.stdout or '').split()), 'torch' in sys.modules)
"""


def test_a_forked_launch_imports_no_torch_in_its_launcher_and_its_ranks_meet_on_the_store() -> None:
    """The forking process holds the job's store: the launcher never imports torch, and the ranks'
    clients reach the store it opened (each adds itself to a counter there)."""
    from zerogpu.spawn import RANK_START_ENV

    env = {k: v for k, v in os.environ.items() if k != RANK_START_ENV}
    done = subprocess.run([sys.executable, "-c", _TORCH_FREE_LAUNCHER], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "0 ['2', '2', 'met', 'met'] False", done.stdout


def test_a_torch_without_distributed_is_bad_input_said_by_the_forking_process(tmp_path: Path) -> None:
    """The launcher of forked ranks only looks for torch; the forking process imports it and reports a
    torch.distributed that is not built, which ends the launch as before any rank starts: exit 2, one
    line naming the backend, no rank forked."""
    from zerogpu.spawn import RANK_START_ENV

    fake = tmp_path / "torch" / "distributed"
    fake.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("def is_available():\n    return False\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    env.pop(RANK_START_ENV, None)
    done = subprocess.run([sys.executable, "-m", "zerosim", "verify", "ddp", "--world", "2"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=GUARD_S)
    assert done.returncode == 2, done.stderr
    assert "this torch build has no torch.distributed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "ranks ended" not in done.stderr, done.stderr
