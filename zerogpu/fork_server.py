"""The fork server, from the side of the launches it serves: starting one, asking it for a zygote.

A fork server (:mod:`zerogpu.fork_server_process`) is a warm process that imported torch once and
forks each launch's zygote (:mod:`zerogpu.rank_zygote`), which saves a launch the seconds of a new
interpreter's imports. :class:`zerogpu.spawn.RankSpawn` asks the server ``$ZEROGPU_FORK_SERVER``
names (:func:`request_zygote`) and gets a :class:`ServedZygote`, or None when there is no server, it
refuses the launch (one whose result could differ from an exec'd zygote's) or it does not answer
within :data:`~zerogpu.fork_protocol.GIVE_UP_S`: the launch then starts its zygote as a new
interpreter, silently. A launch the requester gave up on never runs: the server's zygote waits for
the requester's confirmation (:mod:`zerogpu.fork_protocol`). Unset, empty or ``off``: no server.

Who can talk to a server: whoever can connect to its unix socket. :func:`start_fork_server` puts it
in a folder of its own made by :func:`tempfile.mkdtemp` (mode 0700), so only this user's processes
(and root) can; the server runs a launch as this user, with the launch's own environment, folder and
descriptors, so it gives a client nothing the client could not do by starting ``python`` itself.
The server treats every request as untrusted input all the same (malformed, oversized, slow or
abandoned requests are refused without stopping it or delaying other clients).

:func:`serving_launches` runs a server for the launches of one command (``zerosim mutants``, the
verify matrix). The server ends with the process that started it, whichever way that process ends
(SIGTERM, SIGINT, SIGKILL): its served zygotes' sessions get SIGTERM, then SIGKILL, and it removes
its socket and that folder. Serves the "nothing outlives the launch; a launch runs once" rule.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence

from zerogpu.fork_protocol import GIVE_UP_S, GRACE_S, RUN, encode_request, seconds_left

FORK_SERVER_ENV = "ZEROGPU_FORK_SERVER"  #: the socket's path; unset, empty or ``off``: no server
#: how long :meth:`ForkServer.stop` waits for the server: its SIGTERM and SIGKILL graces, and 5 s to spare
STOP_GRACE_S = 2 * GRACE_S + 5


def server_address(env: Mapping[str, str]) -> str | None:
    """The socket ``$ZEROGPU_FORK_SERVER`` names in ``env``; None when unset, empty or ``off``."""
    value = env.get(FORK_SERVER_ENV, "")
    return None if value in ("", "off") else value


class ServedZygote:
    """A zygote the server forked, as :class:`subprocess.Popen` shows one to :class:`RankSpawn`:
    ``pid``, ``returncode``, :meth:`poll`, :meth:`wait`. Closing the connection ends it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn: socket.socket | None = conn
        self.pid = pid
        self.returncode: int | None = None
        self._partial = b""

    def _take(self, timeout_s: float | None) -> None:
        while self.conn is not None and self.returncode is None:
            conn = self.conn
            readable, _, _ = select.select([conn], [], [], timeout_s)
            if not readable:
                return
            data = conn.recv(4096)
            self._partial += data
            if b"\n" in self._partial:
                what, _, value = self._partial.split(b"\n", 1)[0].decode().partition(" ")
                self.returncode = int(value) if what == "exit" else -signal.SIGTERM
            elif not data:  # the server died: its PDEATHSIG sent the zygote SIGTERM
                self.returncode = -signal.SIGTERM
            if self.returncode is not None:
                self.conn.close()
                self.conn = None

    def poll(self) -> int | None:
        self._take(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("served zygote", timeout or 0)
            self._take(left)
        return self.returncode


def _read_line(conn: socket.socket, deadline: float, limit: int = 4096) -> str:
    """One line from the server, by ``deadline``; OSError (a timeout too) or ValueError when there is none."""
    line = b""
    while not line.endswith(b"\n"):
        conn.settimeout(max(seconds_left(deadline), 1e-3))
        chunk = conn.recv(1)
        if not chunk or len(line) > limit:
            raise ValueError("the server closed the connection, or its line never ended")
        line += chunk
    return line.decode("utf-8", "replace").strip()


def request_zygote(address: str, zygote_args: Sequence[str], env: Mapping[str, str],
                   fds: Sequence[int], give_up_s: float = GIVE_UP_S) -> ServedZygote | None:
    """Ask the server at ``address`` for a zygote of ``WORLD -- ARGV`` (``zygote_args``) with ``env``,
    this process's folder and ``fds`` (stdin, stdout, stderr, report pipe); None when it refuses,
    cannot be reached or has not offered a zygote within ``give_up_s`` (the caller starts the zygote
    itself). The zygote runs only once this call has confirmed it (:data:`~zerogpu.fork_protocol.RUN`),
    which it does only in time: a request given up on is never run by the server."""
    deadline = time.monotonic() + give_up_s
    header, body = encode_request(list(zygote_args), dict(env), os.getcwd(), sys.executable)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(give_up_s)
        conn.connect(address)
        conn.settimeout(max(seconds_left(deadline), 1e-3))
        socket.send_fds(conn, [header], list(fds))
        conn.sendall(body)
        what, _, value = _read_line(conn, deadline).partition(" ")
        if what != "pid" or time.monotonic() >= deadline:
            conn.close()  # gave up: the server ends the zygote it holds without running it
            return None
        pid = int(value)
        conn.settimeout(1.0)  # a few bytes into a socket the server reads: never waits in practice
        conn.sendall(RUN)
        conn.settimeout(None)
        return ServedZygote(conn, pid)
    except (OSError, ValueError):
        conn.close()
        return None


class ForkServer:
    """A server this process started (:func:`start_fork_server`); :meth:`stop` ends it and its socket."""

    def __init__(self, proc: subprocess.Popen, folder: str) -> None:
        self.proc, self.folder = proc, folder
        self.address = os.path.join(folder, "socket")

    def ready(self, timeout_s: float) -> bool:
        """Whether the server listens within ``timeout_s`` (launches before that start zygotes themselves)."""
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.address):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


