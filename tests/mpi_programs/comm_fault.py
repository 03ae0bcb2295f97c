"""Run under mpiexec by tests/test_mpi_faults.py: a few collectives, with ZEROSIM_FAULT set by the test.

argv: timeout_mode timeout_s [all-raise]. With ``all-raise`` every rank raises the same error after
its first collectives (printed once: the failed ranks agree who reports). Every rank runs through
zerosim.mpi.rank.run_rank, the same failure policy as ``python -m zerosim.mpi simulate``.
"""

from __future__ import annotations

import sys

import numpy as np

from zerosim.comm.mpi import MpiCommunicator
from zerosim.errors import NonFiniteGradientError
from zerosim.mpi.rank import run_rank


def body() -> int:
    comm = MpiCommunicator(timeout_mode=sys.argv[1], timeout_s=float(sys.argv[2]))
    shard = comm.split(comm.rank // 2, name=f"shard[{comm.rank // 2}]") if comm.world_size % 2 == 0 else comm
    x = np.arange(8 * comm.world_size, dtype=np.float32)
    for step in range(3):
        g = comm.reduce_scatter(x, "avg")
        shard.all_reduce(g, "sum")
        comm.all_gather(g)
        if "all-raise" in sys.argv[3:] and step == 1:
            raise NonFiniteGradientError(0, "blocks.0.attn.weight", step, "seen by every rank")
    comm.barrier()
    if comm.rank == 0:
        print("finished", flush=True)
    return 0


if __name__ == "__main__":
    run_rank(body)
