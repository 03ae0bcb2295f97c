"""Starting the ranks of a single-node torch.distributed job from an ordinary process.

Used by ``zerosim verify``, ``zerosim simulate --backend torch``, ``zerosim bench peers``, the GPU
report and the tests. The ranks are started directly (:class:`zerogpu.spawn.RankSpawn`: the
environment ``torchrun --standalone`` gives its workers, the job's store held by this process on a
port the kernel picked), not through a ``torchrun`` process, which saves an interpreter that imports
torch per launch; a rank program runs unchanged under either. Every launch has a wall-clock timeout;
at its end, on expiry or on a stop signal, the ranks (each in a session of its own) and whatever
they started get SIGTERM, then SIGKILL, so nothing outlives the launch
(:func:`zerosim.processes.launching.run_process_group`, shared with the mpiexec launcher).

Exit status: each rank writes its status to ``$ZEROGPU_STATUS_DIR/rank<R>``
(:func:`zerogpu.rank.record_status`; a rank whose status every rank agreed on exits 0, as it did for
torchrun, which took any other exit for a crashed worker), and :func:`run_ranks` returns the ranks'
status: 3 if any rank failed (or died without a word, e.g. killed by a signal), else the highest
status a rank wrote (1 a contract failed, 2 bad input), 124 when the launch outlived its timeout.

``zerosim simulate --backend torch`` (:func:`launch_simulate`) writes the run to one file the ranks
load (:mod:`zerosim.engine.run_file`), streams rank 0's output and ends with the ranks' own one-line
verdict on a failure; the rest of the ranks' standard error (tracebacks) goes to a log named in that
line (:func:`zerosim.processes.launching.run_streamed`). A rank killed by a signal is named from how each rank
ended (:func:`zerogpu.spawn.diagnose_rank_death`): ``rank 1 failed: killed by signal 9 (SIGKILL)``,
exit 3.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from zerosim.engine.run_file import RUN_FILE_NAME, RankRun, write_rank_run
from zerosim.errors import (
    EXIT_LAUNCH_TIMEOUT,
    EXIT_RUN_FAILED,
    ConfigError,
    install_hint,
    require_positive_int,
)
from zerosim.processes.launching import (
    finish_launch,
    launch_timeout_from_env,
    require_launch_timeout,
    run_process_group,
    run_streamed,
)
from zerosim.processes.rank_logs import RANK_LOG_DIR_ENV

from .rank import STATUS_DIR_ENV
from .rank_zygote import torch_distributed_unavailable
from .spawn import RankExits, RankSpawn, TorchUnavailable, diagnose_rank_death, forking_available

_KILL_GRACE_S = 5.0


@dataclass
class RanksResult:
    """What one launch of ranks did. ``stdout`` / ``stderr`` are None when they went to the terminal."""

    command: list[str]  # what each rank ran
    returncode: int  # the ranks' status (see the module docstring)
    launcher_returncode: int | None  # 0 every rank exited 0, 1 one did not, None the launch timed out
    rank_status: dict[int, int]  # what each rank wrote to its status file
    exits: RankExits  # how each rank's process ended
    stdout: str | None
    stderr: str | None
    timed_out: bool
    elapsed_s: float


def ranks_status(launcher_code: int, written: dict[int, int], n: int) -> int:
    """The job's status from the launch's (0: every rank exited 0) and what each rank wrote (see the
    module docstring)."""
    if launcher_code == 0 and all(written.get(r, 0) == 0 for r in range(n)):
        return 0
    if EXIT_RUN_FAILED in written.values() or not written:
        return EXIT_RUN_FAILED
    worst = max(written.values())
    if worst == 0:  # a rank failed although every rank that wrote succeeded: one died silently
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


def run_ranks(n: int, argv: Sequence[str], timeout_s: float, *, env: dict[str, str] | None = None,
              capture: bool = True, rank_log_dir: str | Path | None = None) -> RanksResult:
    """Run ``n`` ranks of ``python -u *argv`` on this node (:class:`zerogpu.spawn.RankSpawn`, what
    ``torchrun --standalone --nproc-per-node n *argv`` runs) with a wall-clock timeout; never leaves
    processes behind, whatever the ranks start. ``argv`` is what follows torchrun's options
    (``["-m", "zerogpu", "simulate", ...]``). ``env`` is merged over ``os.environ`` (``OMP_NUM_THREADS``
    defaults to 1: ranks share the cores). ``rank_log_dir``: the folder (created) where a rank program
    that calls :func:`zerosim.processes.rank_logs.send_output_to_rank_log` (``zerosim.verify`` does) writes
    its output, ``rank<R>.log``, instead of the launch's stdout and stderr."""
    require_positive_int("world_size", n)
    require_launch_timeout(timeout_s)
    spawn = RankSpawn(n, argv)
    _require_torch(spawn.forked)
    spawn.grace_s = _KILL_GRACE_S
    logs: dict[str, str] = {}
    if rank_log_dir is not None:
        Path(rank_log_dir).mkdir(parents=True, exist_ok=True)
        logs[RANK_LOG_DIR_ENV] = str(rank_log_dir)
    with tempfile.TemporaryDirectory(prefix="zerogpu-status-") as status_dir:
        full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {}), **logs, STATUS_DIR_ENV: status_dir}
        try:
            run = run_process_group(spawn, timeout_s, full_env, capture=capture, kill_grace_s=_KILL_GRACE_S)
        except TorchUnavailable as e:
            raise ConfigError("backend", "torch", e.reason) from None
        written = _read_status(status_dir)
    code = EXIT_LAUNCH_TIMEOUT if run.returncode is None else ranks_status(run.returncode, written, n)
    return RanksResult(spawn.command, code, run.returncode, written, spawn.exits, run.stdout, run.stderr,
                       run.timed_out, run.elapsed_s)


