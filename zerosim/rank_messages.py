"""What one rank of a distributed run prints: usage errors once, and ``rank R failed: ...``.

Shared by the MPI rank entry point (:mod:`zerosim.mpi`) and the torchrun one (:mod:`zerogpu.rank`),
so a failure reads the same under ``mpiexec`` and ``torchrun``. Serves the "bad input: one line;
a failing rank ends the run non-zero, loudly and once" rule. Pure standard library.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any

from .errors import ZeroSimError


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
