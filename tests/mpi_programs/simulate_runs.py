"""Under mpiexec: several ``zerosim.mpi simulate`` runs in one launch, for tests/test_mpi_cross_backend.py
(the ranks start once per world size, not once per case).

argv: RESULTS_JSONL, then one JSON list of ``[options, save path]`` pairs, ``options`` what
``python -m zerosim.mpi simulate`` takes. Each run goes the entry point's way: its options parsed by
the same parser and turned into the same run, validated against the world, and run by
:func:`zerosim.mpi.simulate.run_job` (the engine on an MPI communicator over ``MPI_COMM_WORLD``, the
observations gathered on rank 0, saved and judged). Rank 0 appends ``{"save": PATH, "exit": STATUS}``
per run (0 every contract held).
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from zerosim.cli.run_options import mpi_rank_run, mpi_simulate_parser
from zerosim.mpi.simulate import check_world_size, run_job


def main() -> None:
    results, runs = sys.argv[1], json.loads(sys.argv[2])
    world = MPI.COMM_WORLD
    for options, save in runs:
        job = mpi_rank_run(mpi_simulate_parser().parse_args([*options, "--save-observations", save]),
                           world.Get_size())
        check_world_size(job.run.world_size, world.Get_size())
        job.run.validate()
        code = run_job(world, job)
        if world.Get_rank() == 0:
            with open(results, "a") as f:
                f.write(json.dumps({"save": save, "exit": code}) + "\n")


if __name__ == "__main__":
    main()
