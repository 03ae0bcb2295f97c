"""Starting ``mpiexec`` from an ordinary process: ``zerosim simulate --backend mpi``, tests, the bench.

Which ``mpiexec``: ``$ZEROSIM_MPIEXEC`` if set (a command line: ``"mpiexec -f hosts"``,
``"mpirun --oversubscribe"``), else the one next to the running Python (the ``mpich`` wheel puts it
in the virtual environment's ``bin/``), else the first on ``PATH``. The launcher, MPI library and
mpi4py must belong together; a mismatched ``mpiexec`` starts N singletons, which the rank entry
point detects and reports.

Every launch has a wall-clock timeout. ``mpiexec`` runs in its own session (process group); on
timeout the whole group gets SIGTERM, then SIGKILL, so no rank outlives the launch
(:func:`zerosim.launching.run_process_group`, shared with the torchrun launcher).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import EXIT_LAUNCH_TIMEOUT, ConfigError, require_positive_int
from ..launching import (
    launch_timeout_from_env,
    require_launch_timeout,
    run_process_group,
)

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
        "(pip install 'zerosim[mpi]', which brings the mpich wheel) or set ZEROSIM_MPIEXEC",
    )


def mpi_unavailable_reason() -> str | None:
    """Why MPI runs cannot happen here (no mpi4py, no mpiexec), or None when they can. For test skips."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install 'zerosim[mpi]')"
    try:
        find_mpiexec()
    except ConfigError as e:
        return str(e)
    return None


def require_mpi4py() -> None:
    """ConfigError unless mpi4py is importable (checked without initialising MPI in this process)."""
    if importlib.util.find_spec("mpi4py") is None:
        raise ConfigError("backend", "mpi", "needs mpi4py: pip install 'zerosim[mpi]'")


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

def forward_argv(args: argparse.Namespace, add_arguments: Callable[[argparse.ArgumentParser], None],
                 drop: Sequence[str] = ("backend",)) -> list[str]:
    """Rebuild the command-line options that produce ``args`` (the options ``add_arguments`` defines).

    Options at their default are left out; ``drop`` names destinations not to forward. The rank
    entry point parses the result with the same ``add_arguments``, so both sides agree by construction.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    out: list[str] = []
    for action in parser._actions:  # argparse exposes no public iterator over its actions
        if not action.option_strings or action.dest in drop or not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        if isinstance(action, argparse._StoreConstAction):  # store_true / store_false / store_const
            if value == action.const:
                out.append(flag)
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else flag.replace("--", "--no-", 1))
            continue
        if isinstance(action, argparse._AppendAction):
            for item in value or []:
                out.extend([flag, *(str(v) for v in item)] if isinstance(item, list) else [flag, str(item)])
            continue
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            out.extend([flag, *(str(v) for v in value)])
        else:
            out.extend([flag, str(value)])
    return out


def launch_simulate(args: argparse.Namespace) -> int:
    """``zerosim simulate --backend mpi --world-size N``: run the simulation under ``mpiexec -n N``.

    The ranks print the verdict table / JSON themselves (rank 0); returns mpiexec's exit status: 0
    all contracts hold, 1 a contract failed, 2 bad input, 3 a rank failed or a collective timed out,
    124 the launch outlived ``--launch-timeout``.
    """
    from ..engine.run_args import add_run_arguments

    n = require_positive_int("world_size", getattr(args, "world_size", None))
    timeout_s = getattr(args, "launch_timeout", None) or launch_timeout_from_env()
    argv = ["-m", "zerosim.mpi", "simulate", *forward_argv(args, add_run_arguments, drop=("backend",))]
    result = run_mpiexec(n, argv, timeout_s, capture=False)
    if result.timed_out:
        print(
            f"error: mpiexec -n {n} did not finish within {timeout_s:g}s (launch timeout); killed it and its "
            "ranks",
            file=sys.stderr,
        )
    return result.returncode
