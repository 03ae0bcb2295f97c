"""Running zerosim under ``mpiexec``: one process per rank, the engine on :class:`MpiCommunicator`.

- ``mpiexec -n N python -m zerosim.mpi simulate ...`` (``zerosim.mpi.__main__``): every rank runs the
  engine's SPMD program; rank 0 evaluates the contracts and prints the verdicts.
- ``zerosim simulate --backend mpi --world-size N`` (:func:`zerosim.mpi.launch.launch_simulate`)
  starts that mpiexec command itself, with a wall-clock timeout.
- ``zerosim.mpi.rank.run_rank``: the failure policy every rank follows (a rank that raises prints
  ``rank R failed: ...`` once and aborts the whole job).

Importing this package does not initialise MPI; only the rank-side modules import mpi4py.
"""

from __future__ import annotations

# Documented agreement with the in-process simulator (tests/test_mpi_cross_backend.py holds us to it).
# Bitwise: every reduction that feeds the training state runs over at most BITWISE_MAX_GROUP ranks
# (one IEEE addition is commutative). Otherwise MPI's reduction order differs from the simulator's
# rank order and fp32 values agree within these bounds (observed on `tiny`: max abs diff 1.2e-7).
BITWISE_MAX_GROUP = 2
CROSS_BACKEND_RTOL = 1e-5
CROSS_BACKEND_ATOL = 1e-6
