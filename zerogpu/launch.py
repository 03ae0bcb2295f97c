"""Starting ``torchrun`` from an ordinary process.

Used by ``zerosim simulate --backend torch``, the GPU report and the tests.

``torchrun --standalone`` (``python -m torch.distributed.run``, the interpreter that runs us) on a
free local port, in its own session (process group). Every launch has a wall-clock timeout; at its
end, on expiry or on a stop signal, the agent, the ranks (each in a session of its own) and whatever
they started get SIGTERM, then SIGKILL, so nothing outlives the launch
(:func:`zerosim.launching.run_process_group`, shared with the mpiexec launcher).

Exit status: torchrun reports any failed worker as 1, whatever the worker's own status. Each rank
writes its status to ``$ZEROGPU_STATUS_DIR/rank<R>`` (:func:`zerogpu.rank.record_status`), and
:func:`run_torchrun` returns the ranks' status instead: 3 if any rank failed (or died without a
word, e.g. killed by a signal), else the highest status a rank wrote (1 a contract failed, 2 bad
input), 124 when the launch outlived its timeout.

``zerosim simulate --backend torch`` (:func:`launch_simulate`) writes the run to one file the ranks
load (:mod:`zerosim.engine.run_file`), streams rank 0's output and ends with
the ranks' own one-line verdict on a failure; torchrun's noise (its warnings, the ``ChildFailedError``
summary) goes to a log named in that line (:func:`zerosim.launching.run_streamed`). A rank killed by
a signal is named from torchrun's summary: ``rank 1 failed: killed by signal 9 (SIGKILL)``, exit 3.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerosim.engine.run_file import RUN_FILE_NAME, RankRun, write_rank_run
from zerosim.errors import EXIT_LAUNCH_TIMEOUT, EXIT_RUN_FAILED, ConfigError, require_positive_int
from zerosim.launching import (
    death_line,
    finish_launch,
    launch_timeout_from_env,
    require_launch_timeout,
    run_process_group,
    run_streamed,
)
from zerosim.rank_logs import RANK_LOG_DIR_ENV

from .rank import STATUS_DIR_ENV

_KILL_GRACE_S = 5.0


@dataclass
class TorchrunResult:
    """What one torchrun launch did. ``stdout`` / ``stderr`` are None when they went to the terminal."""

    command: list[str]
    returncode: int  # the ranks' status (see the module docstring), not torchrun's
    torchrun_returncode: int | None
    rank_status: dict[int, int]
    stdout: str | None
    stderr: str | None
    timed_out: bool
    elapsed_s: float


def torchrun_command(n: int, argv: Sequence[str], python: str | None = None) -> list[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node n *argv``."""
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "--max-restarts",
        "0",
        *argv,
    ]


def ranks_status(torchrun_code: int, written: dict[int, int], n: int) -> int:
    """The job's status from torchrun's and what each rank wrote (see the module docstring)."""
    if torchrun_code == 0 and all(written.get(r, 0) == 0 for r in range(n)):
        return 0
    if EXIT_RUN_FAILED in written.values() or not written:
        return EXIT_RUN_FAILED
    worst = max(written.values())
    if worst == 0:  # torchrun failed although every rank that wrote succeeded: one died silently
        return EXIT_RUN_FAILED
    return worst


def _read_status(folder: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in Path(folder).glob("rank*"):
        try:
            out[int(p.name[4:])] = int(p.read_text().strip())
        except ValueError:
            continue
    return out


def run_torchrun(n: int, argv: Sequence[str], timeout_s: float, *, env: dict[str, str] | None = None,
                 capture: bool = True, rank_log_dir: str | Path | None = None) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc-per-node n *argv`` with a wall-clock timeout; never leaves
    processes behind, whatever the ranks start. ``argv`` is what follows torchrun's options
    (``["-m", "zerogpu", "simulate", ...]``). ``env`` is merged over ``os.environ`` (``OMP_NUM_THREADS``
    defaults to 1: ranks share the cores). ``rank_log_dir``: the folder (created) where a rank program
    that calls :func:`zerosim.rank_logs.send_output_to_rank_log` (``zerosim.verify`` does) writes its
    output, ``rank<R>.log``, instead of torchrun's stdout and stderr."""
    require_positive_int("world_size", n)
    require_launch_timeout(timeout_s)
    command = torchrun_command(n, argv)
    logs: dict[str, str] = {}
    if rank_log_dir is not None:
        Path(rank_log_dir).mkdir(parents=True, exist_ok=True)
        logs[RANK_LOG_DIR_ENV] = str(rank_log_dir)
    with tempfile.TemporaryDirectory(prefix="zerogpu-status-") as status_dir:
        full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), **logs, STATUS_DIR_ENV: status_dir}
        run = run_process_group(command, timeout_s, full_env, capture=capture, kill_grace_s=_KILL_GRACE_S)
        written = _read_status(status_dir)
    code = EXIT_LAUNCH_TIMEOUT if run.returncode is None else ranks_status(run.returncode, written, n)
    return TorchrunResult(command, code, run.returncode, written, run.stdout, run.stderr, run.timed_out,
                          run.elapsed_s)


