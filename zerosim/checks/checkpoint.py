"""C-ZERO-007, a sharded checkpoint reshards and resumes bit for bit: one check,
:func:`check_checkpoint_equivalence`, for the engine's checkpoints and for a live trainer resumed from
its own (``zerosim verify --resume-at``). Which one it judges follows from the observations it is given;
both use the same bitwise comparison (:func:`zerosim.checks.mismatch.bitwise_diff`: -0.0 vs 0.0 and NaN
payloads differ):

* the engine's runs: two :class:`StateSnapshot` of flat arrays;
* a live trainer (a :class:`ResumedTrainer`): the saved trainer's and every loaded rank's
  :class:`~zerosim.values.observe.TrainerObservation` (parameters and optimizer state by tensor name) for the
  round trip, and the run's steps after the resume, judged by C-ZERO-002's check, for the continuation.

A :class:`StateSnapshot` is what a run holds at one point, gathered to full flat arrays (padding
dropped): the step counter, the master and every optimizer state, and the working parameters. The
check compares an expected snapshot (the run that saved, or a run that never stopped) with the one
obtained after a checkpoint (loaded at another world size, strategy or partitioner; or resumed and
trained on) bit for bit, and names the state, the tensor and the flat element range of every
difference.

Clauses:

* ``round_trip``: save at N, load at M, gather: every state array and the working parameters equal
  the saved ones bit for bit;
* ``resume``: a run resumed from a checkpoint and trained on equals the reference run bit for bit;
* ``step_counter``: the optimizer step counter is restored exactly;
* ``continuation`` (a live trainer): every step after the resume is within C-ZERO-002's per-element
  bound of the uninterrupted reference.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..values.layout import ParamLayout
from ..values.observe import TrainerObservation, TrainerStep
from ..values.verdict import Verdict
from .collect import MAX_LISTED, ViolationCollector
from .equivalence import check_step_equivalence
from .judges import judges
from .mismatch import bitwise_diff, first_run

CONTRACT = "C-ZERO-007"
CLAUSES = ("round_trip", "resume", "step_counter", "continuation")
MAX_VIOLATIONS = 8


@dataclass(frozen=True)
class StateSnapshot:
    """A run's full state at one point: step counter, full flat state arrays by name (``master``,
    ``exp_avg``, ...), the full working parameters (None when not observed), and a label for messages."""

    step: int
    states: Mapping[str, np.ndarray]
    params: np.ndarray | None = None
    label: str = ""


def _differences(
    layout: ParamLayout, expected: np.ndarray, got: np.ndarray
) -> list[tuple[str, int, int, int, int]]:
    """``(tensor, first global index, end of the last differing index, differing elements, first index)``
    per tensor with any differing bit, in flat order."""
    diff = np.flatnonzero(bitwise_diff(np.ascontiguousarray(got).reshape(-1),
                                       np.ascontiguousarray(expected).reshape(-1)))
    if diff.size == 0:
        return []
    out = []
    offsets = np.asarray(layout.offsets + (layout.total_numel,))
    owner = np.searchsorted(offsets, diff, side="right") - 1
    for t in np.unique(owner):
        idx = diff[owner == t]
        out.append((layout.tensors[int(t)].name, int(idx[0]), int(idx[-1]) + 1, int(idx.size), int(idx[0])))
    return out


@dataclass(frozen=True)
class ResumedTrainer:
    """A live trainer resumed from its own checkpoint, per phase that resumed: ``saved[phase]``, the
    saved trainer's observation right before saving; ``loaded[phase]``, every new rank's right after
    loading; ``resumed_after[phase]``, the global number of the last step trained before the resume;
    ``state_names[phase]``, the optimizer state entries compared."""

    saved: Mapping[str, TrainerObservation]
    loaded: Mapping[str, Sequence[TrainerObservation]]
    resumed_after: Mapping[str, int]
    state_names: Mapping[str, Sequence[str]]


@judges(CONTRACT)
def check_checkpoint_equivalence(
    expected: StateSnapshot | Sequence[TrainerStep],
    got: StateSnapshot | ResumedTrainer,
    layout: ParamLayout | None = None,
    clause: str = "round_trip",
    context: dict[str, Any] | None = None,
    **details: Any,
) -> Verdict:
    """C-ZERO-007 (see the module docstring).

    The engine's runs: ``got`` equals ``expected`` bit for bit (every state array, the working
    parameters when both carry them, flat over ``layout``) and the step counters match. ``clause`` is
    ``round_trip`` or ``resume``; ``context`` is attached to every violation.

    A live trainer: ``got`` is its :class:`ResumedTrainer` and ``expected`` the run's
    :class:`~zerosim.values.observe.TrainerStep` records (each with its reference values and bounds).
    ``round_trip``: bitwise; ``continuation``: every step of ``expected`` after the resume judged by
    C-ZERO-002's check, re-labelled. Details: C-ZERO-002's error figures, the round-trip violation
    count, the continued steps, and ``details``.
    """
    if isinstance(got, ResumedTrainer):
        return _resumed_trainer(expected, got, details)  # type: ignore[arg-type]
    if layout is None or not isinstance(expected, StateSnapshot):
        raise ValueError("two StateSnapshots are compared over their ParamLayout")
    return _snapshots(expected, got, layout, clause, context)


def _snapshots(expected: StateSnapshot, got: StateSnapshot, layout: ParamLayout, clause: str,
               context: dict[str, Any] | None) -> Verdict:
    """The engine's runs: ``got`` equals ``expected`` bit for bit; the step counters match."""
    if clause not in ("round_trip", "resume"):
        raise ValueError(f"unknown clause {clause!r}; known: round_trip, resume")
    out = ViolationCollector(CONTRACT, context, total=MAX_VIOLATIONS)
    add = out.add
    checked = 1
    if expected.step != got.step:
        add(
            "step_counter",
            f"the optimizer step counter is {got.step}, not {expected.step}",
            expected=expected.step,
            got=got.step,
        )
    arrays = [(name, expected.states[name], got.states.get(name)) for name in expected.states]
    if expected.params is not None and got.params is not None:
        arrays.append(("params", expected.params, got.params))
    for name, want, have in arrays:
        checked += 1
        if have is None:
            add(clause, f"state {name} is missing after the load", tensor=None)
            continue
        if want.shape != have.shape or want.dtype != have.dtype:
            add(
                clause,
                f"state {name} has shape {have.shape} {have.dtype}, expected {want.shape} {want.dtype}",
            )
            continue
        for tensor, a, b, count, first in _differences(layout, want, have):
            add(
                clause,
                f"{name}: {count} element(s) of {tensor} differ in flat range [{a}, {b}) "
                f"({got.label or 'got'} vs {expected.label or 'expected'})",
                tensor=tensor,
                interval=(a, b),
                expected=float(want[first]),
                got=float(have[first]),
            )
    return out.verdict(checked, compared=[name for name, _, _ in arrays])


