"""The launcher wrapper shared by ``--backend mpi`` and ``--backend torch``: a wall-clock timeout that
takes the whole process group down, and a clear error for a bad ``$ZEROSIM_LAUNCH_TIMEOUT_S``."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from zerosim.errors import ConfigError
from zerosim.processes.launching import DEFAULT_LAUNCH_TIMEOUT_S, launch_timeout_from_env, run_process_group


def test_a_launch_that_outlives_its_timeout_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "child.pid"
    # the launcher starts a grandchild that would sleep for a minute; both must be gone afterwards
    script = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    run = run_process_group(
        [sys.executable, "-c", script], timeout_s=6, env=dict(os.environ), kill_grace_s=0.5
    )
    assert run.timed_out and run.returncode is None and run.elapsed_s < 20
    child = int(pidfile.read_text())  # written long before the timeout, even on a loaded machine
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:  # SIGKILL is asynchronous
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_launch_within_its_timeout_returns_its_status_and_output():
    run = run_process_group([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], timeout_s=30,
                            env=dict(os.environ))
    assert not run.timed_out and run.returncode == 3 and run.stdout.strip() == "hi"


@pytest.mark.parametrize("text", ["abc", "0", "-1", "inf", "nan"])
def test_a_bad_launch_timeout_in_the_environment_names_the_variable(monkeypatch, text):
    monkeypatch.setenv("ZEROSIM_LAUNCH_TIMEOUT_S", text)
    with pytest.raises(ConfigError, match="ZEROSIM_LAUNCH_TIMEOUT_S"):
        launch_timeout_from_env()


def test_the_launch_timeout_defaults_and_reads_the_environment(monkeypatch):
    monkeypatch.delenv("ZEROSIM_LAUNCH_TIMEOUT_S", raising=False)
    assert launch_timeout_from_env() == DEFAULT_LAUNCH_TIMEOUT_S
    monkeypatch.setenv("ZEROSIM_LAUNCH_TIMEOUT_S", "12.5")
    assert launch_timeout_from_env() == 12.5
