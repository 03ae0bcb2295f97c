"""Starting ``mpiexec`` from an ordinary process: ``zerosim simulate --backend mpi``, tests, the bench.

Which ``mpiexec``: ``$ZEROSIM_MPIEXEC`` if set (a command line: ``"mpiexec -f hosts"``,
``"mpirun --oversubscribe"``), else the one next to the running Python (the ``mpich`` wheel puts it
in the virtual environment's ``bin/``), else the first on ``PATH``. The launcher, MPI library and
mpi4py must belong together; a mismatched ``mpiexec`` starts N singletons, which the rank entry
point detects and reports.

Every launch has a wall-clock timeout. ``mpiexec`` runs in its own session (process group); on
timeout the whole group gets SIGTERM, then SIGKILL, so no rank outlives the launch
(:func:`zerosim.processes.launching.run_process_group`, shared with the torchrun launcher).

``zerosim simulate --backend mpi`` (:func:`launch_simulate`) writes the run to one file the ranks
load (:mod:`zerosim.engine.run_file`), streams rank 0's output and ends with
the ranks' own one-line verdict on a failure; MPICH's noise (``Abort(3) on node ...``, the
"BAD TERMINATION" banner it prints on stdout when a rank dies) goes to a log named in that line. A
rank killed by a signal is named from the banner's process id and the ids the ranks recorded
(:func:`zerosim.processes.rank_messages.record_pid`): ``rank 1 failed: killed by signal 9 (SIGKILL)``, exit 3.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..engine.run_file import RUN_FILE_NAME, RankRun, write_rank_run
from ..errors import (
    EXIT_BAD_INPUT,
    EXIT_LAUNCH_TIMEOUT,
    EXIT_RUN_FAILED,
    ConfigError,
    install_hint,
    require_positive_int,
)
from ..processes.launching import (
    death_line,
    finish_launch,
    launch_timeout_from_env,
    require_launch_timeout,
    run_process_group,
    run_streamed,
)
from ..processes.rank_messages import RANK_DIR_ENV, read_pids

_KILL_GRACE_S = 3.0


def find_mpiexec() -> list[str]:
    """The mpiexec command line to use (see the module docstring); ConfigError when there is none."""
    override = os.environ.get("ZEROSIM_MPIEXEC", "").strip()
    if override:
        cmd = shlex.split(override)
        if not shutil.which(cmd[0]):
            raise ConfigError("ZEROSIM_MPIEXEC", override, f"{cmd[0]!r} is not an executable")
        return cmd
    beside_python = Path(sys.executable).parent / "mpiexec"  # not resolved: a venv's bin/, not /usr/bin
    if beside_python.is_file() and os.access(beside_python, os.X_OK):
        return [str(beside_python)]
    on_path = shutil.which("mpiexec")
    if on_path:
        return [on_path]
    raise ConfigError(
        "mpiexec",
        None,
        f"no mpiexec next to {sys.executable} or on PATH; install the MPI extra "
        f"({install_hint('mpi')}, which brings the mpich wheel) or set ZEROSIM_MPIEXEC",
    )


def mpi_unavailable_reason() -> str | None:
    """Why MPI runs cannot happen here (no mpi4py, no mpiexec), or None when they can. For test skips."""
    if importlib.util.find_spec("mpi4py") is None:
        return f"mpi4py is not installed ({install_hint('mpi')})"
    try:
        find_mpiexec()
    except ConfigError as e:
        return str(e)
    return None


def require_mpi4py() -> None:
    """ConfigError unless mpi4py is importable (checked without initialising MPI in this process)."""
    if importlib.util.find_spec("mpi4py") is None:
        raise ConfigError("backend", "mpi", f"needs mpi4py: {install_hint('mpi')}")


@dataclass
class MpiexecResult:
    """What one mpiexec launch did. ``stdout`` / ``stderr`` are None when they went to the terminal."""

    command: list[str]
    returncode: int
    stdout: str | None
    stderr: str | None
    timed_out: bool
    elapsed_s: float


def run_mpiexec(n: int, argv: Sequence[str], timeout_s: float, *, env: dict[str, str] | None = None,
                capture: bool = True, python: str | None = None) -> MpiexecResult:
    """Run ``mpiexec -n n <python> *argv`` with a wall-clock timeout; never leaves processes behind.

    ``argv`` follows the interpreter (``["-m", "zerosim.mpi", "simulate", ...]`` or a script path).
    ``env`` is merged over ``os.environ``. With ``capture=False`` the output goes to this terminal.
    """
    require_positive_int("world_size", n)
    require_launch_timeout(timeout_s)
    require_mpi4py()
    command = [*find_mpiexec(), "-n", str(n), python or sys.executable, *argv]
    run = run_process_group(command, timeout_s, {**os.environ, **(env or {})}, capture=capture,
                            kill_grace_s=_KILL_GRACE_S)
    returncode = EXIT_LAUNCH_TIMEOUT if run.returncode is None else run.returncode
    return MpiexecResult(command, returncode, run.stdout, run.stderr, run.timed_out, run.elapsed_s)


# ---- zerosim simulate --backend mpi ---------------------------------------------------------------

def launch_simulate(job: RankRun) -> int:
    """``zerosim simulate --backend mpi --world-size N``: run ``job`` under ``mpiexec -n N``.

    The run travels as one file: ``run.json`` in a private temporary folder this launch creates (and
    removes), which every rank loads (``python -m zerosim.mpi simulate --config <file>``). The ranks
    print the verdict table / JSON themselves (rank 0); returns mpiexec's exit status: 0 all
    contracts hold, 1 a contract failed, 2 bad input, 3 a rank failed or a collective timed out,
    124 the launch outlived ``$ZEROSIM_LAUNCH_TIMEOUT_S``.
    """
    n = require_positive_int("world_size", job.run.world_size)
    timeout_s = require_launch_timeout(launch_timeout_from_env())
    require_mpi4py()
    with tempfile.TemporaryDirectory(prefix="zerosim-mpi-ranks-") as rank_dir:
        run_file = write_rank_run(job, Path(rank_dir) / RUN_FILE_NAME)
        command = [*find_mpiexec(), "-n", str(n), sys.executable, "-m", "zerosim.mpi", "simulate",
                   "--config", str(run_file)]
        run = run_streamed(command, timeout_s, {**os.environ, RANK_DIR_ENV: rank_dir}, log_name="mpiexec",
                           kill_grace_s=_KILL_GRACE_S, is_noise=is_mpich_banner)
        pids = read_pids(rank_dir)
    code = run.returncode if run.returncode in (0, 1, EXIT_BAD_INPUT) else EXIT_RUN_FAILED
    return finish_launch(run, code, f"mpiexec -n {n}", f"{timeout_s:g}s",
                         lambda r: diagnose_mpich_death(r.log_text(), pids, bool(r.messages)))


# ---- MPICH's report of a rank that died -------------------------------------------------------------

_BANNER_RE = re.compile(r"^={20,}\s*$")
_PID_RE = re.compile(r"PID (\d+) RUNNING AT")
_EXIT_CODE_RE = re.compile(r"EXIT CODE: (\d+)")
_SIGNAL_RE = re.compile(r"EXIT STRING: .*\(signal (\d+)\)")


def is_mpich_banner(line: str) -> bool:
    """The first line of the banner MPICH's mpiexec prints on stdout when a rank terminates badly."""
    return bool(_BANNER_RE.match(line))


def diagnose_mpich_death(log: str, pids: dict[int, int], said_why: bool = False) -> str | None:
    """``rank R failed: killed by signal S (NAME)`` from MPICH's banner in ``log`` and the ranks' process
    ids (``pids``: pid -> rank); None when the log holds no such banner, or when it reports an exit
    status (no signal) and a rank ``said_why`` (its own ``rank R failed: ...`` line is the better one)."""
    pid = _PID_RE.search(log)
    if pid is None:
        return None
    rank: int | str = pids.get(int(pid.group(1)), f"? (pid {pid.group(1)})")
    sig = _SIGNAL_RE.search(log)
    code = _EXIT_CODE_RE.search(log)
    if sig is not None:
        return death_line(rank, int(sig.group(1)), None)
    if said_why:
        return None
    return death_line(rank, None, int(code.group(1)) if code else None)
