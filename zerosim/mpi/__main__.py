"""``mpiexec -n N python -m zerosim.mpi simulate ...``: the MPI backend's command line, one process per rank.

``simulate --run FILE`` (or ``--config FILE``) loads the run file (:mod:`zerosim.engine.run_file`;
``zerosim simulate --backend mpi`` writes one and starts this, ``zerosim simulate ... --write-config
FILE`` writes one for ranks a user starts). ``simulate [options]`` (the options of ``zerosim simulate``)
parses nothing here: the process becomes ``python -m zerosim.cli.ranks mpi-simulate [options]``
(:func:`zerosim.engine.run_file.rank_run_path`, before MPI starts), which builds the same run value
once on each rank. Either way every rank runs
:func:`zerosim.mpi.simulate.simulate_rank`: rank 0 prints the same verdict table / JSON as the
in-process simulator. Exit status, the same on every rank: 0 every contract holds, 1 a contract
failed, 2 bad input (printed once), 3 a rank failed or a collective timed out (``rank R failed: ...``
printed once, then ``MPI_Abort``).

MPI-only options: ``--timeout-mode abort|raise`` (how a collective timeout is detected, see
:mod:`zerosim.comm.mpi`; default ``$ZEROSIM_MPI_TIMEOUT_MODE`` or ``abort``) and
``--save-observations PATH`` (rank 0 stores the observations of every rank, :mod:`zerosim.files.datafile`).
The collective
timeout itself is the run's ``timeout_s`` (``--timeout`` of ``zerosim simulate``). ``--world-size``
defaults to the number of ranks mpiexec started; a different value is an error.

``python -m zerosim.mpi bench-worker --config FILE`` is the inside of ``zerosim bench mpi`` (not for
direct use): FILE holds the launch's settings as one value (:class:`zerosim.bench.mpi.MpiBenchRun`).
"""

from __future__ import annotations

import sys
from typing import NoReturn

from ..engine.run_file import config_path_argument, rank_run_path
from ..errors import EXIT_BAD_INPUT, ZeroSimError

USAGE = ("usage: mpiexec -n N python -m zerosim.mpi simulate --run FILE\n"
         "       mpiexec -n N python -m zerosim.mpi simulate [zerosim simulate options]\n"
         "       mpiexec -n N python -m zerosim.mpi bench-worker --config FILE")


def simulate(argv: list[str]) -> NoReturn:
    """One rank of ``simulate``: the run in the file ``--run FILE`` names (options: handed to the
    command line, which builds the same run; C-ZERO-001..005 judged on rank 0)."""
    path = rank_run_path(argv, "mpi-simulate")  # before mpi4py: the process may be replaced
    from ..engine.run_file import read_rank_run
    from .simulate import simulate_rank

    simulate_rank(lambda size: read_rank_run(path, "mpi"))


def main(argv: list[str] | None = None) -> NoReturn:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["simulate"]:
        simulate(argv[1:])
    path = config_path_argument(argv[1:])
    if argv[:1] == ["bench-worker"] and path is not None:
        from ..bench.mpi import read_mpi_bench_run, worker_main
        from .rank import run_rank

        try:
            run = read_mpi_bench_run(path)
        except ZeroSimError as e:  # the same file on every rank: each exits 2, rank 0 says why
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_rank() == 0:
                print(f"error: {e}", file=sys.stderr, flush=True)
            sys.exit(EXIT_BAD_INPUT)
        run_rank(lambda: worker_main(run))
    print(USAGE, file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
