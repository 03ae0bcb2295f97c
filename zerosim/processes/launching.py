"""Running a launch (``mpiexec``, or ranks started directly) as process groups with a wall-clock timeout.

Shared by :mod:`zerosim.mpi.launch` and :mod:`zerogpu.launch` (distributed runs never hang). What a
launch starts is a :class:`Launch`: one launcher command (:class:`CommandLaunch`, ``mpiexec``) or the
ranks themselves (:class:`zerogpu.spawn.RankSpawn`). Every process runs in a session (process group)
of its own with an owner token in its environment (:mod:`zerosim.processes.owned_processes`). When the launch
ends, when it outlives its timeout, and when this process is interrupted (Ctrl-C, or SIGTERM /
SIGHUP through :mod:`zerosim.processes.stop_signals`), its groups and every process holding the token
(children the ranks started, in sessions of their own or not) get SIGTERM, then SIGKILL
(:meth:`Launch.end`), so nothing outlives the launch. The launch writes into files, never pipes: a
process that keeps its output open cannot keep a launch waiting. Pure standard library: no MPI, no
torch.

Why one module of this length: starting a launch, ending it and reading its output back (captured,
or streamed to the user with the noise sorted out) are one guarantee, that a launch leaves nothing
behind whichever way it ends; each reader of a launch relies on the ending it sees here.

What the user sees of a launch started for them (``zerosim simulate --backend mpi|torch``,
:func:`run_streamed` and :func:`finish_launch`): the ranks' standard output, streamed as it comes
(rank 0's verdict table or JSON), and at the end the zerosim lines the ranks wrote on standard error
(``rank R failed: ...``, ``error: ...``), each once. Everything else the launch printed (MPICH's
termination banner, torchrun's ``ChildFailedError``, tracebacks) goes to a log file, named in the
last line when the run failed. A rank that died without a word (killed by a signal) is named from
the launcher's own report, in one line: ``rank 1 failed: killed by signal 9 (SIGKILL) ...``. When
this process's standard output is closed by its reader (``| head -1``), the launch is stopped and
:class:`BrokenPipeError` raised, so the command ends quietly with exit 141 like every other command.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from ..errors import EXIT_BAD_INPUT, EXIT_LAUNCH_TIMEOUT, EXIT_RUN_FAILED, ConfigError
from .owned_processes import end_owned, new_owner_token, parent_death_preexec, with_owner_token

DEFAULT_LAUNCH_TIMEOUT_S = 900.0
LAUNCH_TIMEOUT_ENV = "ZEROSIM_LAUNCH_TIMEOUT_S"


def require_launch_timeout(timeout_s: object) -> float:
    """``timeout_s`` as seconds; ConfigError (field ``launch_timeout``) unless a positive number."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError("launch_timeout", timeout_s, "must be a positive number of seconds")
    return float(timeout_s)


