"""C-ZERO-007 checkpoints: a pure function from two full-state snapshots to a verdict.

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
* ``step_counter``: the optimizer step counter is restored exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layout import ParamLayout
from ..verdict import Verdict, Violation

CONTRACT = "C-ZERO-007"
CLAUSES = ("round_trip", "resume", "step_counter")
MAX_VIOLATIONS = 8


@dataclass(frozen=True)
class StateSnapshot:
    """A run's full state at one point: step counter, full flat state arrays by name (``master``,
    ``exp_avg``, ...), the full working parameters (None when not observed), and a label for messages."""

    step: int
    states: Mapping[str, np.ndarray]
    params: np.ndarray | None = None
    label: str = ""


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"u{a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def _differences(
    layout: ParamLayout, expected: np.ndarray, got: np.ndarray
) -> list[tuple[str, int, int, int, int]]:
    """``(tensor, first global index, end of the last differing index, differing elements, first index)``
    per tensor with any differing bit, in flat order."""
    diff = np.flatnonzero(_bits(expected) != _bits(got))
    if diff.size == 0:
        return []
    out = []
    offsets = np.asarray(layout.offsets + (layout.total_numel,))
    owner = np.searchsorted(offsets, diff, side="right") - 1
    for t in np.unique(owner):
        idx = diff[owner == t]
        out.append((layout.tensors[int(t)].name, int(idx[0]), int(idx[-1]) + 1, int(idx.size), int(idx[0])))
    return out


def check_checkpoint_equivalence(
    expected: StateSnapshot,
    got: StateSnapshot,
    layout: ParamLayout,
    clause: str = "round_trip",
    context: dict[str, Any] | None = None,
) -> Verdict:
    """C-ZERO-007: ``got`` equals ``expected`` bit for bit (every state array, the working parameters
    when both carry them) and the step counters match. ``clause`` is ``round_trip`` or ``resume``."""
    if clause not in CLAUSES:
        raise ValueError(f"unknown clause {clause!r}; known: {', '.join(CLAUSES)}")
    v = Verdict(CONTRACT)
    ctx = dict(context or {})

    def add(cl: str, message: str, **kw: Any) -> None:
        if len(v.violations) < MAX_VIOLATIONS:
            v.violations.append(Violation(CONTRACT, cl, message, context=ctx, **kw))

    v.checked += 1
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
        v.checked += 1
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
    v.details["compared"] = [name for name, _, _ in arrays]
    return v
