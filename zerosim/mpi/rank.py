"""The failure policy of one MPI rank: a failing rank ends the whole job, loudly and once.

A rank that raises prints ``rank R failed: <Type>: <message>`` on stderr (a traceback too when the
error is not one of ours, i.e. a bug) and calls ``MPI_Abort`` on the world: every other rank is
killed and ``mpiexec`` exits with :data:`EXIT_RUN_FAILED`. An error several ranks raise at once (the
same bad gradient seen by every rank, a collective that timed out on every rank that arrived) is
printed only by the lowest of them: the failed ranks agree over the watchdog's private channel.
Serves the "distributed runs never hang; a failing rank ends the run non-zero" rule.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import NoReturn

from ..errors import EXIT_RUN_FAILED
from ..processes.rank_messages import rank_failure_message


def run_rank(body: Callable[[], int]) -> NoReturn:
    """Run ``body`` on this rank; exit with its status, or abort the world if it raises."""
    from mpi4py import MPI

    from ..comm.mpi_watchdog import abort_world, is_failure_reporter

    try:
        code = int(body() or 0)
    except BaseException as e:  # noqa: BLE001 - any failure of any rank must end every rank
        if isinstance(e, SystemExit) and e.code in (0, None):
            sys.exit(0)
        rank = MPI.COMM_WORLD.Get_rank()
        if is_failure_reporter():
            abort_world(rank_failure_message(rank, e), EXIT_RUN_FAILED)
        time.sleep(3.0)  # the reporting rank aborts the world; make sure the job ends regardless
        abort_world("", EXIT_RUN_FAILED)
    sys.exit(code)
