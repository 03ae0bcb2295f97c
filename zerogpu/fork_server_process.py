"""The fork server's process: it imported torch once and forks each launch's zygote.

``python -u -m zerogpu.fork_server_process SOCKET [--remove-folder]`` imports what
:func:`zerogpu.rank_zygote.preload` imports (torch.distributed, zerosim, zerogpu: no thread, no process
group, no CUDA), then listens on the unix socket ``SOCKET`` (:mod:`zerogpu.fork_protocol` says what
travels on it; :mod:`zerogpu.fork_server` is the requester's side and starts this process). For each
launch it accepts it forks a child that becomes exactly what ``python -u -m zerogpu.rank_zygote
REPORT_FD WORLD -- ARGV`` is once its imports are done, and runs :func:`zerogpu.rank_zygote.serve` in it:
the launch's environment in ``os.environ`` and in ``/proc/<pid>/environ`` (where
:func:`zerosim.processes.owned_processes.end_owned` finds the launch's owner token; the command line there is
the zygote's too), the launch's folder as working folder and as ``sys.path[0]`` (then ``$PYTHONPATH``), a
session of its own, SIGTERM when the server dies. The child runs nothing of the launch until its
requester confirmed it still waits (the protocol's ``run``); when the requester's connection closes
(the launcher died, even by SIGKILL), the child's session gets SIGTERM, then SIGKILL after
:data:`GRACE_S`: what ``PR_SET_PDEATHSIG`` gives the exec'd zygote.

A launch is served only when the result cannot differ from the exec'd zygote (:func:`refusal`): the
same ``python``; the same value (or absence) of every environment variable that can change what an
import does (:func:`import_environment`); no module this server imported shadowed by a file in the
launch's folder or ``$PYTHONPATH``. Anything else is refused, and the launch starts its zygote itself.

The server survives any request: it reads every connection's request at once without blocking
(one deadline per connection, so a silent or trickling client delays no other), refuses whatever
does not parse, and catches whatever handling one connection raises. It ends on SIGTERM, SIGINT or
the death of the process that started it (``PR_SET_PDEATHSIG``, and its parent's pid looked at every
second): every served zygote's session gets SIGTERM, then SIGKILL, and once they are reaped the
server removes its socket (and, with ``--remove-folder``, the socket's folder, made for it by
:func:`zerogpu.fork_server.start_fork_server`). Serves the "nothing outlives the launch; ranks see what
an interpreter of their own sees; a launch runs once" rule.

Why one module of this length: the rule that refuses a launch, the child that becomes its zygote and
the loop that forks it share one state, the server's imports (``_BASE_ENV``, ``_SET_BY_IMPORTS``,
``_BASE_PATH``): the rule compares a launch with them and the child restores the launch's view of
them, so each change to one is a change to the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import os
import select
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zerogpu.fork_protocol import COMMIT_S, GRACE_S, RUN, LaunchRequest, RequestError, RequestReader
from zerogpu.fork_server import FORK_SERVER_ENV

PARENT_POLL_S = 1.0  #: how often the server looks whether the process that started it is still there
MAX_READING = 64  #: connections read at once; more wait in the listen backlog
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


def refusal(request: LaunchRequest) -> str | None:
    """Why ``request`` would run differently here than in a new interpreter, or None (see the module
    docstring): another ``python``, an import variable that differs, a shadowed module."""
    if request.python != sys.executable:
        return f"python {request.python} is not {sys.executable}"
    ours, theirs = import_environment(_BASE_ENV), import_environment(request.env)
    for name in sorted(set(ours) | set(theirs)):
        if name in _SET_BY_IMPORTS and theirs.get(name) in (None, _SET_BY_IMPORTS[name]):
            continue  # what this server's imports set (torch._dynamo's cache folder): the same either way
        if ours.get(name) != theirs.get(name):
            return f"${name} differs"
    return _shadowed(_python_path(request.env, request.cwd))


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
    environ = b"".join(os.fsencode(f"{k}={v}") + b"\0" for k, v in env.items())
    cmdline = b"".join(os.fsencode(a) + b"\0" for a in argv)
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


@dataclass
class _Child:
    """What a forked child takes from the server to become the launch's zygote: the request, the
    launch's four descriptors, the server's pid and the two pipes of the hand-over (all numbered
    10 and up, out of the way of 0..3)."""

    request: LaunchRequest
    fds: list[int]
    server: int
    ready_w: int  # closed once the child is in its own session: the server may then report its pid
    go_r: int  # one byte once the requester confirmed; end of file: the launch is not to run


def _keep_only(keep: Sequence[int]) -> None:
    """Close every descriptor above the report pipe's but those in ``keep``."""
    low = _REPORT_FD + 1
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)


