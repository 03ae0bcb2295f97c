"""What a schedule is: the driver that owns one rank's step, the :class:`Schedule` protocol.

One rank's sharded state is a value, :class:`~zerosim.engine.rank_state.RankState`; what a step does
to it after backward is plain functions (:mod:`zerosim.engine.gradients`, :mod:`zerosim.engine.step`,
:mod:`zerosim.engine.observation`). A schedule holds the state and runs each step itself: it opens
the step (:func:`~zerosim.engine.step.begin_step`), runs its micro-batches on the batches it is
given (gathering units through the state's :class:`~zerosim.engine.unit_table.UnitTable` and handing
gradients to :func:`~zerosim.engine.gradients.accept_grads`), ends each micro-batch
(:func:`~zerosim.engine.gradients.end_micro_batch`) and finishes the step into its observation
(:func:`~zerosim.engine.step.finish_step`). Nothing in :mod:`zerosim.engine` calls a schedule back.

Two schedules serve the same contracts (every collective C-ZERO-005 counts, in the same order on
every rank): the block model's (:class:`~zerosim.engine.block_schedule.BlockSchedule`, what
``zerosim simulate``, mpiexec and torchrun run) and the autograd hooks over a torch module
(:class:`zerogpu.module_engine.ModuleSchedule`).
"""

from __future__ import annotations

from typing import Protocol

from .rank_state import RankState


class Schedule(Protocol):
    """A driver of one rank's steps over its :class:`RankState` (the batch of a step is an argument of
    the schedule's ``step``)."""

    #: the rank's state the schedule steps
    state: RankState
