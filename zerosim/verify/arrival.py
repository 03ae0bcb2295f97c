"""Which rank never arrived? Each rank's count of torch.distributed collectives entered, in the job's store.

A collective that times out tells the ranks that arrived only that it timed out. To name the rank
that hung, every rank of a ``zerosim verify`` run wraps torch.distributed's collective functions
(the trainer's calls included) with a counter and publishes ``{calls, where}`` to the job's
key-value store (``TCPStore``) on every call and at every trainer call it starts
(:meth:`ArrivalCounter.mark`). After a timeout, :meth:`ArrivalCounter.laggard` names the rank the
others waited for: the one that never reported the timeout itself (it is stuck elsewhere), or else
the one whose count of collectives differs; ``where`` says which trainer call it was in.
Serves the "distributed runs never hang; name the rank" rule.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

import torch.distributed as dist

_KEY = "zerosim/verify/arrival/"
_SAW = "zerosim/verify/saw-failure/"
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "reduce",
    "gather",
    "scatter",
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)


class ArrivalCounter:
    """Counts this rank's collectives and publishes the count with the trainer call it is in."""

    def __init__(self, comm: Any):
        self.rank = comm.rank
        self.world = comm.world_size
        self.store = getattr(getattr(getattr(comm, "_job", None), "board", None), "store", None)
        self.calls = 0
        self.where = "start"
        self._originals: dict[str, Any] = {}
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_zerosim_arrival", False):
                continue
            self._originals[name] = fn
            setattr(dist, name, self._counted(fn))
        self._publish()

    def _counted(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self._publish()
            return fn(*args, **kwargs)

        wrapper._zerosim_arrival = True  # type: ignore[attr-defined]
        return wrapper

    def mark(self, where: str) -> None:
        """This rank is about to run ``where`` (a trainer call)."""
        self.where = where
        self._publish()

    def _publish(self) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"{_KEY}{self.rank}", json.dumps({"calls": self.calls, "where": self.where}))
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to read it
            pass

    def last_places(self) -> dict[str, str]:
        """rank (as text) -> the trainer call each rank last published (``never started`` if none)."""
        return {str(r): str(self._entry(r).get("where", "unknown")) for r in range(self.world)}

    def laggard(self, grace_s: float = 3.0, failure: str = "timed out in") -> tuple[int | None, str]:
        """(the rank to blame for a collective that timed out or failed, a description), or (None, why not).

        Every rank that sees the error says so in the store; after ``grace_s`` the ranks that have not
        are the ones still stuck elsewhere (in a sleep, a loop, a collective nobody else entered), and
        the first of them is blamed. If every rank saw the error, the rank whose count of collectives
        differs from the others' (a skipped or an extra collective) is blamed. ``failure`` says what
        happened to the collective: ``timed out in`` (a hang), ``lost`` (a peer's connection closed)."""
        if self.store is None:
            return None, "no store to read the other ranks' progress from"
        try:
            self.store.set(f"{_SAW}{self.rank}", "1")
        except Exception:  # noqa: BLE001
            return None, "the job's store is gone"
        deadline = time.monotonic() + grace_s
        silent = list(range(self.world))
        while silent and time.monotonic() < deadline:
            silent = [r for r in silent if not self._has(f"{_SAW}{r}")]
            if silent:
                time.sleep(0.1)
        entries = {r: self._entry(r) for r in range(self.world)}
        if silent and len(silent) < self.world:
            r = silent[0]
            others = ", ".join(map(str, silent[1:]))
            if failure == "lost":
                return r, (
                    f"rank {r}{' (and ' + others + ')' if others else ''} closed its connection to the "
                    f"other ranks; it was last in {entries[r]['where']}"
                )
            return r, (
                f"rank {r}{' (and ' + others + ')' if others else ''} never reached the collective the "
                f"other ranks {failure}; it was last in {entries[r]['where']}"
            )
        counts = [e["calls"] for e in entries.values()]
        usual = max(set(counts), key=counts.count)
        odd = [r for r, e in entries.items() if e["calls"] != usual]
        if odd and len(odd) < self.world:
            r = odd[0]
            return r, (
                f"rank {r} entered {entries[r]['calls']} collectives, the other ranks {usual}; it was "
                f"last in {entries[r]['where']}"
            )
        return None, "every rank saw the failure and entered the same number of collectives"

    def _has(self, key: str) -> bool:
        if self.store is None:
            return False
        try:
            return bool(self.store.check([key]))
        except Exception:  # noqa: BLE001
            return False

    def _entry(self, rank: int) -> dict[str, Any]:
        key = f"{_KEY}{rank}"
        if self.store is None or not self._has(key):
            return {"calls": -1, "where": "never started"}
        try:
            return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001
            return {"calls": -1, "where": "unknown"}

    def restore(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