def torch_unavailable_reason() -> str | None:
    """Why torchrun launches cannot happen here (no torch.distributed), or None. For test skips."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        return f"torch is not installed ({e}); pip install 'zerosim[torch]'"
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None


# ---- zerosim simulate --backend torch ------------------------------------------------------------

def launch_simulate(job: RankRun) -> int:
    """``zerosim simulate --backend torch --world-size N``: run ``job`` under ``torchrun --nproc-per-node N``.

    The run travels as one file: ``run.json`` in a private temporary folder this launch creates (and
    removes), which every rank loads (``-m zerogpu simulate --config <file>``). The ranks print the
    verdict table / JSON themselves (rank 0); returns the ranks' status: 0 all contracts hold, 1 a
    contract failed, 2 bad input, 3 a rank failed or a collective timed out, 124 the launch outlived
    ``$ZEROSIM_LAUNCH_TIMEOUT_S`` (default 900 s). Runs on the CPU with gloo (the run file's device
    ``auto`` picks CUDA/NCCL on the ranks where there is a GPU).
    """
    reason = torch_unavailable_reason()
    if reason:
        raise ConfigError("backend", "torch", reason)
    n = require_positive_int("world_size", job.run.world_size)
    timeout_s = launch_timeout_from_env()
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if sys.stdout.isatty():  # the ranks write into a pipe to this process: keep the terminal's width
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    with tempfile.TemporaryDirectory(prefix="zerogpu-status-") as status_dir:
        run_file = write_rank_run(job, Path(status_dir) / RUN_FILE_NAME)
        argv = ["-m", "zerogpu", "simulate", "--config", str(run_file)]
        run = run_streamed(torchrun_command(n, argv), timeout_s, {**env, STATUS_DIR_ENV: status_dir},
                           log_name="torchrun", kill_grace_s=_KILL_GRACE_S)
        written = _read_status(status_dir)
    code = EXIT_RUN_FAILED if run.returncode is None else ranks_status(run.returncode, written, n)
    return finish_launch(run, code, f"torchrun --nproc-per-node {n}", f"{timeout_s:g}s",
                         lambda r: diagnose_torchrun_death(r.log_text(), bool(r.messages)))


# ---- torchrun's report of a rank that died ------------------------------------------------------------

_FAILURE_RE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def torchrun_failures(log: str) -> dict[int, int]:
    """rank -> exit code of every worker torchrun's failure summary in ``log`` lists (negative: the
    signal that killed it); empty when there is no summary. A worker that exited 0 is never listed."""
    out: dict[int, int] = {}
    for r, c in _FAILURE_RE.findall(log):
        out.setdefault(int(r), int(c))
    return out


def diagnose_torchrun_death(log: str, said_why: bool = False) -> str | None:
    """``rank R failed: killed by signal S (NAME)`` from torchrun's failure summary in ``log``.

    The summary's root cause (the first failure torchrun observed) when it died by a signal; else a
    rank that died by a signal other than SIGTERM (torchrun's own way of stopping the survivors) when
    a peer noticed first; else, when no rank ``said_why``, the root cause's exit status; else None.
    """
    head, sep, root_part = log.partition("Root Cause")
    failures = [(int(r), int(c)) for r, c in _FAILURE_RE.findall(head)]
    root = [(int(r), int(c)) for r, c in _FAILURE_RE.findall(root_part)] if sep else []
    if root and root[0][1] < 0:
        return death_line(root[0][0], -root[0][1], None)
    killed = [(r, c) for r, c in root + failures if c < 0 and -c != 15]
    if killed:
        return death_line(killed[0][0], -killed[0][1], None)
    if root and not said_why:
        return death_line(root[0][0], None, root[0][1])
    return None
