"""Contract checks: pure functions from observations (plans, arrays, counters) to a Verdict.

Each contract has one check, whatever produced the observations (simulate on numpy, mpi or torch,
``zerosim verify``, the monitor, the benchmarks), marked with :func:`~zerosim.checks.judges.judges`
and named by its spec file in ``contracts/``:

=========== ====================================================
C-ZERO-001  :func:`zerosim.checks.partition.check_partition_plan`
C-ZERO-002  :func:`zerosim.checks.equivalence.check_step_equivalence`
C-ZERO-003  :func:`zerosim.checks.identity.check_replica_identity`
C-ZERO-004  :func:`zerosim.checks.holdings.check_holdings`
C-ZERO-005  :func:`zerosim.checks.traffic.check_communication`
C-ZERO-006  :func:`zerosim.checks.state_dict.check_broadcast_shard`
C-ZERO-007  :func:`zerosim.checks.checkpoint.check_checkpoint_equivalence`
C-ZERO-008  :func:`zerosim.checks.logged_norm.check_logged_norm`
=========== ====================================================

Every check reports through one collector (:mod:`zerosim.checks.collect`); the tolerances are in
:mod:`zerosim.checks.tolerance` (derived from :mod:`zerosim.checks.rounding`).
"""

from __future__ import annotations

from .partition import check_partition_plan

__all__ = ["check_partition_plan"]