def _require_torch(forked: bool) -> None:
    """ConfigError(backend) when no torch.distributed job can run here. ``forked`` ranks: only whether torch
    is installed (no import); the forking process reports a torch.distributed it cannot import, which
    the launch turns into the same error (:class:`zerogpu.spawn.TorchUnavailable`). Otherwise: the
    full check (this process imports torch.distributed for the job's store anyway)."""
    reason = torch_missing_reason() if forked else torch_unavailable_reason()
    if reason:
        raise ConfigError("backend", "torch", reason)


def torch_missing_reason() -> str | None:
    """Why no launch can happen here because torch is not installed, or None; imports nothing, so a
    launcher checks it before its other options at no cost. Whether the installed torch has a working
    torch.distributed is :func:`torch_unavailable_reason`'s (asked before the ranks start when this
    process opens the job's store, else by the process that forks the ranks)."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed (No module named 'torch'); {install_hint('torch')}"
    return None


def torch_unavailable_reason() -> str | None:
    """Why torchrun launches cannot happen here (no torch.distributed), or None; imports
    torch.distributed. For test skips."""
    return torch_distributed_unavailable()


# ---- zerosim simulate --backend torch ------------------------------------------------------------

def launch_simulate(job: RankRun) -> int:
    """``zerosim simulate --backend torch --world-size N``: run ``job`` on N ranks (:func:`run_ranks`'s way).

    The run travels as one file: ``run.json`` in a private temporary folder this launch creates (and
    removes), which every rank loads (``-m zerogpu simulate --config <file>``). The ranks print the
    verdict table / JSON themselves (rank 0); returns the ranks' status: 0 all contracts hold, 1 a
    contract failed, 2 bad input, 3 a rank failed or a collective timed out, 124 the launch outlived
    ``$ZEROSIM_LAUNCH_TIMEOUT_S`` (default 900 s). Runs on the CPU with gloo (the run file's device
    ``auto`` picks CUDA/NCCL on the ranks where there is a GPU).
    """
    _require_torch(forking_available())
    n = require_positive_int("world_size", job.run.world_size)
    timeout_s = launch_timeout_from_env()
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    if sys.stdout.isatty():  # the ranks write into a pipe to this process: keep the terminal's width
        env.setdefault("COLUMNS", str(shutil.get_terminal_size().columns))
    with tempfile.TemporaryDirectory(prefix="zerogpu-status-") as status_dir:
        run_file = write_rank_run(job, Path(status_dir) / RUN_FILE_NAME)
        spawn = RankSpawn(n, ["-m", "zerogpu", "simulate", "--config", str(run_file)])
        spawn.grace_s = _KILL_GRACE_S
        try:
            run = run_streamed(spawn, timeout_s, {**env, STATUS_DIR_ENV: status_dir},
                               log_name="ranks", kill_grace_s=_KILL_GRACE_S)
        except TorchUnavailable as e:
            raise ConfigError("backend", "torch", e.reason) from None
        written = _read_status(status_dir)
    code = EXIT_RUN_FAILED if run.returncode is None else ranks_status(run.returncode, written, n)
    return finish_launch(run, code, f"the {n} torch ranks", f"{timeout_s:g}s",
                         lambda r: diagnose_rank_death(spawn.exits, bool(r.messages)))