def _become_zygote(child: _Child) -> tuple[int, list[str]]:
    """In the forked child: become ``python -u -m zerogpu.rank_zygote 3 WORLD -- ARGV`` as it is once
    its imports are done, in the launch's session, folder and environment, and wait for the server's
    word that the requester still wants it (none: leave without running anything); returns
    ``(WORLD, ARGV)`` for :func:`zerogpu.rank_zygote.serve` (called at the top of the stack, as the
    zygote calls it)."""
    from zerogpu import rank_zygote

    request = child.request
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        rank_zygote._die_with_parent(child.server)
        for target, fd in enumerate(child.fds):  # stdin, stdout, stderr, the report pipe
            os.dup2(fd, target)
        _keep_only((child.ready_w, child.go_r))
        env, cwd = dict(request.env), request.cwd
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        for name, value in _SET_BY_IMPORTS.items():  # as the imports this zygote skips would set them
            os.environ.setdefault(name, value)
        sys.path[:] = [*_python_path(env, cwd), *_BASE_PATH]
        if not _BASE_ENV.get(WARNINGS_ENV):
            _apply_warning_options(env)
        tempfile.tempdir = None  # found again from this environment's $TMPDIR
        zygote_argv = [sys.executable, "-u", "-m", "zerogpu.rank_zygote", str(_REPORT_FD), *request.argv]
        show_as_launched(env, zygote_argv)
        sys.argv = zygote_argv[3:]
        os.close(child.ready_w)  # in its own session: the launcher may signal it
        if os.read(child.go_r, 1) != b"g":  # the requester gave up, or the server is gone
            os._exit(0)
        os.close(child.go_r)
        return request.world, list(request.argv[2:])
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


@dataclass
class _Held:
    """A forked zygote waiting for its requester's :data:`~zerogpu.fork_protocol.RUN`."""

    pid: int
    go_w: int
    deadline: float
    said: bytes = b""
    status: int | None = None  # set when it ended while held (its setup failed)


