"""The failure policy of one torchrun rank: a failing rank ends the whole job, loudly and once.

A rank that raises prints ``rank R failed: <Type>: <message>`` on stderr (a traceback too when the
error is not one of ours, i.e. a bug) and leaves at once with :data:`EXIT_RUN_FAILED` through
``os._exit`` (no process-group teardown that could block on a dead peer). Its peers then fail
fast: gloo reports "connection closed by peer" in their next collective, and torchrun's agent
stops the remaining workers as soon as one exits non-zero. Ranks that fail together (the same
error on every rank, a collective that times out on every rank that arrived) agree through the
job's store who prints: the first to claim it (:meth:`zerogpu.progress.ProgressBoard.claim_report`).
Serves the "distributed runs never hang; a failing rank ends the run non-zero" rule.

Exit statuses (the same as ``zerosim simulate`` and the MPI backend): 0 every contract holds,
1 a contract failed, 2 bad input (printed once, by rank 0, before any process group exists),
3 a rank failed or a collective timed out. torchrun itself reports any worker failure as exit 1, so
each rank also writes its status to ``$ZEROGPU_STATUS_DIR/rank<R>`` when that is set;
:mod:`zerogpu.launch` reads them back to return the real status.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from zerosim.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILED, ZeroSimError
from zerosim.processes.rank_messages import parse_args_on_rank, rank_failure_message

STATUS_DIR_ENV = "ZEROGPU_STATUS_DIR"


def env_rank() -> int:
    """This process's global rank from torchrun's environment (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def record_status(code: int) -> None:
    """Leave this rank's exit status where the launcher looks (``$ZEROGPU_STATUS_DIR``), if it asked."""
    folder = os.environ.get(STATUS_DIR_ENV)
    if not folder:
        return
    with contextlib.suppress(OSError):
        with open(os.path.join(folder, f"rank{env_rank()}"), "w") as f:
            f.write(str(int(code)))


def agreed_exit(code: int) -> int:
    """The process exit status for a status every rank agreed on (0 pass, 1 contract failed, 2 bad input).

    Under our launcher (``$ZEROGPU_STATUS_DIR`` set) the status is in the status file, so the process
    exits 0: torchrun would otherwise take an agreed "contract failed" for a crashed worker, SIGTERM
    the ranks still exiting and print its failure summary. Under a bare torchrun: ``code`` itself."""
    return 0 if os.environ.get(STATUS_DIR_ENV) else code


def parse_once(parser: Any, argv: list[str]) -> Any:
    """argparse on every rank, its messages (usage errors, --help) printed by rank 0 only."""
    return parse_args_on_rank(parser, argv, env_rank())


def fail_on_bad_input(error: ZeroSimError) -> NoReturn:
    """Bad input found by every rank alike (validation is deterministic): rank 0 prints, all exit 2."""
    if env_rank() == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    record_status(EXIT_BAD_INPUT)
    sys.exit(agreed_exit(EXIT_BAD_INPUT))


def report_failure(error: BaseException) -> None:
    """Print ``rank R failed: ...`` if this rank is the first failed rank of the job."""
    from .comm import current_job

    job = current_job()
    rank = job.world_rank if job is not None else env_rank()
    reporter = True if job is None else job.board.claim_report()
    if not reporter:
        return
    print(rank_failure_message(rank, error), file=sys.stderr, flush=True)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def run_rank(body: Callable[[], int]) -> NoReturn:
    """Run ``body`` on this rank; exit with its status, or end the job if it raises."""
    try:
        code = int(body() or 0)
    except SystemExit as e:
        if e.code in (0, None):
            _finish(0)
        code = e.code if isinstance(e.code, int) else EXIT_RUN_FAILED
        record_status(code)
        leave_rank(code)
    except KeyboardInterrupt:
        record_status(130)
        leave_rank(130)
    except BaseException as e:  # noqa: BLE001 - any failure of any rank must end every rank
        record_status(EXIT_RUN_FAILED)
        report_failure(e)
        leave_rank(EXIT_RUN_FAILED)
    _finish(code)


def leave_rank(code: int) -> NoReturn:
    """Exit a torchrun rank: flush, then ``os._exit``. There is no teardown that could block on a
    dead peer, and none after a normal end, whose process group is already torn down. (A normal
    interpreter exit is safe too since the progress board's thread is stopped and joined before the
    interpreter finalizes, :mod:`zerogpu.progress`: a thread left inside a store call aborted the
    process now and then, ``terminate called without an active exception``.)"""
    _flush()
    os._exit(code)


def _finish(code: int) -> NoReturn:
    """Normal end: tear the process group down (every rank got here, so nothing blocks) and leave
    (:func:`leave_rank`)."""
    import torch.distributed as dist

    from .comm import current_job

    record_status(code)
    job = current_job()
    if job is not None:
        job.board.stop()
    with contextlib.suppress(Exception):
        if dist.is_initialized():
            dist.destroy_process_group()
    leave_rank(agreed_exit(code))
