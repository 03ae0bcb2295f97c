"""A warm process that many launches share: it imported torch once and forks each launch's zygote.

``python -u -m zerogpu.fork_server SOCKET`` imports what :func:`zerogpu.rank_zygote.preload` imports
(torch.distributed, zerosim, zerogpu: no thread, no process group, no CUDA), then listens on the unix
socket ``SOCKET``. :class:`zerogpu.spawn.RankSpawn` sends it a launch (:func:`request_zygote`): the
zygote's ``WORLD -- ARGV``, the launch's environment and working folder, and its standard input,
output and error and the report pipe's write end (``SCM_RIGHTS``). The server forks a child that
becomes exactly what ``python -u -m zerogpu.rank_zygote REPORT_FD WORLD -- ARGV`` is once its imports
are done, and runs :func:`zerogpu.rank_zygote.serve` in it: the launch's environment in
``os.environ`` and in ``/proc/<pid>/environ`` (where :func:`zerosim.owned_processes.end_owned` finds
the launch's owner token; the command line there is the zygote's too), the launch's folder as working
folder and as ``sys.path[0]`` (then ``$PYTHONPATH``), a session of its own, SIGTERM when the server
dies. The server answers ``pid PID`` once the child is in its session, ``exit STATUS`` when it has
reaped it (as :attr:`subprocess.Popen.returncode`), or ``refused REASON``. When the requester's
connection closes first (the launcher died, even by SIGKILL), the child's session gets SIGTERM, then
SIGKILL after :data:`GRACE_S`: what ``PR_SET_PDEATHSIG`` gives the exec'd zygote.

A launch is served only when the result cannot differ from the exec'd zygote
(:func:`refusal`): the same ``python``; the same value (or absence) of every environment variable
that can change what an import does (:func:`import_environment`); no module this server imported
shadowed by a file in the launch's folder or ``$PYTHONPATH``. Anything else, or a server that cannot
be reached, and the launch starts the zygote as a new interpreter, silently. ``$ZEROGPU_FORK_SERVER``
names the socket; unset, empty or ``off``: no server. The server ends on SIGTERM (its children's
sessions get SIGTERM, then SIGKILL) and when the process that started it dies.
Serves the "nothing outlives the launch; ranks see what an interpreter of their own sees" rule.

Why one module of this length: the request, the rule that refuses one, the child that becomes the
zygote and the requester's view of it (:class:`ServedZygote`) are both ends of one protocol; each
relies on what the other sends and when (the pid only once the session exists, the status only once
reaped), so they change together.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

FORK_SERVER_ENV = "ZEROGPU_FORK_SERVER"  #: the socket's path; unset, empty or ``off``: no server
GRACE_S = 3.0  #: a served zygote whose requester left gets SIGTERM, then SIGKILL after this
CONNECT_TIMEOUT_S = 5.0
#: variables whose value can change what an import does (a prefix ends with ``_`` or is a family)
IMPORT_PREFIXES = ("TORCH", "ATEN_", "OMP_", "KMP_", "GOMP_", "MKL", "OPENBLAS", "GOTO", "BLIS", "CUDA",
                   "CUBLAS", "CUDNN", "NCCL", "NVIDIA", "GLOO_", "PYTHON", "LD_", "MALLOC",
                   "LC_", "XDG_", "DNNL", "ONEDNN", "TRITON", "PYTORCH")
#: and single names: the locale, the time zone, the home folder, and the project's own variables that a
#: process reads before or while it imports (the others, such as ``$ZEROGPU_STATUS_DIR``, are read later)
IMPORT_NAMES = ("LANG", "LANGUAGE", "TZ", "HOME", "ZEROGPU_RANK_START", FORK_SERVER_ENV,
                "ZEROSIM_CONTRACTS_DIR")
#: what each launch sets for its own ranks (:func:`zerogpu.spawn.rank_environment`; read by the ranks,
#: not by an import), and ``$PYTHONPATH``, which the served zygote puts on its ``sys.path`` itself
PER_LAUNCH = frozenset({"TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_USE_AGENT_STORE", "PYTHONPATH"})
#: read where they are used, not at import: the same in a served zygote (whose ``os.environ`` is the
#: launch's) as in a new interpreter; DeepSpeed's import sets the CUDA check's in its process
READ_WHEN_USED = frozenset({"PYTORCH_NVML_BASED_CUDA_CHECK"})
#: applied by the served zygote itself (:func:`_apply_warning_options`) when the server runs without it
WARNINGS_ENV = "PYTHONWARNINGS"
_PR_SET_MM, _PR_SET_MM_MAP = 35, 14
_REPORT_FD = 3  # the report pipe's number in a served zygote (0, 1, 2 are the launch's)


def import_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` that can change what an import does (:data:`IMPORT_PREFIXES`,
    :data:`IMPORT_NAMES`), less :data:`PER_LAUNCH`: a launch is served only where these agree."""
    per_launch = PER_LAUNCH | READ_WHEN_USED | ({WARNINGS_ENV} if not _BASE_ENV.get(WARNINGS_ENV) else set())
    return {k: v for k, v in env.items() if k not in per_launch
            and (k.startswith(IMPORT_PREFIXES) or k in IMPORT_NAMES)}


