"""``mpiexec -n N python -m zerosim.report.mpi_worker CONFIG_JSON OUT``: the report's MPI measurement.

``CONFIG_JSON`` is one argument: ``RunConfig.to_json()``, loaded (and validated) by ``RunConfig.from_json``.

Every rank runs the engine's SPMD program (:func:`zerosim.engine.spmd.rank_program`) on an
:class:`~zerosim.comm.mpi.MpiCommunicator`; rank 0 gathers the observations (once per run, not the
data path) and stores them in ``OUT`` (:mod:`zerosim.files.datafile`) for
:func:`zerosim.report.measure.run_under_mpi`. A failing rank aborts the whole job
(:func:`zerosim.mpi.rank.run_rank`).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> None:
    from mpi4py import MPI

    from ..comm.mpi import MpiCommunicator
    from ..engine.config import RunConfig
    from ..engine.spmd import rank_program
    from ..mpi.rank import run_rank

    spec, out_path = json.loads(argv[0]), argv[1]
    world = MPI.COMM_WORLD

    def body() -> int:
        cfg = RunConfig.from_json(spec)
        comm = MpiCommunicator(world, timeout_s=cfg.timeout_s)
        observation = rank_program(comm, cfg)
        observations = world.gather(observation, root=0)
        if world.Get_rank() == 0:
            from ..files import datafile

            datafile.save(out_path, observations)
        world.Barrier()
        return 0

    run_rank(body)


if __name__ == "__main__":
    main(sys.argv[1:])
