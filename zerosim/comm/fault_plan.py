"""The test-only process fault hook shared by every backend (``ZEROSIM_FAULT``).

One description language for every fault a test injects into a run, ``KIND:rank=R[:field=value...]``:

- ``raise:rank=R:call=K`` makes world rank ``R`` raise when it enters its ``K``-th collective (0-based,
  every group and ``split`` counted, in the order this rank enters them);
- ``hang:rank=R:call=K`` makes it sleep forever there instead (it never arrives), so its peers'
  collective timeout must end the run;
- ``kill:rank=R:call=K`` makes its process kill itself with SIGKILL there (one process per rank only:
  ``--backend mpi`` or ``torch``; the simulator refuses it), so the launcher must name the dead rank;
- ``nan:rank=R:step=S``, ``inf:...`` and ``-inf:...`` put that value into one gradient of rank ``R``
  at optimizer step ``S`` (optional ``micro=M``, default 0, and ``tensor=NAME``, default the layout's
  first tensor): the engine's ``RunConfig.inject_nan`` (:class:`zerosim.engine.config.NanInjection`),
  so the run must end with a ``NonFiniteGradientError`` naming the rank and the tensor;
- live-run faults, applied to a real training loop by :mod:`zerosim.monitor.faults` right after the
  optimizer step ``S`` of rank ``R`` (or, for ``grad`` and ``skip-step``, inside it), for the monitor to
  catch: ``bitflip:rank=R:step=S:tensor=NAME[:bit=B]`` flips bit ``B`` (default 20) of element 0 of
  the rank's copy of the tensor; ``skip-step:rank=R:step=S`` makes the rank skip its optimizer step;
  ``grad:rank=R:step=S:tensor=NAME`` adds 1 to element 0 of the rank's reduced gradient of the tensor
  before the step; ``zero-state:rank=R:step=S`` zeroes the rank's optimizer state (step counters
  included), as a bad checkpoint load would.

The collective faults are fired by the communicators, each counting its rank's collectives with a
:class:`FaultCounter`: the in-process simulator (:mod:`zerosim.comm.sim`, one counter per simulated
rank), ``mpiexec`` (:mod:`zerosim.comm.mpi`) and ``torchrun`` (:mod:`zerogpu.comm`); one description
means the same thing on every backend. The gradient faults are read when a run's configuration is
resolved (:mod:`zerosim.engine.config`). Used by tests/test_process_faults.py, tests/test_mpi_faults.py
and tests/test_zerogpu_torchrun.py; never set it in a real run.

Pure Python (no MPI, no torch): every backend imports it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass

from ..errors import ConfigError

#: kinds fired when the rank enters its ``call``-th collective
COLLECTIVE_KINDS = ("raise", "hang", "kill")
#: kinds that put a non-finite value into one gradient at ``step`` (the value's text, for ``float()``)
GRADIENT_KINDS = ("nan", "inf", "-inf")
#: kinds applied to a live training loop (:mod:`zerosim.monitor.faults`)
LIVE_KINDS = ("bitflip", "skip-step", "grad", "zero-state")
FAULT_ENV = "ZEROSIM_FAULT"
_SYNTAX = ("expected raise|hang|kill:rank=R:call=K, nan|inf|-inf:rank=R:step=S[:micro=M][:tensor=NAME] "
           "or bitflip|skip-step|grad|zero-state:rank=R:step=S[:tensor=NAME][:bit=B]")
_INT_FIELDS = {"collective": ("rank", "call"), "gradient": ("rank", "step", "micro"),
               "live": ("rank", "step", "bit")}


@dataclass(frozen=True)
class FaultPlan:
    """One parsed ``ZEROSIM_FAULT`` description (see the module docstring)."""

    kind: str  # one of COLLECTIVE_KINDS or GRADIENT_KINDS
    rank: int = 0
    call: int = 0
    step: int = 0
    micro: int = 0
    tensor: str | None = None  # gradient kinds: None means the layout's first tensor
    bit: int = 20  # bitflip: the bit of element 0 flipped

    @property
    def text(self) -> str:
        if self.kind in COLLECTIVE_KINDS:
            return f"{self.kind}:rank={self.rank}:call={self.call}"
        if self.kind in LIVE_KINDS:
            tensor = "" if self.tensor is None else f":tensor={self.tensor}"
            bit = f":bit={self.bit}" if self.kind == "bitflip" else ""
            return f"{self.kind}:rank={self.rank}:step={self.step}{tensor}{bit}"
        tensor = "" if self.tensor is None else f":tensor={self.tensor}"
        return f"{self.kind}:rank={self.rank}:step={self.step}:micro={self.micro}{tensor}"

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @classmethod
    def from_env(cls, text: str | None = None) -> FaultPlan | None:
        """The plan in ``text`` (default: ``$ZEROSIM_FAULT``); None when empty. Bad text -> ConfigError."""
        text = os.environ.get(FAULT_ENV, "") if text is None else text
        if not text:
            return None
        kind, *fields = text.split(":")
        if kind not in COLLECTIVE_KINDS + GRADIENT_KINDS + LIVE_KINDS:
            raise ConfigError(FAULT_ENV, text, f"unknown kind {kind!r}; {_SYNTAX}")
        family = ("collective" if kind in COLLECTIVE_KINDS else
                  "gradient" if kind in GRADIENT_KINDS else "live")
        ints = _INT_FIELDS[family]
        values: dict[str, int] = {}
        tensor: str | None = None
        for f in fields:
            key, eq, value = f.partition("=")
            if key == "tensor" and kind in GRADIENT_KINDS + LIVE_KINDS and value:
                tensor = value
                continue
            if not eq or key not in ints:
                raise ConfigError(FAULT_ENV, text, f"unknown field {key!r} for kind {kind!r}; {_SYNTAX}")
            try:
                values[key] = int(value)
            except ValueError:
                raise ConfigError(FAULT_ENV, text, f"{key} must be an integer; {_SYNTAX}") from None
        if any(v < 0 for v in values.values()):
            raise ConfigError(FAULT_ENV, text, f"{', '.join(ints)} must be >= 0")
        if kind in ("bitflip", "grad") and tensor is None:
            raise ConfigError(FAULT_ENV, text, f"{kind} needs tensor=NAME; {_SYNTAX}")
        return cls(kind, tensor=tensor, **values)

    def fire(self, collective: str, group: str) -> None:
        """Misbehave now (the caller decided this is the planned rank and call)."""
        where = f"{collective} on group {group} (collective #{self.call} of rank {self.rank})"
        if self.kind == "raise":
            raise RuntimeError(f"injected fault {FAULT_ENV}={self.text} before {where}")
        if self.kind == "kill":
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # "hang" (and "kill" until the signal lands): never arrive
            time.sleep(3600)


def collective_plan(plan: FaultPlan | None) -> FaultPlan | None:
    """``plan`` when a communicator fires it (raise, hang, kill), else None (gradient kinds, no plan)."""
    return plan if plan is not None and plan.is_collective else None


class FaultCounter:
    """Counts one rank's collectives and fires the plan at the planned one (shared by every group)."""

    def __init__(self, plan: FaultPlan | None, world_rank: int):
        plan = collective_plan(plan)
        self.plan = plan if plan is not None and plan.rank == world_rank else None
        self.calls = 0

    def tick(self, collective: str, group: str) -> None:
        if self.plan is not None and self.calls == self.plan.call:
            self.plan.fire(collective, group)
        self.calls += 1
