"""What the engine asks of the driver that runs its micro-batches: the :class:`Schedule` protocol.

:class:`~zerosim.engine.zero.ZeroEngine` owns one rank's sharded state (master, gradient shard,
optimizer state, working parameters, groups) and the optimizer step's order (reduce, norm, clip,
step, refresh, observe). *When* units are gathered and gradients handed over is its schedule's: the
block model's (:class:`~zerosim.engine.block_schedule.BlockSchedule`, what ``zerosim simulate``
runs) or the autograd hooks over a torch module (:class:`zerogpu.module_engine.ModuleSchedule`).
The engine holds its schedule; the schedule is handed the engine once (:meth:`Schedule.attach`) and
calls its public methods and the wire steps of :mod:`zerosim.engine.wire`. Both schedules serve the
same contracts: every collective the engine's schedule of C-ZERO-005 counts, in the same order on
every rank.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..comm.base import Communicator
from ..flat_buffers import FlatUnit


class Schedule(Protocol):
    """A driver of :class:`~zerosim.engine.zero.ZeroEngine`."""

    #: a barrier on the control group before each step, so every rank times its step from one start
    align_step_start: bool
    #: keep every step's observation and memory record (False: only the latest, for long trainings)
    keeps_history: bool
    #: ZeRO-1/2 refresh: receive the all-gathered chunks straight into the parameters where the
    #: communicator can (``all_gather_into``); the arithmetic is the same as gathering and unpacking
    receives_into_params: bool

    def attach(self, engine: Any) -> None:
        """Bind to the engine whose state is now built (collective-free, called once)."""

    def micro_batch(self, step: int, micro: int) -> float:
        """Forward and backward of micro-batch ``micro``, gradients handed to the engine; the loss."""

    def settle_gradients(self, step: int) -> bool:
        """After the last micro-batch: finish reductions started during backward. True when the
        gradient is then fully reduced (the engine issues no further reduction); False otherwise."""

    def gather_packed(self, unit: FlatUnit, comm: Communicator) -> Any:
        """The all-gather of every rank's parameter chunk of ``unit`` over ``comm`` (packed)."""

    def params_refreshed(self) -> None:
        """After the engine refreshed the working parameters from the stepped master."""
