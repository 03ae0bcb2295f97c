"""Running zerosim under ``mpiexec``: one process per rank, the engine on :class:`MpiCommunicator`.

- ``mpiexec -n N python -m zerosim.mpi simulate ...`` (``zerosim.mpi.__main__``): every rank runs the
  engine's SPMD program; rank 0 evaluates the contracts and prints the verdicts.
- ``zerosim simulate --backend mpi --world-size N`` (:func:`zerosim.mpi.launch.launch_simulate`)
  starts that mpiexec command itself, with a wall-clock timeout.
- ``zerosim.mpi.rank.run_rank``: the failure policy every rank follows (a rank that raises prints
  ``rank R failed: ...`` once and aborts the whole job).

Importing this package does not initialise MPI; only the rank-side modules import mpi4py. How
closely a run here agrees with the in-process simulator is derived in :mod:`zerosim.checks.agreement`
(``tests/test_mpi_cross_backend.py`` holds every strategy to it).
"""

from __future__ import annotations
