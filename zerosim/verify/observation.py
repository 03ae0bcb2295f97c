"""What ``zerosim verify`` observes: each rank's values after each step, with the reference's beside them.

Plain data (numpy arrays), so the checks (:mod:`zerosim.verify.checks`) and the diagnosis
(:mod:`zerosim.verify.diagnosis`) are pure functions, testable on synthetic observations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from zerosim.checks.tolerance import StepBounds

from .reference import ReferenceStep


@dataclass
class StepObservation:
    """One rank after one step: its loss, ``full_parameters()``, and what the optional methods returned."""

    phase: str
    step: int  # global, 1-based
    rank: int
    loss: float
    params: dict[str, np.ndarray]
    state: dict[str, dict[str, np.ndarray]] | None = None
    shards: dict[str, list[tuple[int, int]]] | None = None
    resources: dict[str, Any] | None = None  # traffic and resident bytes (zerosim.verify.resources)


@dataclass
class StepRecord:
    """One step: the reference, the derived bounds, and every rank's observation (rank order)."""

    ref: ReferenceStep
    bounds: StepBounds
    ranks: list[StepObservation]

    @property
    def step(self) -> int:
        return self.ref.step

    @property
    def phase(self) -> str:
        return self.ref.phase
