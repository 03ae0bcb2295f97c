"""C-ZERO-007 in ``zerosim verify --resume-at K --resume-world M``: a trainer resumed from its own
checkpoint, at another world size, continues as if it had never stopped.

Two parts, both over every phase that resumed:

Both are judged by :func:`zerosim.checks.checkpoint.check_checkpoint_equivalence`; this module carries what
passes between the two launches and renders the verdict.

* **Round trip (bitwise).** Right after ``load_checkpoint`` every rank of the new world reports its
  ``full_parameters()`` and ``full_optimizer_state()``; each must be bitwise equal to what the saved
  trainer reported right before ``save_checkpoint`` (rank 0 of the first world). An optimizer state
  the saved trainer exposed and the loaded one lacks, or a step counter that restarts, is named here.
* **Continuation (derived bound).** Every step after the resume, every rank's parameters and exposed
  optimizer state are within C-ZERO-002's per-element bound of the uninterrupted reference, whose
  batches are the first world's micro-batches up to the resume and the new world's after it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerosim.checks.checkpoint import ResumedTrainer
from zerosim.checks.judges import judge
from zerosim.files import datafile
from zerosim.values.observe import TrainerObservation
from zerosim.values.verdict import Verdict

from .observation import StepRecord
from .protocol import STATE_NAMES
from .suite import Phase

#: what the first world's rank 0 leaves for the resumed run's rank 0 (:mod:`zerosim.files.datafile`: plain
#: data that cannot execute code when read), in the run's private resume folder
SNAPSHOT_FILE = "first-run.safetensors"


def read_first_run(path: Path) -> dict[str, Any]:
    """What the first launch saved (``world``, ``phases``, ``phase_info``, ``observations``), read as plain
    data (:func:`zerosim.files.datafile.load`: no code runs); DataFileError naming the file if it is not
    that."""
    first = datafile.load(path, types=(Phase, TrainerObservation))
    shape_ok = (
        isinstance(first, dict)
        and isinstance(first.get("world"), int)
        and isinstance(first.get("phases"), list)
        and all(isinstance(p, Phase) for p in first["phases"])
        and isinstance(first.get("phase_info"), list)
        and all(isinstance(p, dict) for p in first["phase_info"])
        and isinstance(first.get("observations"), dict)
        and all(
            isinstance(step, int) and isinstance(seen, list)
            and all(isinstance(o, TrainerObservation) for o in seen)
            for step, seen in first["observations"].items()
        )
    )
    if not shape_ok:
        raise datafile.DataFileError(f"{path}: not what the first launch of a resumed run saves")
    return first


@dataclass
class ResumeRun:
    """Where a run resumed: after step ``at`` of each phase, from ``world_before`` to ``world_after``
    ranks; per phase, the saved trainer's state (rank 0, right before saving) and every new rank's
    state right after loading."""

    at: int
    world_before: int
    world_after: int
    before_save: dict[str, TrainerObservation] = field(default_factory=dict)
    after_load: dict[str, list[TrainerObservation]] = field(default_factory=dict)

    def last_step_before(self, first_step: int) -> int:
        """The global number of the last step trained before the resume, in a phase starting there."""
        return first_step + self.at - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "at_phase_step": self.at,
            "world_before": self.world_before,
            "world_after": self.world_after,
            "phases_resumed": sorted(self.after_load),
        }


def resume_outcome(records: Sequence[StepRecord], resume: ResumeRun,
                   first_steps: Mapping[str, int]) -> Verdict:
    """C-ZERO-007's verdict over the phases that resumed, judged by
    :func:`zerosim.checks.checkpoint.check_checkpoint_equivalence`."""
    if not resume.after_load:
        return Verdict.skipped("C-ZERO-007", "no phase resumed from a checkpoint")
    resumed = ResumedTrainer(
        resume.before_save,
        resume.after_load,
        {phase: resume.last_step_before(first_steps[phase]) for phase in resume.after_load},
        STATE_NAMES,
    )
    return judge("C-ZERO-007", records, resumed, **resume.to_json())
