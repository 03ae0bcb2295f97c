"""C-ZERO-007 in ``zerosim verify --resume-at K --resume-world M``: a trainer resumed from its own
checkpoint, at another world size, continues as if it had never stopped.

Two parts, both over every phase that resumed:

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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from zerosim import datafile
from zerosim.checks.collect import MAX_LISTED, ViolationCollector
from zerosim.checks.equivalence import check_step_equivalence
from zerosim.checks.mismatch import first_run
from zerosim.observe import TrainerObservation

from .observation import StepRecord
from .outcome import ContractOutcome
from .protocol import STATE_NAMES
from .suite import Phase

CONTRACT = "C-ZERO-007"
#: what the first world's rank 0 leaves for the resumed run's rank 0 (:mod:`zerosim.datafile`: plain data
#: that cannot execute code when read), in the run's private resume folder
SNAPSHOT_FILE = "first-run.safetensors"


def read_first_run(path: Path) -> dict[str, Any]:
    """What the first launch saved (``world``, ``phases``, ``phase_info``, ``observations``), read as plain
    data (:func:`zerosim.datafile.load`: no code runs); DataFileError naming the file if it is not that."""
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


def _bytes_differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a1 = np.ascontiguousarray(a).reshape(-1)
    b1 = np.ascontiguousarray(b).reshape(-1)
    return (a1.view(np.uint8).reshape(a1.size, -1) != b1.view(np.uint8).reshape(b1.size, -1)).any(axis=1)


def _compare_bitwise(
    out: ViolationCollector, phase: str, step: int, rank: int, label: str, saved: Any, loaded: Any,
    **extra: Any,
) -> None:
    s = np.asarray(saved)
    g = np.asarray(loaded)
    if s.shape != g.shape or s.dtype != g.dtype:
        out.add(
            "round_trip",
            f"after load_checkpoint: shape {tuple(g.shape)} {g.dtype}, saved {tuple(s.shape)} {s.dtype}",
            {**extra},
            phase=phase, step=step, ranks=(rank,), tensor=label, interval=(0, int(s.size)), tolerance=0.0,
        )
        return
    differ = _bytes_differ(s, g)
    if not differ.any():
        return
    start, stop = first_run(differ)
    sf = s.astype(np.float64).reshape(-1)
    gf = g.astype(np.float64).reshape(-1)
    err = float(np.max(np.abs(sf - gf)))
    out.add(
        "round_trip",
        f"after load_checkpoint {int(differ.sum())} of {s.size} elements differ bitwise from the "
        "saved trainer's",
        {**extra},
        phase=phase, step=step, ranks=(rank,), tensor=label, interval=(start, stop), expected=sf[start],
        got=gf[start], error=err, tolerance=0.0,
    )


def check_round_trip(out: ViolationCollector, phase: str, step: int, saved: TrainerObservation,
                     loaded: Sequence[TrainerObservation]) -> None:
    """Every loaded rank's parameters and optimizer state bitwise equal to the saved trainer's."""
    names = STATE_NAMES.get(phase, ())
    for obs in loaded:
        for name, arr in saved.params.items():
            _compare_bitwise(out, phase, step, obs.rank, name, arr, obs.params[name])
        for name, entry in (saved.state or {}).items():
            got_entry = (obs.state or {}).get(name)
            for key, arr in entry.items():
                if key not in names:
                    continue
                got = None if got_entry is None else got_entry.get(key)
                if got is None:
                    out.add(
                        "round_trip",
                        f"optimizer state {key!r} was saved but is missing after load_checkpoint",
                        {"state": key},
                        phase=phase, step=step, ranks=(obs.rank,), tensor=f"{name}[{key}]",
                        interval=(0, int(np.asarray(arr).size)), tolerance=0.0,
                    )
                    continue
                _compare_bitwise(out, phase, step, obs.rank, f"{name}[{key}]", arr, got, state=key)


def check_resume(records: Sequence[StepRecord], resume: ResumeRun,
                 first_steps: Mapping[str, int]) -> ContractOutcome:
    """C-ZERO-007 over the phases that resumed (see the module docstring)."""
    if not resume.after_load:
        return ContractOutcome("skipped", "no phase resumed from a checkpoint")
    out = ViolationCollector(CONTRACT, total=MAX_LISTED)
    for phase, loaded in resume.after_load.items():
        saved = resume.before_save[phase]
        check_round_trip(out, phase, resume.last_step_before(first_steps[phase]), saved, loaded)
    round_trip_failures = out.count
    continued = [
        r for r in records
        if r.phase in resume.after_load and r.step > resume.last_step_before(first_steps[r.phase])
    ]
    eq = check_step_equivalence(continued)
    for v in eq.violations:
        out.add_violation(replace(v, contract=CONTRACT, clause="continuation"))
    hidden = int(eq.details.get("violations_not_listed", 0))
    out.count += hidden
    kept = ("max_error", "tolerance", "error_over_tolerance", "worst", "max_abs_error", "state_compared")
    details = {k: eq.details[k] for k in kept if k in eq.details}
    details.update(
        resume.to_json(),
        round_trip_violations=round_trip_failures,
        continued_steps=len(continued),
    )
    return ContractOutcome.from_verdict(out.listed_verdict(**details))
