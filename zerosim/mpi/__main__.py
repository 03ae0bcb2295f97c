"""``mpiexec -n N python -m zerosim.mpi simulate [options]``: the reference engine, one process per rank.

Every rank parses the same options as ``zerosim simulate`` (``zerosim.cli.simulate.add_run_arguments``),
runs the engine's SPMD program (``zerosim.engine.spmd.rank_program``) on an :class:`MpiCommunicator`
over ``MPI_COMM_WORLD``, and sends its observations to rank 0, which evaluates the contracts and
prints the same verdict table / JSON as the in-process simulator. Exit status, the same on every
rank: 0 every contract holds, 1 a contract failed, 2 bad input (printed once), 3 a rank failed or a
collective timed out (``rank R failed: ...`` printed once, then ``MPI_Abort``).

MPI-only options: ``--timeout-mode abort|raise`` (how a collective timeout is detected, see
:mod:`zerosim.comm.mpi`; default ``$ZEROSIM_MPI_TIMEOUT_MODE`` or ``abort``) and
``--save-observations PATH`` (rank 0 stores the observations of every rank, :mod:`zerosim.datafile`).
The collective
timeout itself is the run's ``timeout_s`` (``--timeout`` of ``zerosim simulate``). ``--world-size``
defaults to the number of ranks mpiexec started; a different value is an error.

``python -m zerosim.mpi bench-worker ...`` is the inside of ``zerosim bench mpi`` (not for direct use).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import datafile
from ..errors import EXIT_BAD_INPUT, ConfigError, ZeroSimError
from ..rank_messages import parse_args_on_rank, record_pid
from .rank import run_rank

USAGE = "usage: mpiexec -n N python -m zerosim.mpi simulate [zerosim simulate options]"


def build_parser() -> argparse.ArgumentParser:
    from ..comm.mpi import TIMEOUT_MODES
    from ..engine.run_args import add_run_arguments

    parser = argparse.ArgumentParser(
        prog="mpiexec -n N python -m zerosim.mpi simulate",
        description="Run the reference engine under MPI; rank 0 prints the verdicts.",
    )
    add_run_arguments(parser)
    parser.set_defaults(world_size=None)  # default: the number of ranks mpiexec started
    mpi = parser.add_argument_group("MPI")
    mpi.add_argument("--timeout-mode", choices=TIMEOUT_MODES,
                     default=os.environ.get("ZEROSIM_MPI_TIMEOUT_MODE", "abort"),
                     help="abort: blocking collectives + watchdog that aborts the job (fast, default); "
                          "raise: polled nonblocking collectives that raise CollectiveTimeout")
    mpi.add_argument("--save-observations", type=Path, default=None, metavar="PATH",
                     help="rank 0 stores every rank's RankObservation list in PATH (zerosim.datafile; "
                     "for comparing backends)")
    return parser


def _agree_on_config_error(world: Any, error: ZeroSimError | None) -> None:
    """Every rank validates the options; if any rank failed, the lowest such rank prints, all exit 2."""
    from mpi4py import MPI

    mine = np.array([world.Get_rank() if error is not None else world.Get_size()], dtype=np.int64)
    lowest = np.empty(1, dtype=np.int64)
    world.Allreduce(mine, lowest, MPI.MIN)
    if lowest[0] == world.Get_size():
        return
    if lowest[0] == world.Get_rank():
        print(f"error: {error}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def _check_world_size(args: argparse.Namespace, size: int) -> None:
    if args.world_size is None:
        args.world_size = size
    elif args.world_size != size:
        hint = (
            " (every rank sees a world of 1: is this mpiexec from the MPI library mpi4py was built for? "
            "see docs/backends-and-launching.md, 'Using a system MPI')"
            if size == 1
            else f"; run mpiexec -n {args.world_size} or drop --world-size"
        )
        raise ConfigError("world_size", args.world_size, f"mpiexec started {size} rank(s){hint}")


def simulate(argv: list[str]) -> NoReturn:
    from mpi4py import MPI

    from ..comm.mpi import MpiCommunicator
    from ..engine.run_args import config_from_args
    from ..engine.run_output import render
    from ..engine.run_result import evaluate
    from ..engine.spmd import rank_program

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    record_pid(rank)
    try:
        args = parse_args_on_rank(build_parser(), argv, rank)
    except SystemExit as e:  # the same on every rank: nothing started, nobody waits
        sys.exit(e.code)
    cfg, error = None, None
    try:
        _check_world_size(args, world.Get_size())
        cfg = config_from_args(args)
        cfg.validate()
    except ZeroSimError as e:
        error = e
    _agree_on_config_error(world, error)

    assert cfg is not None  # every rank validated it, or every rank has exited
    run = cfg

    def body() -> int:
        comm = MpiCommunicator(world, timeout_s=run.timeout_s, timeout_mode=args.timeout_mode)
        observation = rank_program(comm, run)
        observations = world.gather(observation, root=0)  # once per run, not the data path
        code = 0
        if rank == 0:
            assert observations is not None  # gather's root holds every rank's
            if args.save_observations is not None:
                datafile.save(args.save_observations, observations)
            code = render(evaluate(run, observations), getattr(args, "json", False))
        return int(world.bcast(code, root=0))

    run_rank(body)


def main(argv: list[str] | None = None) -> NoReturn:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        simulate(argv[1:])
    if argv[:1] == ["bench-worker"]:
        from ..bench.mpi import worker_main

        run_rank(lambda: worker_main(argv[1:]))
    print(USAGE, file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
