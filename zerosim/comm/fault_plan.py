"""The test-only process fault hook shared by the MPI and torch backends (``ZEROSIM_FAULT``).

``ZEROSIM_FAULT="raise:rank=R:call=K"`` makes world rank ``R`` raise when it enters its ``K``-th
collective (0-based, every group and ``split`` counted, in the order this process enters them);
``"hang:rank=R:call=K"`` makes it sleep forever there instead, so its peers' collective timeout
must end the job. One fault description means the same thing under ``mpiexec``
(:mod:`zerosim.comm.mpi`) and under ``torchrun`` (:mod:`zerogpu.comm`). Used by
tests/test_mpi_faults.py and tests/test_zerogpu_torchrun.py; never set it in a real run.

Pure Python (no MPI, no torch): both backends import it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class FaultPlan:
    """``kind:rank=R:call=K``: misbehave on world rank ``R`` at its ``K``-th collective."""

    kind: str  # "raise" | "hang"
    rank: int
    call: int

    @classmethod
    def from_env(cls, text: str | None = None) -> FaultPlan | None:
        """The plan in ``text`` (default: ``$ZEROSIM_FAULT``); None when empty. Bad text -> ConfigError."""
        text = os.environ.get("ZEROSIM_FAULT", "") if text is None else text
        if not text:
            return None
        kind, *fields = text.split(":")
        values: dict[str, int] = {"rank": 0, "call": 0}
        try:
            for f in fields:
                k, _, v = f.partition("=")
                if k not in values:
                    raise ValueError(k)
                values[k] = int(v)
        except ValueError:
            raise ConfigError("ZEROSIM_FAULT", text, "expected raise|hang:rank=R:call=K") from None
        if kind not in ("raise", "hang"):
            raise ConfigError("ZEROSIM_FAULT", text, "kind must be 'raise' or 'hang'")
        if values["rank"] < 0 or values["call"] < 0:
            raise ConfigError("ZEROSIM_FAULT", text, "rank and call must be >= 0")
        return cls(kind, values["rank"], values["call"])

    def fire(self, collective: str, group: str) -> None:
        """Misbehave now (the caller decided this is the planned rank and call)."""
        where = f"{collective} on group {group} (collective #{self.call} of rank {self.rank})"
        if self.kind == "raise":
            raise RuntimeError(f"injected fault ZEROSIM_FAULT={self.kind}:rank={self.rank}:call={self.call} "
                               f"before {where}")
        while True:  # "hang": never arrive; the peers' timeout must end the job
            time.sleep(3600)


class FaultCounter:
    """Counts this process's collectives and fires the plan at the planned one (shared by every group)."""

    def __init__(self, plan: FaultPlan | None, world_rank: int):
        self.plan = plan if plan is not None and plan.rank == world_rank else None
        self.calls = 0

    def tick(self, collective: str, group: str) -> None:
        if self.plan is not None and self.calls == self.plan.call:
            self.plan.fire(collective, group)
        self.calls += 1