def _say(conn: socket.socket, line: str) -> bool:
    """Send one line without blocking; False when the requester cannot take it (gone, or not reading)."""
    data = (line.replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
    try:
        return conn.send(data) == len(data)
    except OSError:
        return False


class _Server:
    """The serving loop (see the module docstring): every connection is in one of three states,
    reading its request (:class:`~zerogpu.fork_protocol.RequestReader`), holding its forked zygote
    until the requester confirms (:class:`_Held`), or served (``by_pid``: zygote -> connection)."""

    def __init__(self, listener: socket.socket, wakeup_r: int, path: str, parent: int) -> None:
        self.listener, self.wakeup_r, self.path, self.parent = listener, wakeup_r, path, parent
        self.reading: dict[socket.socket, RequestReader] = {}
        self.held: dict[socket.socket, _Held] = {}
        self.by_pid: dict[int, socket.socket | None] = {}  # served zygote -> its requester (None: left)
        self.kill_at: dict[int, float] = {}  # zygotes whose requester left: SIGKILL at
        self.stop_requested = False  # set by the signal handler; acted on by the loop
        self.stopping = False
        self.child: _Child | None = None  # set in a forked child

    def request_stop(self, signum: int, frame: object) -> None:
        self.stop_requested = True

    # -- one connection --------------------------------------------------------------------------

    def accept(self) -> None:
        while len(self.reading) < MAX_READING:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            conn.setblocking(False)
            self.reading[conn] = RequestReader(conn, time.monotonic())

    def read_request(self, conn: socket.socket) -> None:
        """Take what arrived of ``conn``'s request; once whole, refuse it or fork its zygote, held."""
        reader = self.reading[conn]
        request: LaunchRequest | None = None
        try:
            request = reader.read()
            if request is None:
                return
            why = refusal(request)
        except RequestError as e:
            why = str(e)
        del self.reading[conn]
        if why is not None or request is None:
            self.refuse(conn, reader, why or "no request")
            return
        try:
            pid, go_w = self.fork(request, reader.fds)
        finally:
            reader.close_fds()  # the child holds its own copies
        if self.child is not None:
            return
        self.held[conn] = _Held(pid, go_w, time.monotonic() + COMMIT_S)
        if not _say(conn, f"pid {pid}"):
            self.abandon(conn)

    @staticmethod
    def refuse(conn: socket.socket, reader: RequestReader, why: str) -> None:
        reader.close_fds()
        _say(conn, f"refused {why[:1000]}")
        conn.close()

    def read_commit(self, conn: socket.socket) -> None:
        """Release the held zygote once the requester said :data:`RUN`; anything else abandons it."""
        held = self.held[conn]
        try:
            data = conn.recv(len(RUN) - len(held.said))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        held.said += data
        if not data or not RUN.startswith(held.said):
            self.abandon(conn)
        elif held.said == RUN:
            del self.held[conn]
            if held.status is not None:  # it ended before it could run: say how
                os.close(held.go_w)
                _say(conn, f"exit {held.status}")
                conn.close()
                return
            os.write(held.go_w, b"g")
            os.close(held.go_w)
            self.by_pid[held.pid] = conn

    def abandon(self, conn: socket.socket) -> None:
        """The requester of a held zygote gave up: the zygote leaves without running anything."""
        held = self.held.pop(conn)
        os.close(held.go_w)  # end of file for the zygote
        conn.close()
        if held.status is None:
            self.by_pid[held.pid] = None
            self.kill_at[held.pid] = time.monotonic() + GRACE_S

    def fork(self, request: LaunchRequest, fds: Sequence[int]) -> tuple[int, int]:
        """Fork the zygote of ``request``; in the child note :attr:`child` and return ``(0, -1)`` (the
        loop then returns it), here return its pid once it is in its own session, and the write end
        of the pipe that releases it."""
        ready_r, ready_w = os.pipe()
        go_r, go_w = os.pipe()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            os.close(go_w)
            for sock in [self.listener, *self.reading, *self.held, *(c for c in self.by_pid.values() if c)]:
                sock.detach()  # closed with every other descriptor, never later by a reused number
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (*fds, ready_w, go_r)]  # away from 0..3
            self.child = _Child(request, high[:4], server, high[4], high[5])
            return 0, -1
        os.close(ready_w)
        os.close(go_r)
        while os.read(ready_r, 1):
            pass
        os.close(ready_r)
        return pid, go_w

    def left(self, pid: int) -> None:
        """The requester of ``pid`` closed its connection: SIGTERM the zygote's session now."""
        conn = self.by_pid[pid]
        if conn is not None:
            conn.close()
        self.by_pid[pid] = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        self.kill_at[pid] = time.monotonic() + GRACE_S

    @staticmethod
    def requester_left(conn: socket.socket) -> bool:
        try:
            return not conn.recv(4096)
        except BlockingIOError:
            return False
        except OSError:
            return True

    # -- the loop ----------------------------------------------------------------------------------

    def reap(self) -> None:
        held_by_pid = {h.pid: h for h in self.held.values()}
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            if pid in held_by_pid:
                held_by_pid[pid].status = code
                continue
            conn = self.by_pid.pop(pid, None)
            self.kill_at.pop(pid, None)
            if conn is not None:
                _say(conn, f"exit {code}")
                conn.close()

    def begin_stopping(self) -> None:
        """Listen no more (the socket file goes at once: a new requester starts its zygote itself),
        refuse what is being read, abandon what is held, end every served zygote's session."""
        self.stopping = True
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        self.listener.close()
        for conn, reader in list(self.reading.items()):
            self.refuse(conn, reader, "the server is stopping")
        self.reading.clear()
        for conn in list(self.held):
            self.abandon(conn)
        for pid in [p for p, c in self.by_pid.items() if c is not None]:
            self.left(pid)

    def expire(self, now: float) -> None:
        """Refuse requests read too long, abandon zygotes held too long, SIGKILL sessions past grace."""
        for conn, reader in list(self.reading.items()):
            if reader.expired(now):
                del self.reading[conn]
                self.refuse(conn, reader, "the request did not arrive in time")
        for conn, held in list(self.held.items()):
            if now >= held.deadline:
                self.abandon(conn)
        for pid, when in list(self.kill_at.items()):
            if now >= when:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
                self.kill_at[pid] = now + GRACE_S

    def loop(self) -> _Child | None:
        """Serve until stopped and every zygote is reaped (None); in a forked zygote, return what
        :func:`_become_zygote` needs."""
        while True:
            if not self.stopping and (self.stop_requested or os.getppid() != self.parent):
                self.begin_stopping()
            if self.stopping and not self.by_pid and not self.held:
                return None
            now = time.monotonic()
            self.expire(now)
            deadlines = [*(r.deadline for r in self.reading.values()), *self.kill_at.values(),
                         *(h.deadline for h in self.held.values()), now + PARENT_POLL_S]
            served = {c: pid for pid, c in self.by_pid.items() if c is not None}
            listening = not self.stopping and len(self.reading) < MAX_READING
            watched: list[Any] = [self.wakeup_r, *self.reading, *self.held, *served]
            readable, _, _ = select.select(watched + ([self.listener] if listening else []), [], [],
                                           max(min(deadlines) - now, 0.0))
            for ready in readable:
                self.one(ready, served)
                if self.child is not None:
                    return self.child
            self.reap()

    def one(self, ready: Any, served: dict[Any, int]) -> None:
        """Handle one readable descriptor; whatever a connection's handling raises drops that connection."""
        if ready == self.wakeup_r:
            with contextlib.suppress(OSError):
                os.read(self.wakeup_r, 4096)
            return
        try:
            if ready is self.listener:
                self.accept()
            elif ready in self.reading:
                self.read_request(ready)
            elif ready in self.held:
                self.read_commit(ready)
            elif ready in served:
                pid = served[ready]
                conn = self.by_pid.get(pid)
                if conn is ready and self.requester_left(conn):
                    self.left(pid)
        except Exception:  # noqa: BLE001 - one connection's trouble never ends the server
            if self.child is not None:
                raise
            self.drop(ready)

    def drop(self, conn: Any) -> None:
        """Forget ``conn`` whatever state it was in (after an unexpected error handling it)."""
        reader = self.reading.pop(conn, None)
        if reader is not None:
            reader.close_fds()
        if conn in self.held:
            self.abandon(conn)
        for pid, c in list(self.by_pid.items()):
            if c is conn:
                self.left(pid)
        with contextlib.suppress(OSError):
            conn.close()


