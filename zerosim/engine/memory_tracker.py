"""Live bytes of one rank, by category and location, with a per-step timeline and peaks.

The engine registers every array it allocates for model state or for a step (``alloc``) and
releases it when it drops it (``free``); the byte counts come from the arrays themselves
(``xp.nbytes``). C-ZERO-004 compares what is live against the plan, and the ZeRO-3 peak of
live parameter bytes against the plan's bound; ``zerosim report`` plots the device/host timeline.

Categories:

* ``params``       persistent working parameters (the shard under ZeRO-3, the full copy otherwise)
* ``grads``        persistent gradient accumulation buffer (shard or full, float32)
* ``optimizer``    float32 master copy (when separate) and optimizer state buffers
* ``gathered``     transient unsharded blocks (ZeRO-3 all-gather output and its unpacked view)
* ``grad_buffers`` transient unsharded gradients of a unit before their reduce-scatter
* ``activations``  what the forward pass keeps for the backward pass

Locations: ``device`` (the accelerator) and ``host`` (CPU offload). In the simulator both are numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..values.observe import StepMemory

CATEGORIES = ("params", "grads", "optimizer", "gathered", "grad_buffers", "activations")
LOCATIONS = ("device", "host")
MODEL_STATE = ("params", "grads", "optimizer")
TRANSIENT_CATEGORIES = ("gathered", "grad_buffers", "activations")  # must all be freed by the end of a step


@dataclass(frozen=True)
class MemoryEvent:
    """One change of live bytes: ``delta`` bytes of ``category`` at ``location`` during ``phase``."""

    seq: int
    step: int
    phase: str
    key: str
    category: str
    location: str
    delta: int
    device_total: int
    host_total: int

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "step": self.step, "phase": self.phase, "key": self.key,
                "category": self.category, "location": self.location, "delta": self.delta,
                "device_total": self.device_total, "host_total": self.host_total}


class MemoryTracker:
    """Per-rank accounting of live bytes. ``timeline_steps`` bounds how many steps keep events."""

    def __init__(self, rank: int, timeline_steps: int = 2):
        self.rank = rank
        self.timeline_steps = timeline_steps
        self._live: dict[str, tuple[str, str, int]] = {}
        self._totals: dict[tuple[str, str], int] = {}
        self._loc_totals = {loc: 0 for loc in LOCATIONS}
        self.step = -1  # -1 = initialisation
        self.phase = "init"
        self.events: list[MemoryEvent] = []
        self._seq = 0
        self._peak_loc: dict[str, int] = {}
        self._peak_cat: dict[str, int] = {}
        self._peak_live_params = 0
        self._reset_peaks()
        self.steps: list[StepMemory] = []
        self.init_peak_by_location: dict[str, int] = {}

    # ---- recording ---------------------------------------------------------------------------------
    def alloc(self, key: str, category: str, nbytes: int, location: str = "device") -> None:
        """Register ``nbytes`` live under ``key`` (replacing what ``key`` held before)."""
        if category not in CATEGORIES:
            raise ConfigError("category", category, f"known: {', '.join(CATEGORIES)}")
        if location not in LOCATIONS:
            raise ConfigError("location", location, f"known: {', '.join(LOCATIONS)}")
        if key in self._live:
            self.free(key)
        self._live[key] = (category, location, int(nbytes))
        self._change(key, category, location, int(nbytes))

    def free(self, key: str) -> None:
        """Drop ``key`` (no-op when it is not live)."""
        item = self._live.pop(key, None)
        if item is not None:
            category, location, nbytes = item
            self._change(key, category, location, -nbytes)

    def set_phase(self, phase: str) -> None:
        self.phase = phase

    def _change(self, key: str, category: str, location: str, delta: int) -> None:
        if delta == 0:
            return
        ck = (category, location)
        self._totals[ck] = self._totals.get(ck, 0) + delta
        self._loc_totals[location] += delta
        for loc in LOCATIONS:
            if self._loc_totals[loc] > self._peak_loc[loc]:
                self._peak_loc[loc] = self._loc_totals[loc]
        total_cat = self._totals.get((category, "device"), 0) + self._totals.get((category, "host"), 0)
        if total_cat > self._peak_cat.get(category, 0):
            self._peak_cat[category] = total_cat
        live_params = self._totals.get(("params", "device"), 0) + self._totals.get(("gathered", "device"), 0)
        if live_params > self._peak_live_params:
            self._peak_live_params = live_params
        if self.step < self.timeline_steps:
            self._seq += 1
            self.events.append(MemoryEvent(self._seq, self.step, self.phase, key, category, location, delta,
                                           self._loc_totals["device"], self._loc_totals["host"]))

    def _reset_peaks(self) -> None:
        self._peak_loc = dict(getattr(self, "_loc_totals", {loc: 0 for loc in LOCATIONS}))
        self._peak_cat = {c: self._totals.get((c, "device"), 0) + self._totals.get((c, "host"), 0)
                          for c in CATEGORIES} if hasattr(self, "_totals") else {}
        self._peak_live_params = (
            self._totals.get(("params", "device"), 0) + self._totals.get(("gathered", "device"), 0)
            if hasattr(self, "_totals")
            else 0
        )

    # ---- steps ---------------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        if self.step == -1:
            self.init_peak_by_location = dict(self._peak_loc)
        self.step = step
        self.phase = "step"
        self._reset_peaks()

    def end_step(self) -> StepMemory:
        live: dict[str, dict[str, int]] = {loc: {} for loc in LOCATIONS}
        for (cat, loc), b in self._totals.items():
            if b:
                live[loc][cat] = b
        keys: dict[str, list[str]] = {}
        for key, (cat, _loc, b) in self._live.items():
            if b and cat in TRANSIENT_CATEGORIES:
                keys.setdefault(cat, []).append(key)
        sm = StepMemory(self.step, dict(self._peak_loc), dict(self._peak_cat), self._peak_live_params, live,
                        {c: sorted(v) for c, v in keys.items()})
        self.steps.append(sm)
        return sm

    # ---- queries -------------------------------------------------------------------------------------
    def live_bytes(self, category: str | None = None, location: str | None = None) -> int:
        return sum(b for (c, loc), b in self._totals.items()
                   if (category is None or c == category) and (location is None or loc == location))

    def live_keys(self, category: str | None = None) -> dict[str, tuple[str, str, int]]:
        return {k: v for k, v in self._live.items() if category is None or v[0] == category}

    def timeline_json(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in self.events]