def _apply_warning_options(env: Mapping[str, str]) -> None:
    """The warning filters a new interpreter started with ``env`` would have once it had made this
    server's imports: the filters those imports added first, then ``$PYTHONWARNINGS``'s, then the
    interpreter's defaults (this server runs without ``$PYTHONWARNINGS``, so its startup filters are
    the defaults). Lets launches that silence warnings, as many do, be served."""
    import warnings

    filters: list[Any] = warnings.filters  # type: ignore[assignment]
    options = [o for o in env.get(WARNINGS_ENV, "").split(",") if o]
    added = filters[: len(filters) - len(_STARTUP_FILTERS)]
    filters[:] = []
    warnings._processoptions(options)  # type: ignore[attr-defined]
    filters[:] = [*added, *filters, *_STARTUP_FILTERS]
    warnings._filters_mutated()  # type: ignore[attr-defined]
    sys.warnoptions[:] = options


def server_address(env: Mapping[str, str]) -> str | None:
    """The socket ``$ZEROGPU_FORK_SERVER`` names in ``env``; None when unset, empty or ``off``."""
    value = env.get(FORK_SERVER_ENV, "")
    return None if value in ("", "off") else value


def _python_path(env: Mapping[str, str], cwd: str) -> list[str]:
    """What an interpreter started in ``cwd`` with ``env`` puts first on ``sys.path`` for ``-m``:
    the folder, then each ``$PYTHONPATH`` entry made absolute (an empty one is the folder)."""
    entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep)] if env.get("PYTHONPATH") else []
    return [cwd, *(os.path.normpath(os.path.join(cwd, e)) if e else cwd for e in entries)]


def _shadowed(folders: Sequence[str]) -> str | None:
    """The first module this process imported that a module or folder in ``folders`` would replace
    (a folder counts even without ``__init__.py``: cautious)."""
    from importlib.machinery import all_suffixes

    loaded = {}
    for name, module in list(sys.modules.items()):
        origin = getattr(module, "__file__", None)
        if "." not in name and origin:
            package = os.path.basename(origin).startswith("__init__.")
            loaded[name] = os.path.dirname(os.path.dirname(origin) if package else origin)
    suffixes = tuple(all_suffixes())
    for folder in folders:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            name = entry.name if entry.is_dir() else entry.name.split(".", 1)[0]
            if not entry.is_dir() and not entry.name.endswith(suffixes):
                continue
            if name in loaded and os.path.realpath(loaded[name]) != os.path.realpath(folder):
                return f"{entry.path} shadows the imported {name}"
    return None


def refusal(request: Mapping[str, Any]) -> str | None:
    """Why ``request`` would run differently here than in a new interpreter, or None (see the module
    docstring): another ``python``, an import variable that differs, a shadowed module."""
    if request["python"] != sys.executable:
        return f"python {request['python']} is not {sys.executable}"
    ours, theirs = import_environment(_BASE_ENV), import_environment(request["env"])
    for name in sorted(set(ours) | set(theirs)):
        if name in _SET_BY_IMPORTS and theirs.get(name) in (None, _SET_BY_IMPORTS[name]):
            continue  # what this server's imports set (torch._dynamo's cache folder): the same either way
        if ours.get(name) != theirs.get(name):
            return f"${name} differs"
    return _shadowed(_python_path(request["env"], request["cwd"]))