def _remove_socket(path: str, remove_folder: bool) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
    if remove_folder:
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # only if empty: nothing of anyone else's goes


def serve_forever(path: str, remove_folder: bool = False) -> None:
    """Import, listen on ``path`` (see the module docstring), serve until SIGTERM, SIGINT or the
    parent's death, then remove the socket (and its folder with ``remove_folder``). In each forked
    zygote this returns only through :func:`zerogpu.rank_zygote.serve`'s ``os._exit`` or a rank's own
    end: called at the top of the stack, a rank leaves as an interpreter leaves."""
    import warnings

    from zerogpu import rank_zygote

    me, parent = os.getpid(), os.getppid()
    _BASE_ENV.update(os.environ)
    _STARTUP_FILTERS[:] = warnings.filters
    _BASE_PATH[:] = sys.path[len(_python_path(os.environ, os.getcwd())):]
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = _Server(listener, wakeup_r, path, parent)
    child = None
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, server.request_stop)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.set_wakeup_fd(wakeup_w)
        rank_zygote._die_with_parent(parent)
        rank_zygote.preload(["-m", "zerosim.verify"])
        importlib.import_module("zerogpu.spawn")  # what a rank program of zerogpu imports first
        _SET_BY_IMPORTS.update({k: v for k, v in os.environ.items() if _BASE_ENV.get(k) != v})
        if server.stop_requested or os.getppid() != parent:  # told to stop while importing
            return
        if not show_as_launched(os.environ, sys.orig_argv):  # served ranks would hide their owner token
            raise SystemExit(f"{FORK_SERVER_ENV}: /proc/<pid>/environ cannot be set here; not serving")
        listener.bind(path)
        listener.listen(64)
        listener.setblocking(False)
        child = server.loop()
    finally:
        if os.getpid() == me:  # the server (a forked zygote leaves this frame only to serve)
            _remove_socket(path, remove_folder)
    if child is None:
        return
    world, argv = _become_zygote(child)
    rank_zygote.serve(_REPORT_FD, world, argv)  # what the exec'd zygote's main runs; never returns


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[2:] not in ([], ["--remove-folder"]):
        raise SystemExit("usage: python -m zerogpu.fork_server_process SOCKET [--remove-folder]")
    serve_forever(sys.argv[1], remove_folder=sys.argv[2:] == ["--remove-folder"])
