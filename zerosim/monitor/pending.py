"""A monitor check in flight (:class:`PendingCheck`): its row's all-gather under way, and what that row
digested. A check is observed at one ``after_step`` call and completed at a later one (or at
``flush`` / ``close``); both ends apply the same digest rule (:func:`digested` when the row is built,
:func:`digest_rule` when the rows are read), so every rank judges C-ZERO-003 on the same pieces.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .exchange import Gather, start_gather
from .layouts import LiveLayout
from .step_probe import Observed

#: a held piece: (tensor, start, stop) of its flat element range
PieceKey = tuple[str, int, int]


def digested(layout: LiveLayout, fingerprint: int, exchanged: int,
             shared: frozenset[PieceKey]) -> list[bool] | None:
    """Which of its held pieces a rank digests: those another rank holds too (``shared``, by the layouts
    exchanged last); every piece (None) when its own layout's ``fingerprint`` differs from the one it
    ``exchanged``, which the other ranks learn only when the check completes (:func:`digest_rule`)."""
    if fingerprint != exchanged:
        return None
    return [(name, a, b) in shared for name, a, b, _ in layout.held]


def digest_rule(rows: list[int], shared: frozenset[PieceKey],
                fingerprints: list[int]) -> Callable[[int, PieceKey], bool]:
    """Whether rank r digested a piece in rows carrying the layout fingerprints ``rows``, built by
    :func:`digested` under the exchanged ``shared`` pieces and layout ``fingerprints``: a rank whose
    row carries another fingerprint digested every piece it held."""
    whole = [fp != fingerprints[r] for r, fp in enumerate(rows)]
    return lambda rank, key: whole[rank] or key in shared


@dataclass
class PendingCheck:
    """A check observed at ``step`` whose all-gather is under way: this rank's layout keys then, the row
    width, the gather, (the layout and row values, when the check completes within the same call), the
    seconds spent observing, and what the rows digested."""

    step: int
    keys: dict[str, Any]
    width: int
    gather: Gather
    now: tuple[LiveLayout, tuple[Any, ...]] | None
    seconds: float
    #: the pieces shared and the layout fingerprints exchanged when the row was built (what it digested)
    shared: frozenset[PieceKey]
    fingerprints: list[int]
    #: this rank's step-check fields observed for the check (:meth:`StepProbe.take`)
    taken: dict[str, Any]
    #: the table did not arrive within the grace of a call that was not a check step
    waited: bool = False



@dataclass
class StagedCheck:
    """A check observed at ``step`` whose row is not yet posted: its digests and summary already on the
    device (``head``), its step-check observation still landing in pinned host memory (``observed``;
    None: nothing observed), the other step-check fields (``fields``), and what :class:`PendingCheck`
    takes from the moment the row was built. Posted once the copy has landed, so that no check makes
    the host wait for the device (C-ZERO-002's step checks on an accelerator)."""

    step: int
    keys: dict[str, Any]
    width: int
    head: Any
    observed: Observed | None
    fields: dict[str, Any]
    seconds: float
    shared: frozenset[PieceKey]
    fingerprints: list[int]

    def ready(self) -> bool:
        """Whether its values have reached the host (never waits)."""
        return self.observed is None or self.observed.staged.ready()

    def post(self, section: Callable[[dict[str, Any]], Any], group: Any) -> PendingCheck:
        """Post the row: the digests and summary, then the step-check ``section`` built from every
        step-check field of the check (waiting for a copy still under way)."""
        t0 = time.perf_counter()
        taken = {**self.fields, **(self.observed.fields() if self.observed is not None else {})}
        gather = start_gather(torch.cat([self.head, section(taken)]), group)
        return PendingCheck(self.step, self.keys, self.width, gather, None,
                            self.seconds + time.perf_counter() - t0, self.shared, self.fingerprints, taken)