# ---- the served zygote (a child of the server) ---------------------------------------------------

class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` of ``<linux/prctl.h>``."""

    _fields_ = [*((n, ctypes.c_uint64) for n in (
        "start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack", "arg_start",
        "arg_end", "env_start", "env_end", "auxv")),
        ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


_SHOWN: list[Any] = []  # the blocks /proc/self/environ and cmdline point at: they live as long as we do


def show_as_launched(env: Mapping[str, str], argv: Sequence[str]) -> bool:
    """Point this process's ``/proc/<pid>/environ`` and ``cmdline`` at ``env`` and ``argv``
    (``prctl(PR_SET_MM_MAP)``, unprivileged since Linux 3.18); forks inherit them. False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()  # noqa: SIM115
    except OSError:
        return False
    stat = [0, 0, 0, 0, *map(int, fields[1:])]  # stat[i] is field i (1-based) of proc(5)
    environ = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items())
    cmdline = b"".join(a.encode() + b"\0" for a in argv)
    blocks = [ctypes.create_string_buffer(environ, len(environ) or 1),
              ctypes.create_string_buffer(cmdline, len(cmdline) or 1)]
    libc.sbrk.restype = ctypes.c_void_p
    m = _MmMap(start_code=stat[26], end_code=stat[27], start_stack=stat[28], start_data=stat[45],
               end_data=stat[46], start_brk=stat[47], brk=libc.sbrk(0) or stat[47],
               arg_start=ctypes.addressof(blocks[1]), arg_end=ctypes.addressof(blocks[1]) + len(cmdline),
               env_start=ctypes.addressof(blocks[0]), env_end=ctypes.addressof(blocks[0]) + len(environ),
               auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF)
    if libc.prctl(_PR_SET_MM, _PR_SET_MM_MAP, ctypes.byref(m), ctypes.sizeof(m), 0) != 0:
        return False
    _SHOWN[:] = blocks
    return True


def _become_zygote(request: Mapping[str, Any], fds: Sequence[int], server: int,
                   ready_w: int) -> tuple[int, list[str]]:
    """In the forked child: become ``python -u -m zerogpu.rank_zygote 3 WORLD -- ARGV`` as it is once
    its imports are done, in the launch's session, folder and environment; returns ``(WORLD, ARGV)``
    for :func:`zerogpu.rank_zygote.serve` (called at the top of the stack, as the zygote calls it)."""
    from zerogpu import rank_zygote

    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        rank_zygote._die_with_parent(server)
        for target, fd in enumerate(fds):  # stdin, stdout, stderr, the report pipe (all numbered >= 10)
            os.dup2(fd, target)
        os.closerange(_REPORT_FD + 1, ready_w)
        os.closerange(ready_w + 1, 1 << 16)
        env, cwd = dict(request["env"]), request["cwd"]
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for name, value in _SET_BY_IMPORTS.items():  # as the imports this zygote skips would set them
            os.environ.setdefault(name, value)
        sys.path[:] = [*_python_path(env, cwd), *_BASE_PATH]
        if not _BASE_ENV.get(WARNINGS_ENV):
            _apply_warning_options(env)
        tempfile.tempdir = None  # found again from this environment's $TMPDIR
        zygote_argv = [sys.executable, "-u", "-m", "zerogpu.rank_zygote", str(_REPORT_FD), *request["argv"]]
        show_as_launched(env, zygote_argv)
        sys.argv = zygote_argv[3:]
        world, separator, *argv = request["argv"]
        os.close(ready_w)  # in its own session: the launcher may signal it
        return int(world), argv
    except BaseException:  # noqa: BLE001 - a zygote that cannot be set up never serves
        with contextlib.suppress(BaseException):
            import traceback

            traceback.print_exc()
        os._exit(1)


# ---- the server ------------------------------------------------------------------------------------

_BASE_ENV: dict[str, str] = {}  # the server's environment
#: the variables the server's imports set (a launch that made the same imports has them too)
_SET_BY_IMPORTS: dict[str, str] = {}
_STARTUP_FILTERS: list[Any] = []  # the warning filters before the server's own imports
_BASE_PATH: list[str] = []  # the server's sys.path after its folder and $PYTHONPATH


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the requester left mid-request")
        data += chunk
    return data


class _Server:
    """The accepting loop: one connection per served zygote; SIGTERM (``stop``) ends it."""

    def __init__(self, listener: socket.socket, wakeup_r: int) -> None:
        self.listener, self.wakeup_r = listener, wakeup_r
        self.by_pid: dict[int, socket.socket | None] = {}  # served zygote -> its requester
        self.kill_at: dict[int, float] = {}  # zygotes whose requester left: SIGKILL at
        self.stopping = False
        self.child: tuple[Mapping[str, Any], list[int], int, int] | None = None  # set in a forked child

    def handle(self, conn: socket.socket) -> None:
        """Read one request from ``conn``; answer ``refused WHY`` or fork its zygote and answer ``pid``."""
        conn.settimeout(CONNECT_TIMEOUT_S)
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, 4, 4)
            if len(head) < 4 or len(fds) != 4:
                raise ConnectionError("a request without its header or its four descriptors")
            request = json.loads(_recv_exactly(conn, struct.unpack("!I", head)[0]))
            why = refusal(request)
            pid = self.fork(request, fds) if why is None else 0
            if self.child is not None:
                return
            conn.sendall(f"pid {pid}\n".encode() if why is None else f"refused {why}\n".encode())
        except (OSError, ValueError, KeyError, TypeError) as e:
            with contextlib.suppress(OSError):
                conn.sendall(f"refused {type(e).__name__}: {e}\n".encode())
            why = str(e)
        finally:
            for fd in fds:
                os.close(fd)
        if why is not None:
            conn.close()
            return
        conn.setblocking(False)
        self.by_pid[pid] = conn

    def fork(self, request: Mapping[str, Any], fds: Sequence[int]) -> int:
        """Fork the zygote of ``request``; in the child note :attr:`child` and return 0 (the loop then
        returns it), here return its pid once it is in its own session."""
        ready_r, ready_w = os.pipe()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            for sock in [self.listener, *(c for c in self.by_pid.values() if c is not None)]:
                sock.detach()  # closed with every other descriptor, never later by a reused number
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (*fds, ready_w)]  # out of the way of 0..3
            self.child = (request, high[:-1], server, high[-1])
            return 0
        os.close(ready_w)
        while os.read(ready_r, 1):
            pass
        os.close(ready_r)
        return pid

    def left(self, pid: int) -> None:
        """The requester of ``pid`` closed its connection: SIGTERM the zygote's session now."""
        conn = self.by_pid[pid]
        if conn is not None:
            conn.close()
        self.by_pid[pid] = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        self.kill_at[pid] = time.monotonic() + GRACE_S

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.by_pid.pop(pid, None)
            self.kill_at.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.setblocking(True)
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()

    def loop(self) -> tuple[Mapping[str, Any], list[int], int, int] | None:
        """Serve until stopped (None); in a forked zygote, return what :func:`_become_zygote` needs."""
        while not (self.stopping and not self.by_pid):
            conns: dict[Any, int] = {c: pid for pid, c in self.by_pid.items() if c is not None}
            now = time.monotonic()
            for pid, when in list(self.kill_at.items()):
                if now >= when:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    self.kill_at[pid] = now + GRACE_S
            wait = min([*(w - now for w in self.kill_at.values()), 1.0])
            watched: list[Any] = [self.wakeup_r, *conns] + ([] if self.stopping else [self.listener])
            readable, _, _ = select.select(watched, [], [], max(wait, 0.0))
            for ready in readable:
                if ready is self.listener:
                    with contextlib.suppress(OSError):
                        self.handle(self.listener.accept()[0])
                    if self.child is not None:
                        return self.child
                elif ready == self.wakeup_r:
                    with contextlib.suppress(OSError):
                        os.read(self.wakeup_r, 4096)
                elif self.by_pid.get(conns[ready]) is not None and self._requester_left(ready):
                    self.left(conns[ready])
            self.reap()
        return None

    @staticmethod
    def _requester_left(conn: socket.socket) -> bool:
        try:
            return not conn.recv(1)
        except BlockingIOError:
            return False
        except OSError:
            return True

    def stop(self, signum: int, frame: object) -> None:
        if not self.stopping:
            self.stopping = True
            for pid in list(self.by_pid):
                if self.by_pid[pid] is not None:
                    self.left(pid)


def serve_forever(path: str) -> None:
    """Import, listen on ``path`` (see the module docstring), serve until SIGTERM or the parent's death.
    In each forked zygote this returns only through :func:`zerogpu.rank_zygote.serve`'s ``os._exit``
    or a rank's own end: called at the top of the stack, a rank leaves as an interpreter leaves."""
    import warnings

    from zerogpu import rank_zygote

    parent = os.getppid()
    _BASE_ENV.update(os.environ)
    _STARTUP_FILTERS[:] = warnings.filters
    _BASE_PATH[:] = sys.path[len(_python_path(os.environ, os.getcwd())):]
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = _Server(listener, wakeup_r)
    signal.signal(signal.SIGTERM, server.stop)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.set_wakeup_fd(wakeup_w)
    rank_zygote._die_with_parent(parent)
    rank_zygote.preload(["-m", "zerosim.verify"])
    importlib.import_module("zerogpu.spawn")  # what a rank program of zerogpu imports first
    _SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if _BASE_ENV.get(k) != v})

    if not show_as_launched(os.environ, sys.orig_argv):  # served ranks would hide their owner token
        raise SystemExit(f"{FORK_SERVER_ENV}: /proc/<pid>/environ cannot be set here; not serving")
    listener.bind(path)
    listener.listen(64)
    child = server.loop()
    if child is None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    world, argv = _become_zygote(*child)
    rank_zygote.serve(_REPORT_FD, world, argv)  # what the exec'd zygote's main runs; never returns


# ---- the requester's side ------------------------------------------------------------------------

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


def request_zygote(address: str, zygote_args: Sequence[str], env: Mapping[str, str],
                   fds: Sequence[int]) -> ServedZygote | None:
    """Ask the server at ``address`` for a zygote of ``WORLD -- ARGV`` (``zygote_args``) with ``env``,
    this process's folder and ``fds`` (stdin, stdout, stderr, report pipe); None when it refuses or
    cannot be reached (the caller starts the zygote itself)."""
    request = json.dumps({"argv": list(zygote_args), "env": dict(env), "cwd": os.getcwd(),
                          "python": sys.executable}).encode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(CONNECT_TIMEOUT_S)
        conn.connect(address)
        socket.send_fds(conn, [struct.pack("!I", len(request))], list(fds))
        conn.sendall(request)
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise ConnectionError("the server closed the connection")
            line += chunk
        what, _, value = line.decode().strip().partition(" ")
        if what != "pid":
            conn.close()
            return None
        conn.settimeout(None)
        return ServedZygote(conn, int(value))
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
                self.proc.wait(timeout=2 * GRACE_S + 5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.address)
        with contextlib.suppress(OSError):
            os.rmdir(self.folder)


def start_fork_server(env: Mapping[str, str]) -> ForkServer:
    """Start a server (in the background: it listens once torch is imported) whose import environment
    is ``env``'s, ``$ZEROGPU_FORK_SERVER`` naming it; it dies with this process. Point launches at it
    by putting ``server.address`` in their ``$ZEROGPU_FORK_SERVER``."""
    from zerosim.owned_processes import parent_death_preexec

    folder = tempfile.mkdtemp(prefix="zerogpu-fork-")
    address = os.path.join(folder, "socket")
    server_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    server_env[FORK_SERVER_ENV] = address
    proc = subprocess.Popen([sys.executable, "-u", "-m", "zerogpu.fork_server", address], cwd=folder,
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m zerogpu.fork_server SOCKET")
    serve_forever(sys.argv[1])
