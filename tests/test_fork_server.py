"""Launches whose zygote a warm fork server forked (:mod:`zerogpu.fork_server`) behave as launches that
start the zygote as an interpreter of its own: the same output, statuses, sessions and environment;
a launcher killed by SIGKILL takes every rank and every rank's child with it; a launch whose import
environment differs, or whose server is gone, starts its zygote itself.

One server for the module; the rank programs are tiny ``python -c`` programs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.launch_probes import alive, kill_and_expect_ranks_gone, sleeping_launch
from zerosim.processes.launching import run_process_group

pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork server: Linux only")

from zerogpu import fork_server_process  # noqa: E402
from zerogpu.fork_protocol import (  # noqa: E402
    COMMIT_S,
    GRACE_S,
    REQUEST_READ_S,
    RUN,
    LaunchRequest,
    encode_request,
)
from zerogpu.fork_server import (  # noqa: E402
    FORK_SERVER_ENV,
    ForkServer,
    ServedZygote,
    request_zygote,
    start_fork_server,
)
from zerogpu.fork_server_process import PARENT_POLL_S, import_environment, refusal  # noqa: E402
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


# ---- the server as untrusted input meets it ------------------------------------------------------

def _descriptors() -> list[int]:
    """Four descriptors to send with a request (the launch's stdin, stdout, stderr, report pipe)."""
    return [os.open(os.devnull, os.O_RDWR) for _ in range(4)]


def _connect(address: str, timeout_s: float = GUARD_S) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout_s)
    conn.connect(address)
    return conn


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode()


