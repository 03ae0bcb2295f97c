"""What one rank of a distributed run prints: usage errors once, and ``rank R failed: ...``.

Shared by the MPI rank entry point (:mod:`zerosim.mpi`) and the torchrun one (:mod:`zerogpu.rank`),
so a failure reads the same under ``mpiexec`` and ``torchrun``. Serves the "bad input: one line;
a failing rank ends the run non-zero, loudly and once" rule. Pure standard library.

The ``rank R failed: ...`` line comes first and stands alone: a traceback (an error that is not
ours) follows it on later lines, which ``zerosim simulate --backend mpi|torch`` keeps in its log
(:mod:`zerosim.processes.launching`). Under that launcher each rank also leaves its process id in
``$ZEROSIM_RANK_DIR/rank<R>.pid`` (:func:`record_pid`), so a rank killed by a signal can be named
from the launcher's report of the process that died.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any

from ..errors import ZeroSimError

RANK_DIR_ENV = "ZEROSIM_RANK_DIR"


def record_pid(rank: int) -> None:
    """Leave this process's id in ``$ZEROSIM_RANK_DIR/rank<R>.pid`` when the launcher asked for it."""
    folder = os.environ.get(RANK_DIR_ENV)
    if not folder:
        return
    with contextlib.suppress(OSError), open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))


def read_pids(folder: str) -> dict[int, int]:
    """process id -> rank, from the files :func:`record_pid` left in ``folder``."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".pid"):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, name)) as f:
                    out[int(f.read().strip())] = int(name[4:-4])
    return out


def parse_args_on_rank(parser: Any, argv: list[str], rank: int) -> Any:
    """``parser.parse_args(argv)`` on every rank, its messages (usage errors, --help) printed by rank 0 only.
    """
    quiet = open(os.devnull, "w") if rank != 0 else None  # noqa: SIM115 - closed below
    try:
        with contextlib.redirect_stdout(quiet or sys.stdout), contextlib.redirect_stderr(quiet or sys.stderr):
            return parser.parse_args(argv)
    finally:
        if quiet is not None:
            quiet.close()


def rank_failure_message(rank: int, error: BaseException) -> str:
    """``rank R failed: <Type>: <message>``, with the traceback when the error is not ours (a bug)."""
    detail = (
        "" if isinstance(error, ZeroSimError) else "\n" + "".join(traceback.format_exception(error)).rstrip()
    )
    return f"rank {rank} failed: {type(error).__name__}: {error}{detail}"
