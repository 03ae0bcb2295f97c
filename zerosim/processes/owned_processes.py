"""Every process a command started, found and ended wherever it went.

A launch starts a launcher (``mpiexec``) or each torch rank (:mod:`zerogpu.spawn`) in a session of
its own, but what runs under it may leave that session: a trainer may start children of its own
that outlive their rank, in sessions of their own. So each launch (and each ``zerosim`` command) draws a
fresh owner token and adds it to ``$ZEROSIM_OWNER_TOKENS`` in the environment it starts processes
with. Every descendant inherits the variable, whichever session or process group it ends up in, and
:func:`end_owned` ends them all: SIGTERM, a grace period, then SIGKILL, until none carries the token.
On Linux the processes are found through ``/proc/<pid>/environ`` (this user's processes only);
elsewhere :func:`owned_pids` finds none and the launchers fall back to their process group.

:func:`parent_death_preexec` covers the one case no handler can: this process killed by SIGKILL.
Each process it starts directly (``mpiexec``, a torch rank) asks the kernel
(``prctl(PR_SET_PDEATHSIG)``) for SIGTERM when its parent dies, and mpiexec stops its ranks on SIGTERM.

Serves the "distributed runs never hang; nothing outlives the command" rule. Pure standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable, Mapping

OWNER_ENV = "ZEROSIM_OWNER_TOKENS"
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


def new_owner_token() -> str:
    """A token no other launch holds (``zerosim-<16 hex digits>``)."""
    return f"zerosim-{secrets.token_hex(8)}"


def with_owner_token(env: Mapping[str, str], token: str) -> dict[str, str]:
    """A copy of ``env`` whose ``$ZEROSIM_OWNER_TOKENS`` also holds ``token`` (tokens already there stay,
    so a command started by another command is still found by the outer one)."""
    held = env.get(OWNER_ENV, "").split()
    return {**env, OWNER_ENV: " ".join([*held, token])}


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie has ended; its parent or init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != b"Z"


def owned_pids(token: str) -> list[int]:
    """The running processes of this user (this one excluded) whose environment holds ``token``.

    Linux only (``/proc``); an empty list elsewhere."""
    if not sys.platform.startswith("linux"):
        return []
    me, uid = os.getpid(), os.getuid()
    prefix = f"{OWNER_ENV}=".encode()
    out: list[int] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
        except OSError:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        for entry in environ.split(b"\0"):
            if entry.startswith(prefix) and token in entry[len(prefix):].decode("ascii", "replace").split():
                if _running(pid):
                    out.append(pid)
                break
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def end_owned(token: str, grace_s: float, *, also: Callable[[int], None] | None = None,
              max_rounds: int = 5) -> list[int]:
    """End every process holding ``token``: SIGTERM, up to ``grace_s`` for them to go, then SIGKILL;
    repeated (at most ``max_rounds`` times) while new ones appear (a process that forked meanwhile).

    ``also(sig)`` is called with each signal first (a launcher's process group). Returns the process
    ids that were signalled, for the caller's message; an empty list when nothing was left."""
    ended: list[int] = []
    for _ in range(max_rounds):
        pids = owned_pids(token)
        if also is not None:
            also(signal.SIGTERM)
        if not pids:
            return ended
        ended.extend(p for p in pids if p not in ended)
        _signal_all(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(_POLL_S)
        if also is not None:
            also(signal.SIGKILL)
        _signal_all([p for p in pids if _running(p)], signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_running(p) for p in pids):
            time.sleep(_POLL_S)
    return ended


def parent_death_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send SIGTERM to the new process when this one dies (Linux:
    ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through ctypes); None where that is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