# ---- a live trainer resumed under ``zerosim verify --resume-at`` ----------------------------------------


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
    sf = np.ascontiguousarray(s).reshape(-1)
    gf = np.ascontiguousarray(g).reshape(-1)
    differ = bitwise_diff(gf, sf)
    if not differ.any():
        return
    start, stop = first_run(differ)
    s64 = sf.astype(np.float64)
    g64 = gf.astype(np.float64)
    err = float(np.max(np.abs(s64 - g64)))
    out.add(
        "round_trip",
        f"after load_checkpoint {int(differ.sum())} of {s.size} elements differ bitwise from the "
        "saved trainer's",
        {**extra},
        phase=phase, step=step, ranks=(rank,), tensor=label, interval=(start, stop), expected=s64[start],
        got=g64[start], error=err, tolerance=0.0,
    )


def _round_trip(out: ViolationCollector, phase: str, step: int, saved: TrainerObservation,
                loaded: Sequence[TrainerObservation], state_names: Sequence[str]) -> None:
    """``round_trip`` on a live trainer: every loaded rank's parameters and optimizer state
    (the entries named in ``state_names``) bitwise equal to the saved trainer's; a saved state entry the
    loaded rank lacks is named."""
    for obs in loaded:
        for name, arr in saved.params.items():
            _compare_bitwise(out, phase, step, obs.rank, name, arr, obs.params[name])
        for name, entry in (saved.state or {}).items():
            got_entry = (obs.state or {}).get(name)
            for key, arr in entry.items():
                if key not in state_names:
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


def _resumed_trainer(records: Sequence[TrainerStep], resumed: ResumedTrainer,
                     details: dict[str, Any]) -> Verdict:
    """A live trainer resumed from its own checkpoint, over every phase that resumed."""
    saved, loaded, resumed_after, state_names = (resumed.saved, resumed.loaded, resumed.resumed_after,
                                                 resumed.state_names)
    out = ViolationCollector(CONTRACT, total=MAX_LISTED)
    for phase, ranks in loaded.items():
        _round_trip(out, phase, resumed_after[phase], saved[phase], ranks, state_names.get(phase, ()))
    round_trip_failures = out.count
    continued = [r for r in records if r.phase in loaded and r.step > resumed_after[r.phase]]
    eq = check_step_equivalence(continued)
    for v in eq.violations:
        out.add_violation(replace(v, contract=CONTRACT, clause="continuation"))
    out.count += int(eq.details.get("violations_not_listed", 0))
    kept = ("max_error", "tolerance", "error_over_tolerance", "worst", "max_abs_error", "state_compared")
    summary = {k: eq.details[k] for k in kept if k in eq.details}
    summary.update(details, round_trip_violations=round_trip_failures, continued_steps=len(continued))
    return out.listed_verdict(**summary)