def start_fork_server(env: Mapping[str, str]) -> ForkServer:
    """Start a server (in the background: it listens once torch is imported) whose import environment
    is ``env``'s, ``$ZEROGPU_FORK_SERVER`` naming it, its socket in a new 0700 folder; it ends with this
    process, however that ends, and removes the socket and the folder. Point launches at it by putting
    ``server.address`` in their ``$ZEROGPU_FORK_SERVER``."""
    from zerosim.processes.owned_processes import parent_death_preexec

    folder = tempfile.mkdtemp(prefix="zerogpu-fork-")
    address = os.path.join(folder, "socket")
    server_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    server_env[FORK_SERVER_ENV] = address
    command = [sys.executable, "-u", "-m", "zerogpu.fork_server_process", address, "--remove-folder"]
    proc = subprocess.Popen(command, cwd=folder,
                            env=server_env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=parent_death_preexec())
    return ForkServer(proc, folder)


@contextlib.contextmanager
def serving_launches() -> Iterator[None]:
    """A server for the launches this process (and its subprocesses) makes while the block runs, for
    commands that make many; nothing when ``$ZEROGPU_FORK_SERVER`` is already set (a server, or
    ``off``), off Linux, or when ``$ZEROGPU_RANK_START`` is ``exec``."""
    if FORK_SERVER_ENV in os.environ or not sys.platform.startswith("linux") \
            or os.environ.get("ZEROGPU_RANK_START") == "exec":
        yield
        return
    server = start_fork_server({"OMP_NUM_THREADS": "1", **os.environ})  # what launches default to
    os.environ[FORK_SERVER_ENV] = server.address
    try:
        yield
    finally:
        os.environ.pop(FORK_SERVER_ENV, None)
        server.stop()

