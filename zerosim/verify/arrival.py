"""Which rank never arrived? Each rank's count of torch.distributed collectives entered, in the job's store.

A collective that times out tells the ranks that arrived only that it timed out. To name the rank
that hung, every rank of a ``zerosim verify`` run wraps torch.distributed's collective functions
(the trainer's calls included) with a counter and publishes ``{calls, where}`` to the job's
key-value store (``TCPStore``) on every call and at every trainer call it starts
(:meth:`ArrivalCounter.mark`). After a timeout, :meth:`ArrivalCounter.laggard` reads every rank's
entry: the rank that entered the fewest collectives is the one the others waited for, and ``where``
says which trainer call it was in. Serves the "distributed runs never hang; name the rank" rule.
"""

from __future__ import annotations

import functools
import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_KEY = "zerosim/verify/arrival/"
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "barrier", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
               "_all_gather_base", "_reduce_scatter_base", "all_gather_object", "broadcast_object_list",
               "gather_object", "scatter_object_list")


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

    def laggard(self) -> tuple[int | None, str]:
        """(the rank that entered the fewest collectives, a description), or (None, why not known)."""
        if self.store is None:
            return None, "no store to read the other ranks' progress from"
        entries: dict[int, dict[str, Any]] = {}
        for r in range(self.world):
            try:
                self.store.wait([f"{_KEY}{r}"], timedelta(seconds=2))
                entries[r] = json.loads(self.store.get(f"{_KEY}{r}"))
            except Exception:  # noqa: BLE001 - that rank never published: it is the laggard
                entries[r] = {"calls": -1, "where": "never started"}
        fewest = min(e["calls"] for e in entries.values())
        behind = [r for r, e in entries.items() if e["calls"] == fewest]
        if len(behind) == len(entries):
            return None, "every rank entered the same number of collectives"
        r = behind[0]
        others = sorted({e["calls"] for q, e in entries.items() if q not in behind})
        return r, (f"rank {r} entered {fewest} collectives, the other ranks {'/'.join(map(str, others))}; "
                   f"rank {r} was in {entries[r]['where']}")

    def restore(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