def _send_raw(address: str, body: bytes, length: int | None = None) -> str:
    """Send ``body`` as a request (``length`` in its header, default its own); the server's answer."""
    fds = _descriptors()
    try:
        with _connect(address) as conn:
            socket.send_fds(conn, [struct.pack("!I", len(body) if length is None else length)], fds)
            try:
                conn.sendall(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server may refuse on the header alone and close before the body arrives
            return _line(conn)
    finally:
        for fd in fds:
            os.close(fd)


def _request(tmp_path: Path, **fields: object) -> bytes:
    base: dict[str, object] = {"argv": ["1", "--", "-c", "pass"], "env": dict(os.environ),
                               "cwd": str(tmp_path), "python": sys.executable}
    return json.dumps({**base, **fields}).encode()


def _served_once(server: ForkServer) -> None:
    """The server still serves: a launch through it runs and exits 0."""
    spawn = RankSpawn(1, ["-c", "pass"])
    assert run_process_group(spawn, GUARD_S, _env(server)).returncode == 0
    assert isinstance(spawn._zygote, ServedZygote)


@pytest.mark.parametrize(("body", "length", "named"), [
    (b"\xff\xfe not json", None, "not JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
    (b"[" * 100_000, None, "not JSON"),  # nested past the parser's recursion limit
    ("env_list", None, "env must be an object"),
    ("env_value", None, "env['A'] must be a string"),
    ("nul", None, "holds a NUL"),
    ("argv_short", None, "argv must be a list"),
    ("world_zero", None, "argv[0]='0'"),
    ("world_huge", None, "argv[0]="),
    ("cwd_relative", None, "cwd='relative'"),
    ("no_python", None, "has no python"),
    (b"{}", 1 << 30, "over"),  # a header announcing a gigabyte: refused before any of it is read
])
def test_a_malformed_request_is_refused_naming_the_field_and_the_server_serves_on(
        server: ForkServer, tmp_path: Path, body: bytes | str, length: int | None, named: str) -> None:
    bodies = {
        "env_list": _request(tmp_path, env=["A=1"]),
        "env_value": _request(tmp_path, env={"A": 1}),
        "nul": _request(tmp_path, env={"A": "x\0y"}),
        "argv_short": _request(tmp_path, argv=["1"]),
        "world_zero": _request(tmp_path, argv=["0", "--", "-c", "pass"]),
        "world_huge": _request(tmp_path, argv=["99999999999999999999", "--", "-c", "pass"]),
        "cwd_relative": _request(tmp_path, cwd="relative"),
        "no_python": json.dumps({"argv": ["1", "--", "-c", "pass"], "env": {},
                                 "cwd": str(tmp_path)}).encode(),
    }
    answer = _send_raw(server.address, bodies.get(body, body) if isinstance(body, str) else body, length)
    assert answer.startswith("refused ") and named in answer, answer
    assert server.proc.poll() is None
    _served_once(server)


def test_a_silent_or_trickling_client_does_not_stall_another(server: ForkServer, tmp_path: Path) -> None:
    """While one client sends nothing and another one byte every 0.2 s, a third is answered within
    its own give-up time (a server that read one request at a time would keep it waiting the silent
    client's whole :data:`REQUEST_READ_S`, as long as the third waits: it would fall back); both are
    refused once that deadline passes."""
    silent = _connect(server.address)
    trickling = _connect(server.address)
    body = _request(tmp_path)
    socket.send_fds(trickling, [struct.pack("!I", len(body))], fds := _descriptors())
    for fd in fds:
        os.close(fd)
    started = time.monotonic()
    read_end, write_end = os.pipe()
    zygote = request_zygote(server.address, ["1", "--", "-c", "pass"], _env(server), (0, 1, 2, write_end))
    os.close(write_end)
    assert zygote is not None, f"no answer in {time.monotonic() - started:.1f} s behind a silent client"
    assert zygote.wait(GUARD_S) == 0
    os.close(read_end)
    sent = 0
    while time.monotonic() - started < REQUEST_READ_S + 2 and sent < len(body):
        with contextlib.suppress(OSError):
            trickling.send(body[sent:sent + 1])
        sent += 1
        time.sleep(0.2)
    for conn in (silent, trickling):
        with conn:
            assert _line(conn).startswith("refused the request did not arrive in time")


_MARKS = "import os; open(os.path.join({folder!r}, str(os.getpid())), 'w').close()"


def test_a_request_its_client_gave_up_on_never_runs(server: ForkServer, tmp_path: Path) -> None:
    """The server answers ``pid``; the client closes without confirming: the zygote leaves without
    running the program, and a late confirmation is no confirmation (the server waits COMMIT_S)."""
    for confirm_after in (None, COMMIT_S + 1.0):
        fds = _descriptors()
        with _connect(server.address) as conn:
            header, body = encode_request(["1", "--", "-c", _MARKS.format(folder=str(tmp_path))],
                                          _env(server), str(tmp_path), sys.executable)
            socket.send_fds(conn, [header], fds)
            conn.sendall(body)
            answer = _line(conn)
            assert answer.startswith("pid "), answer
            zygote = int(answer.split()[1])
            if confirm_after is not None:
                time.sleep(confirm_after)
                with contextlib.suppress(OSError):
                    conn.sendall(RUN)
                assert _line(conn) == ""  # closed: abandoned before the confirmation came
        for fd in fds:
            os.close(fd)
        deadline = time.monotonic() + GRACE_S + 5
        while _alive(zygote) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(zygote)
    assert list(tmp_path.iterdir()) == [], "a program ran whose client had given up"
    _served_once(server)


def test_a_client_that_gives_up_in_time_runs_the_program_once(server: ForkServer, tmp_path: Path) -> None:
    """``request_zygote`` with a deadline shorter than the server's answer (already past when ``pid``
    comes) falls back, and the server's zygote never runs: across deadlines from 0 to 50 ms, every
    request ran the program exactly once or not at all through the server."""
    program = ["1", "--", "-c", _MARKS.format(folder=str(tmp_path))]
    served = 0
    for i in range(40):
        read_end, write_end = os.pipe()
        zygote = request_zygote(server.address, program, _env(server), (0, 1, 2, write_end),
                                give_up_s=i * 0.00125)
        os.close(write_end)
        if zygote is not None:
            served += 1
            assert zygote.wait(GUARD_S) == 0
        os.close(read_end)
    time.sleep(GRACE_S)  # any zygote released late would have written by now
    assert len(list(tmp_path.iterdir())) == served


_PARENT = """import os, sys
from zerogpu.fork_server import FORK_SERVER_ENV, start_fork_server
from zerogpu.launch import run_ranks
server = start_fork_server({"OMP_NUM_THREADS": "1", **os.environ})
assert server.ready(120)
print(server.proc.pid, server.folder, flush=True)
os.environ[FORK_SERVER_ENV] = server.address
rank = ("import os, time; d = %r; part = os.path.join(d, '.' + os.environ['RANK']); "
        "open(part, 'w').write(str(os.getpid())); os.replace(part, os.path.join(d, os.environ['RANK'])); "
        "time.sleep(60)")
run_ranks(2, ["-c", rank % sys.argv[1]], 120.0)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_the_server_and_what_it_served_end_with_its_parent_leaving_no_socket(tmp_path: Path,
                                                                             sig: int) -> None:
    """A parent killed (no handler runs on SIGKILL) while a served launch runs: the server ends the
    launch's ranks, then itself, and removes its socket and folder, within its grace periods."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path)], cwd=Path(__file__).parents[1],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, FORK_SERVER_ENV: ""})
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        server_pid, folder = parent.stdout.readline().split()
        deadline = time.monotonic() + GUARD_S
        while not all((tmp_path / r).exists() for r in ("0", "1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
        assert Path(folder, "socket").exists() and all(_alive(p) for p in pids)
        parent.send_signal(sig)
        parent.wait(GUARD_S)
        within = 2 * GRACE_S + PARENT_POLL_S + 5
        deadline = time.monotonic() + within
        while (any(_alive(p) for p in [*pids, int(server_pid)]) or Path(folder).exists()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "a served rank outlived the server's parent"
        assert not _alive(int(server_pid)), "the server outlived its parent"
        assert not Path(folder).exists(), "the server's socket folder stayed"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
