"""What the launch tests share: whether a process is alive, and a launcher of two sleeping ranks that a
test kills with SIGKILL to see that no rank outlives it (the "nothing outlives the launch" rule)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: a launcher (``run_ranks``) of two ranks that write their pid into the folder ``argv[1]`` and sleep
SLEEPING_LAUNCHER = """import os, sys
from zerogpu.launch import run_ranks
rank = ("import os, time; d = %r; part = os.path.join(d, '.' + os.environ['RANK']); "
        "open(part, 'w').write(str(os.getpid())); os.replace(part, os.path.join(d, os.environ['RANK'])); "
        "time.sleep(60)")
run_ranks(2, ["-c", rank % sys.argv[1]], 120.0)
"""


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


@contextmanager
def sleeping_launch(folder: Path, env: Mapping[str, str] | None, start_s: float) -> Iterator[
        tuple[subprocess.Popen, list[int]]]:
    """Start :data:`SLEEPING_LAUNCHER` writing into ``folder``; yields it and its two ranks' pids once
    both wrote theirs (each renames its file into place once written). Whatever is left is killed."""
    launcher = subprocess.Popen([sys.executable, "-c", SLEEPING_LAUNCHER, str(folder)], cwd=ROOT,
                                env=None if env is None else dict(env),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + start_s
        while not all((folder / r).exists() for r in ("0", "1")) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids[:] = [int((folder / r).read_text()) for r in ("0", "1")]
        assert all(alive(p) for p in pids)
        yield launcher, pids
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def kill_and_expect_ranks_gone(launcher: subprocess.Popen, pids: list[int], within_s: float,
                               alive_check: Callable[[int], bool] = alive) -> None:
    """SIGKILL ``launcher`` (no handler of its runs) and fail unless every pid has ended ``within_s``."""
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + within_s
    while any(alive_check(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive_check(p)]
    assert not left, f"a rank outlived its launcher by {within_s:g} s: {[_status(p) for p in left]}"


def _status(pid: int) -> str:
    """``pid``, its state and its parent, from /proc (what a failure needs to say which hop failed)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return f"pid {pid} state {fields[0].decode()} parent {fields[1].decode()}"
    except OSError:
        return f"pid {pid} gone"
