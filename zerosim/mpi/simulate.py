"""The MPI backend's one rank entry point for ``simulate``: load the run, agree it is valid, run it.

Every rank loads the same :class:`~zerosim.engine.run_file.RankRun` (from the run file the launcher
wrote, or from the options a user gave ``python -m zerosim.mpi simulate``), checks it against the
world mpiexec started, runs the engine's SPMD program (:func:`zerosim.engine.spmd.rank_program`) on an
:class:`~zerosim.comm.mpi.MpiCommunicator` over ``MPI_COMM_WORLD`` and sends its observations to
rank 0, which evaluates the contracts and prints the verdict table / JSON. Exit status, the same on
every rank: 0 every contract holds, 1 a contract failed, 2 bad input (printed once), 3 a rank failed
or a collective timed out (``rank R failed: ...`` printed once, then ``MPI_Abort``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from ..engine.run_file import RankRun
from ..errors import EXIT_BAD_INPUT, ConfigError, ZeroSimError
from ..files import datafile
from ..processes.rank_messages import record_pid
from .rank import run_rank

#: the MPI timeout mode of ranks whose run does not name one (abort or raise, :mod:`zerosim.comm.mpi`)
TIMEOUT_MODE_ENV = "ZEROSIM_MPI_TIMEOUT_MODE"


def agree_on_config_error(world: Any, error: ZeroSimError | None) -> None:
    """Every rank validates the run; if any rank failed, the lowest such rank prints, all exit 2."""
    from mpi4py import MPI

    mine = np.array([world.Get_rank() if error is not None else world.Get_size()], dtype=np.int64)
    lowest = np.empty(1, dtype=np.int64)
    world.Allreduce(mine, lowest, MPI.MIN)
    if lowest[0] == world.Get_size():
        return
    if lowest[0] == world.Get_rank():
        print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def check_world_size(world_size: int, size: int) -> None:
    """ConfigError unless the run's ``world_size`` is the number of ranks mpiexec started."""
    if world_size == size:
        return
    hint = (
        " (every rank sees a world of 1: is this mpiexec from the MPI library mpi4py was built for? "
        "see docs/backends-and-launching.md, 'Using a system MPI')"
        if size == 1
        else f"; run mpiexec -n {world_size} or drop --world-size"
    )
    raise ConfigError("world_size", world_size, f"mpiexec started {size} rank(s){hint}")


def simulate_rank(load: Callable[[int], RankRun]) -> NoReturn:
    """Run one rank of ``simulate``. ``load(world size)`` returns the run (a ConfigError on bad input,
    agreed by every rank before anything starts)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    record_pid(world.Get_rank())
    job, error = None, None
    try:
        job = load(world.Get_size())
        check_world_size(job.run.world_size, world.Get_size())
        job.run.validate()
    except ZeroSimError as e:
        error = e
    agree_on_config_error(world, error)
    assert job is not None  # every rank loaded it, or every rank has exited
    run_rank(lambda: run_job(world, job))


def run_job(world: Any, job: RankRun) -> int:
    """One validated run on every rank of ``world``: the engine's SPMD program on an
    :class:`~zerosim.comm.mpi.MpiCommunicator`, the observations gathered on rank 0, saved where the run
    says and judged there; returns the exit status (0 every contract holds, 1 one failed), the same on
    every rank."""
    from ..comm.mpi import MpiCommunicator
    from ..engine.run_output import render
    from ..engine.run_result import evaluate
    from ..engine.spmd import rank_program

    run, save = job.run, job.save_observations
    mode = job.option("timeout_mode", os.environ.get(TIMEOUT_MODE_ENV, "abort"))
    comm = MpiCommunicator(world, timeout_s=run.timeout_s, timeout_mode=mode)
    observation = rank_program(comm, run)
    observations = world.gather(observation, root=0)  # once per run, not the data path
    code = 0
    if world.Get_rank() == 0:
        assert observations is not None  # gather's root holds every rank's
        if save is not None:
            datafile.save(save, observations)
        code = render(evaluate(run, observations), job.json_output)
    return int(world.bcast(code, root=0))