def launch_timeout_from_env() -> float:
    """``$ZEROSIM_LAUNCH_TIMEOUT_S``, default :data:`DEFAULT_LAUNCH_TIMEOUT_S` (900 s)."""
    text = os.environ.get(LAUNCH_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_LAUNCH_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(LAUNCH_TIMEOUT_ENV, text, "must be a positive number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(LAUNCH_TIMEOUT_ENV, text, "must be a positive, finite number of seconds")
    return value


def kill_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM ``proc``'s process group, wait up to ``grace_s``, then SIGKILL whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass


def start_owned(command: Sequence[str], env: dict[str, str], token: str, **popen: Any) -> subprocess.Popen:
    """Start ``command`` in its own session, its environment carrying the owner ``token`` and, on
    Linux, SIGTERM due to it should this process die (:mod:`zerosim.processes.owned_processes`)."""
    return subprocess.Popen(list(command), env=with_owner_token(env, token), start_new_session=True,
                            preexec_fn=parent_death_preexec(), **popen)


def end_launch(proc: subprocess.Popen, token: str, grace_s: float) -> None:
    """End a launch and everything it started: the launcher's process group and every process holding
    ``token`` (ranks in sessions of their own, their children) get SIGTERM, then SIGKILL after
    ``grace_s``; returns once none is left and the launcher is reaped."""

    def group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    if proc.poll() is None:
        group(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            group(signal.SIGKILL)
    end_owned(token, grace_s, also=group)
    proc.wait()


class Launch(Protocol):
    """What one launch starts and watches (see the module docstring)."""

    def start(self, env: dict[str, str], token: str, stdout: IO[bytes] | None,
              stderr: IO[bytes] | None) -> None:
        """Start every process of the launch with ``env`` (plus ``token``), its output into these files."""

    def wait(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s``: the launch's own status once everything it started has ended,
        else None."""

    def end(self, token: str, grace_s: float) -> None:
        """End everything the launch started (SIGTERM, ``grace_s``, SIGKILL); returns once none is left."""


class CommandLaunch:
    """A launch that is one launcher process (``mpiexec``): its status is the launcher's."""

    def __init__(self, command: Sequence[str]):
        self.command = list(command)
        self.proc: subprocess.Popen | None = None

    def start(self, env: dict[str, str], token: str, stdout: IO[bytes] | None,
              stderr: IO[bytes] | None) -> None:
        self.proc = start_owned(self.command, env, token, stdout=stdout, stderr=stderr)

    def wait(self, timeout_s: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def end(self, token: str, grace_s: float) -> None:
        if self.proc is not None:
            end_launch(self.proc, token, grace_s)
        else:
            end_owned(token, grace_s)


def as_launch(command: Sequence[str] | Launch) -> Launch:
    """``command`` itself when it is a :class:`Launch`, else a :class:`CommandLaunch` of it."""
    if isinstance(command, (list, tuple)):
        return CommandLaunch(command)
    return command  # type: ignore[return-value]


@dataclass
class GroupRun:
    """What one process-group launch did. ``stdout`` / ``stderr`` are None when they went to the terminal;
    ``returncode`` is the launcher's own status, None when it outlived the timeout (and was killed)."""

    returncode: int | None
    stdout: str | None
    stderr: str | None
    timed_out: bool
    elapsed_s: float


def _read_back(f: IO[bytes] | None) -> str | None:
    if f is None:
        return None
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def run_process_group(command: Sequence[str] | Launch, timeout_s: float, env: dict[str, str], *,
                      capture: bool = True, kill_grace_s: float = 3.0) -> GroupRun:
    """Run ``command`` (a launcher's argv, or a :class:`Launch`) with exactly ``env`` plus its owner
    token, with a wall-clock timeout; never leaves processes behind: when the launch ends, when the
    timeout expires and on any exception here (KeyboardInterrupt,
    :class:`zerosim.processes.stop_signals.StopSignal`) everything it started is ended (:meth:`Launch.end`).
    Captured output goes to unnamed temporary files, never pipes, so a process that outlives its
    launcher cannot keep this call waiting."""
    launch = as_launch(command)
    token = new_owner_token()
    with contextlib.ExitStack() as files:
        out_f = files.enter_context(tempfile.TemporaryFile()) if capture else None
        err_f = files.enter_context(tempfile.TemporaryFile()) if capture else None
        start = time.monotonic()
        returncode: int | None = None
        try:
            launch.start(env, token, out_f, err_f)
            returncode = launch.wait(timeout_s)
        finally:  # a normal end, the timeout, or KeyboardInterrupt: take everything it started down
            launch.end(token, kill_grace_s)
        return GroupRun(returncode, _read_back(out_f), _read_back(err_f), returncode is None,
                        time.monotonic() - start)


# ---- a launch whose output the user reads: stdout streamed, stderr sorted, noise to a log -----------

#: a line a rank writes for the user (rank_messages.rank_failure_message, bad input on rank 0)
MESSAGE_RE = re.compile(r"^(rank \d+ failed: |error: )")
_JOIN_S = 5.0  # how long the output readers may take to drain after the launcher has exited


@dataclass
class StreamedRun:
    """What :func:`run_streamed` did. ``returncode`` is the launcher's own status, None when it was
    stopped (timeout, or this process's stdout closed); ``messages`` are the ranks' zerosim lines
    (``rank R failed: ...``, ``error: ...``) in order, each once; ``log_path`` holds everything else."""

    returncode: int | None
    timed_out: bool
    broken_pipe: bool
    log_path: Path
    elapsed_s: float
    messages: list[str] = field(default_factory=list)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _write_out(data: bytes) -> None:
    """``data`` to this process's stdout as it is (bytes when the stream has a buffer: no re-encoding)."""
    out: Any = sys.stdout
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        out.flush()
        buffer.write(data)
        buffer.flush()
    else:
        out.write(data.decode("utf-8", "replace"))
        out.flush()


def _lines_of(fd: int, done: threading.Event, max_line: int = 1 << 20) -> Iterator[bytes]:
    """The lines written to the file behind ``fd``, as they are written, until ``done`` is set (every
    writer has ended) and the file is read to its end. A line longer than ``max_line`` comes in pieces."""
    offset, pending = 0, b""
    while True:
        finished = done.is_set()  # taken before the read: data written before ``done`` is never missed
        chunk = os.pread(fd, 1 << 16, offset)
        if chunk:
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line + b"\n"
            while len(pending) > max_line:
                yield pending[:max_line]
                pending = pending[max_line:]
            continue
        if finished:
            if pending:
                yield pending
            return
        done.wait(0.05)


def _pump_stdout(lines: Iterable[bytes], log: _Log, broken: threading.Event,
                 is_noise: Callable[[str], bool] | None) -> None:
    """Forward the launch's stdout line by line; from the first noise line on (a launcher's banner,
    which it prints last) everything goes to the log. Blank lines are held until the next line, so a
    banner's leading blank line goes with it."""
    held: list[bytes] = []
    diverted = False
    for raw in lines:
        if broken.is_set() or diverted:
            log.write(raw)
            continue
        if is_noise is not None and is_noise(raw.decode("utf-8", "replace")):
            diverted = True
            log.write(b"".join(held) + raw)
            held = []
            continue
        if not raw.strip():
            held.append(raw)
            continue
        try:
            _write_out(b"".join(held) + raw)
        except OSError as e:  # BrokenPipeError, or EPIPE / EINVAL from a closed reader
            if not isinstance(e, BrokenPipeError) and e.errno not in (errno.EPIPE, errno.EINVAL):
                raise
            broken.set()
            log.write(raw)
        held = []
    if held and not broken.is_set() and not diverted:
        try:
            _write_out(b"".join(held))
        except OSError:
            broken.set()


def _messages_in(path: Path) -> list[str]:
    """The ranks' zerosim lines in the log (each once, in order), read line by line."""
    messages: list[str] = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if MESSAGE_RE.match(line) and line not in messages:
                    messages.append(line)
    except OSError:
        pass
    return messages


class _Log:
    """The launch's log file: the launcher's stderr goes straight into it, and the stdout reader
    appends what it diverts (the file is opened for appending, so neither overwrites the other)."""

    def __init__(self, name: str):
        fd, path = tempfile.mkstemp(prefix=f"zerosim-{name}-", suffix=".log")
        os.close(fd)
        self.path = Path(path)
        self.file = open(path, "ab", buffering=0)  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self._lock:
            if not self.file.closed:
                self.file.write(data)

    def close(self) -> None:
        with self._lock:
            self.file.close()


def run_streamed(command: Sequence[str] | Launch, timeout_s: float, env: dict[str, str], *, log_name: str,
                 kill_grace_s: float = 3.0, is_noise: Callable[[str], bool] | None = None) -> StreamedRun:
    """Run ``command`` like :func:`run_process_group`, its stdout streamed to ours (lines ``is_noise``
    flags, and all after them, to the log instead) and its stderr to the log (see the module docstring).

    Stops the launch when the timeout expires, when this process is interrupted, and when our stdout
    is closed by its reader (``broken_pipe``); whatever way it ends, everything it started is ended
    before this returns (:func:`end_launch`). The launch writes into files, never pipes: its stdout
    into an unnamed temporary file that a reader thread forwards as it grows, its stderr into the log,
    ``zerosim-<log_name>-*.log`` in the temporary folder; the caller removes the log
    (:func:`finish_launch` does) or names it.
    """
    launch = as_launch(command)
    log = _Log(log_name)
    token = new_owner_token()
    start = time.monotonic()
    broken = threading.Event()
    done = threading.Event()
    out_f = tempfile.TemporaryFile()
    try:
        launch.start(env, token, out_f, log.file)
    except BaseException:
        launch.end(token, kill_grace_s)
        out_f.close()
        log.close()
        raise
    lines = _lines_of(out_f.fileno(), done)
    reader = threading.Thread(target=_pump_stdout, args=(lines, log, broken, is_noise), daemon=True)
    reader.start()
    timed_out = False
    interrupted = True
    returncode: int | None = None
    try:
        deadline = start + timeout_s
        while not broken.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            returncode = launch.wait(min(0.1, remaining))
            if returncode is not None:
                break
        interrupted = False
    finally:  # a normal end, the timeout, a closed stdout or KeyboardInterrupt: nothing outlives it
        launch.end(token, kill_grace_s)
        done.set()
        reader.join(_JOIN_S)
        if not reader.is_alive():
            out_f.close()
        log.close()
        if interrupted:
            log.path.unlink(missing_ok=True)
    stopped = timed_out or broken.is_set()
    return StreamedRun(None if stopped else returncode, timed_out, broken.is_set(), log.path,
                       time.monotonic() - start, _messages_in(log.path))


def signal_description(number: int) -> str:
    """``9`` -> ``"signal 9 (SIGKILL)"``."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def death_line(rank: int | str, signal_number: int | None, exit_status: int | None) -> str:
    """``rank R failed: killed by signal 9 (SIGKILL)`` (or ``exited with status N without a message``)."""
    if signal_number is not None:
        how = f"killed by {signal_description(signal_number)}"
    else:
        how = f"exited with status {exit_status} without a message"
    return f"rank {rank} failed: {how}"


def finish_launch(run: StreamedRun, code: int, launcher: str, limit: str,
                  diagnose: Callable[[StreamedRun], str | None]) -> int:
    """Tell the user how a streamed launch ended (one line when it failed) and return its exit status.

    ``code`` is the run's status as the backend read it (0 pass, 1 a contract failed, 2 bad input, else
    failed); ``diagnose(run)`` names a rank that died without a word (``rank R failed: killed by ...``)
    from the launcher's report, or None. ``limit`` describes the launch timeout in its message.
    Raises BrokenPipeError when our stdout was closed (the CLI then exits 141 quietly).
    """
    if run.broken_pipe:
        run.log_path.unlink(missing_ok=True)
        raise BrokenPipeError(errno.EPIPE, "stdout closed by its reader")
    if run.timed_out:
        print(f"error: {launcher} did not finish within {limit} (launch timeout); killed it and its ranks "
              f"({launcher} output: {run.log_path})", file=sys.stderr, flush=True)
        return EXIT_LAUNCH_TIMEOUT
    if code in (0, 1, EXIT_BAD_INPUT):
        for line in run.messages:
            print(line, file=sys.stderr)
        sys.stderr.flush()
        run.log_path.unlink(missing_ok=True)
        return code
    death = diagnose(run)
    lines = [death] if death else list(run.messages)
    if not lines:
        lines = [f"error: the run failed: {launcher} exited with status {run.returncode}, no rank said why"]
    for line in lines[:-1]:
        print(line, file=sys.stderr)
    print(f"{lines[-1]} ({launcher} output: {run.log_path})", file=sys.stderr, flush=True)
    return EXIT_RUN_FAILED
