"""What ``zerosim verify`` observes: each rank's values after each step, with the reference's beside them.

A rank's observation is :class:`zerosim.values.observe.TrainerObservation` (named ``StepObservation`` here
too); a :class:`StepRecord` puts a step's observations beside the reference and the derived bound
(it is a :class:`zerosim.values.observe.TrainerStep`). Plain data (numpy arrays), so the checks
(:mod:`zerosim.checks`) and the diagnosis (:mod:`zerosim.verify.diagnosis`) are pure functions,
testable on synthetic observations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerosim.checks.tolerance import StepBounds
from zerosim.values.observe import TrainerObservation

from .reference import ReferenceStep

#: one rank after one step (the name runs saved with ``--save-observations`` refer to)
StepObservation = TrainerObservation


@dataclass
class StepRecord:
    """One step: the reference, the derived bounds, and every rank's observation (rank order)."""

    ref: ReferenceStep
    bounds: StepBounds
    ranks: list[StepObservation]
    optim: dict[str, Any] | None = None  # the phase's optimizer config (the diagnosis replays a step with it)

    @property
    def step(self) -> int:
        return self.ref.step

    @property
    def phase(self) -> str:
        return self.ref.phase
