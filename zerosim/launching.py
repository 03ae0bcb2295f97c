"""Running a launcher (``mpiexec``, ``torchrun``) as a process group with a wall-clock timeout.

Shared by :mod:`zerosim.mpi.launch` and :mod:`zerogpu.launch` (distributed runs never hang): the
launcher runs in its own session (process group); when the launch outlives its timeout, or this
process is interrupted, the whole group (launcher, proxies / agent, ranks) gets SIGTERM, then
SIGKILL, so no rank outlives the launch. Pure standard library: no MPI, no torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import ConfigError

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


@dataclass
class GroupRun:
    """What one process-group launch did. ``stdout`` / ``stderr`` are None when they went to the terminal;
    ``returncode`` is the launcher's own status, None when it outlived the timeout (and was killed)."""

    returncode: int | None
    stdout: str | None
    stderr: str | None
    timed_out: bool
    elapsed_s: float


def run_process_group(command: Sequence[str], timeout_s: float, env: dict[str, str], *, capture: bool = True,
                      kill_grace_s: float = 3.0) -> GroupRun:
    """Run ``command`` (with exactly ``env``) in its own session with a wall-clock timeout; never
    leaves processes behind: on timeout or on any exception here (KeyboardInterrupt) the group is killed."""
    pipe = subprocess.PIPE if capture else None
    start = time.monotonic()
    proc = subprocess.Popen(
        list(command), stdout=pipe, stderr=pipe, text=True, env=env, start_new_session=True
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_process_group(proc, kill_grace_s)
        out, err = proc.communicate()
    except BaseException:  # KeyboardInterrupt: take the ranks down with us
        kill_process_group(proc, kill_grace_s)
        raise
    return GroupRun(None if timed_out else proc.returncode, out, err, timed_out, time.monotonic() - start)
