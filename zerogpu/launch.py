"""Starting ``torchrun`` from an ordinary process.

Used by ``zerosim simulate --backend torch``, the GPU report and the tests.

``torchrun --standalone`` (``python -m torch.distributed.run``, the interpreter that runs us) on a
free local port, in its own session (process group). Every launch has a wall-clock timeout: on
expiry the whole group (agent and ranks) gets SIGTERM, then SIGKILL, so no rank outlives the launch
(:func:`zerosim.launching.run_process_group`, shared with the mpiexec launcher).

Exit status: torchrun reports any failed worker as 1, whatever the worker's own status. Each rank
writes its status to ``$ZEROGPU_STATUS_DIR/rank<R>`` (:func:`zerogpu.rank.record_status`), and
:func:`run_torchrun` returns the ranks' status instead: 3 if any rank failed (or died without a
word, e.g. killed by a signal), else the highest status a rank wrote (1 a contract failed, 2 bad
input), 124 when the launch outlived its timeout.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerosim.errors import EXIT_LAUNCH_TIMEOUT, EXIT_RUN_FAILED, ConfigError, require_positive_int
from zerosim.launching import (
    launch_timeout_from_env,
    require_launch_timeout,
    run_process_group,
)

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
                 capture: bool = True) -> TorchrunResult:
    """Run ``torchrun --standalone --nproc-per-node n *argv`` with a wall-clock timeout; never leaves
    processes behind. ``argv`` is what follows torchrun's options (``["-m", "zerogpu", "simulate", ...]``).
    ``env`` is merged over ``os.environ`` (``OMP_NUM_THREADS`` defaults to 1: ranks share the cores)."""
    require_positive_int("world_size", n)
    require_launch_timeout(timeout_s)
    command = torchrun_command(n, argv)
    with tempfile.TemporaryDirectory(prefix="zerogpu-status-") as status_dir:
        full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), STATUS_DIR_ENV: status_dir}
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

def launch_simulate(args: argparse.Namespace) -> int:
    """``zerosim simulate --backend torch --world-size N``: the simulation under
    ``torchrun --nproc-per-node N``.

    The ranks print the verdict table / JSON themselves (rank 0); returns the ranks' status: 0 all
    contracts hold, 1 a contract failed, 2 bad input, 3 a rank failed or a collective timed out, 124
    the launch outlived ``$ZEROSIM_LAUNCH_TIMEOUT_S`` (default 900 s). Runs on the CPU with gloo
    (``--device auto`` on the ranks picks CUDA/NCCL where there is a GPU).
    """
    from zerosim.engine.run_args import add_run_arguments
    from zerosim.mpi.launch import forward_argv

    reason = torch_unavailable_reason()
    if reason:
        raise ConfigError("backend", "torch", reason)
    n = require_positive_int("world_size", getattr(args, "world_size", None))
    timeout_s = launch_timeout_from_env()
    argv = ["-m", "zerogpu", "simulate", *forward_argv(args, add_run_arguments, drop=("backend",))]
    result = run_torchrun(n, argv, timeout_s, capture=False)
    if result.timed_out:
        print(f"error: torchrun --nproc-per-node {n} did not finish within {timeout_s:g}s (launch timeout); "
              "killed it and its ranks", file=sys.stderr)
    return result.returncode
