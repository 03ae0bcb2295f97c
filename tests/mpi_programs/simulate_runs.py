"""Under mpiexec: several ``zerosim.mpi simulate`` runs in one launch, for tests/test_mpi_cross_backend.py
(the ranks start once per world size, not once per case).

argv: RESULTS_JSONL, then one JSON list of ``[options, save path]`` pairs, ``options`` what
``python -m zerosim.mpi simulate`` takes. Each run goes the entry point's way
(:func:`zerosim.mpi.simulate.simulate_rank`): its options parsed by the same parser and turned into the
same run, validated against the world, :func:`zerosim.engine.spmd.rank_program` on an
:class:`~zerosim.comm.mpi.MpiCommunicator` over ``MPI_COMM_WORLD``, the observations gathered on rank 0,
saved and judged. Rank 0 appends ``{"save": PATH, "exit": STATUS}`` per run (0 every contract held).
"""

from __future__ import annotations

import json
import sys

from mpi4py import MPI

from zerosim import datafile
from zerosim.cli.run_options import mpi_rank_run, mpi_simulate_parser
from zerosim.comm.mpi import MpiCommunicator
from zerosim.engine.run_output import render
from zerosim.engine.run_result import evaluate
from zerosim.engine.spmd import rank_program
from zerosim.mpi.simulate import check_world_size


def main() -> None:
    results, runs = sys.argv[1], json.loads(sys.argv[2])
    world = MPI.COMM_WORLD
    for options, save in runs:
        job = mpi_rank_run(mpi_simulate_parser().parse_args(options), world.Get_size())
        check_world_size(job.run.world_size, world.Get_size())
        job.run.validate()
        comm = MpiCommunicator(world, timeout_s=job.run.timeout_s, timeout_mode="abort")
        observations = world.gather(rank_program(comm, job.run), root=0)
        if world.Get_rank() == 0:
            assert observations is not None
            datafile.save(save, observations)
            code = render(evaluate(job.run, observations), False)
            with open(results, "a") as f:
                f.write(json.dumps({"save": save, "exit": code}) + "\n")
        world.Barrier()


if __name__ == "__main__":
    main()
