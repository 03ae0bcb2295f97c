"""Traffic accounting for the MPI backend: the shared TrafficCounter with O(1) integer bookkeeping.

The simulator records every collective as exact Fractions (:func:`zerosim.comm.base.ring_bytes`);
doing that on the MPI data path would cost more than a small collective. This counter keeps a
``(nbytes, dtype) -> calls`` tally instead and folds it into the same records whenever anything reads them,
so C-ZERO-005 sees the identical ring-model numbers from either backend.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .base import TrafficCounter, TrafficRecord, dtype_label, ring_bytes


class DeferredTrafficCounter(TrafficCounter):
    """A :class:`TrafficCounter` whose hot path is one integer increment instead of Fraction arithmetic.

    Communicators get a *tally* per (group, collective, group size, is-root): a dict
    ``(nbytes, dtype) -> calls`` they increment (``dtype`` the buffer's numpy dtype, None for a
    barrier). Tallies are folded into ``records`` (exact Fractions, :func:`ring_bytes`, calls per dtype)
    the moment anything reads ``records``; every public method of the base class goes through it, so
    totals, ``merge`` and ``to_json`` are identical to the simulator's. Serves C-ZERO-005 without
    costing the data path (one Fraction add takes microseconds; a 64 KiB all-gather takes ~15).
    """

    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str, int, bool], defaultdict[tuple[int, Any], int]] = {}
        super().__init__()

    def tally(self, group: str, collective: str, n: int,
              is_root: bool = False) -> defaultdict[tuple[int, Any], int]:
        """The ``(nbytes, dtype) -> calls`` dict for these keys (shared by every caller asking for the same
        keys): a ``defaultdict(int)``, so recording a call is ``tally[(nbytes, dtype)] += 1``."""
        tally = self._tallies.get((group, collective, n, is_root))
        if tally is None:
            tally = self._tallies[(group, collective, n, is_root)] = defaultdict(int)
        return tally

    @property
    def records(self) -> dict[tuple[str, str], TrafficRecord]:
        if any(self._tallies.values()):
            self._flush()
        return self._records

    @records.setter
    def records(self, value: dict[tuple[str, str], TrafficRecord]) -> None:
        self._records = value

    def record(self, group: str, collective: str, nbytes: int, n: int, is_root: bool = False,
               dtype: str = "") -> None:
        self.tally(group, collective, n, is_root)[(nbytes, dtype or None)] += 1

    def _flush(self) -> None:
        for (group, collective, n, is_root), tally in self._tallies.items():
            items = list(tally.items())
            tally.clear()  # in place: communicators hold these dicts
            for (nbytes, dtype), calls in items:
                sent, received = ring_bytes(collective, nbytes, n, is_root)
                r = self._records.setdefault((group, collective), TrafficRecord())
                r.calls += calls
                r.bytes_sent += sent * calls
                r.bytes_received += received * calls
                r.payload_bytes += nbytes * calls
                label = dtype_label(dtype)
                if label:
                    r.dtypes[label] = r.dtypes.get(label, 0) + calls

    def reset(self) -> None:
        for tally in self._tallies.values():
            tally.clear()
        self._records.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (and copies) as a plain :class:`TrafficCounter`: other processes need no MPI to read it."""
        return TrafficCounter, (dict(self.records),)
