"""ZeRO-3 CPU offload: parameter shards live on the host, a bounded set of them on the device.

:class:`OffloadManager` keeps every registered unit's owned parameter shard (a 1-D tensor) in the
**host tier** and copies it into the **device tier** when the ZeRO-3 gather path asks for it
(:meth:`OffloadManager.fetch`). Two contracts bound what it may do:

- *Offloaded training is bitwise equal to the same run without offload.* A device copy is a plain
  copy of the host tensor (same dtype, same bits, no cast), and :meth:`OffloadManager.update_host`
  drops any device copy of a unit whose host values changed, so every fetch returns exactly the
  bits last written to the host.
- *C-ZERO-004 with the device budget as the bound.* The bytes of shards resident in the device tier
  (copies in flight included) never exceed ``device_budget_bytes``; the peak is tracked exactly, as
  an integer, at every allocation.

Tiers and budgets:

- host tier: the owned shards (the manager's own copies, pinned when CUDA is used) plus the
  optimizer state / master pieces registered with :meth:`~OffloadManager.register_host_state`
  (referenced, never copied or moved). ``host_budget_bytes`` (None: unlimited) bounds their sum.
- device tier: at most ``device_budget_bytes`` of shard copies. :meth:`~OffloadManager.validate`
  refuses, before anything is copied, a budget that cannot hold the ``max_in_use`` largest units
  together (default 1: the largest unit must fit on its own), and a host tier over its budget.
  A budget of exactly the largest unit works, but then a prefetch never fits while a unit is in
  use: prefetch depth ``d`` takes effect once the budget holds the unit in use plus ``d`` more.

Fetch, prefetch and eviction (all deterministic):

- ``fetch(name, upcoming)`` returns the unit's device copy and marks it in use and most recently
  used. A unit already resident is a *resident hit*; one copied ahead by a prefetch and not yet
  fetched is a *prefetch hit* (the fetch waits for that copy); otherwise the fetch copies it now, a
  *miss*. ``hits`` = prefetch hits + resident hits, and hits + misses = fetches.
- Then the names in ``upcoming[:prefetch_depth]`` that hold no device copy are prefetched, in that
  order. Making room evicts least-recently-used units that are neither in use nor in that window;
  when that cannot free enough, the prefetch is skipped (counted) and nothing is evicted for it.
- A miss evicts least-recently-used units that are not in use (an in-flight prefetch included: it
  is counted as wasted). When units in use leave too little room, the fetch raises
  :class:`OffloadBudgetError` and changes nothing: release units before fetching more.
- ``release(name)`` makes a unit evictable; it stays resident (and can be hit) until evicted.
  A caller must not keep a fetched tensor after releasing it: the budget counts the manager's copies.

Statistics (:meth:`~OffloadManager.performance_stats`): fetches, hits (prefetch / resident), misses,
prefetches issued, skipped for the budget and wasted (evicted or invalidated before use), evictions,
invalidations, bytes and copies host->device, bytes device->host (``update_host`` values that live
on a CUDA device), ``seconds_copying`` (time the copies took), ``seconds_waited`` (time the calling
thread was blocked on a copy) and ``overlap_fraction`` = 1 - waited / copying, clamped to [0, 1]
(0 when nothing was copied): the share of copy time hidden behind compute.

CPU versus CUDA:

- On CUDA, host shards are pinned (``pin_memory``), every host->device copy is issued
  ``non_blocking`` on a side :class:`torch.cuda.Stream` and timed with CUDA events. A fetch of an
  in-flight unit blocks the calling thread until its copy has finished (the measured wait) and
  makes the current stream wait on the copy's event; the tensor is ``record_stream``-ed on the
  current stream so its memory is not reused before the work queued on that stream has read it.
  A miss, and every prefetch when ``async_prefetch`` is False, is waited for at once.
  ``update_host`` waits for the last copy that read the host tensor before overwriting it.
- On a machine without CUDA (device ``"cpu"``) the device tier is a separately accounted pool of
  CPU tensors (``clone`` of the host copy), so budgets, eviction order, prefetch order and the
  statistics behave exactly as on CUDA and are testable anywhere. **Nothing is asynchronous on
  CPU**: every copy runs on the calling thread inside the ``fetch`` that needed or scheduled it, so
  ``seconds_waited`` equals ``seconds_copying`` and ``overlap_fraction`` is 0. What
  ``async_prefetch=True`` changes on CPU is the bookkeeping: a prefetched unit counts as *in
  flight* from the fetch that scheduled it until the fetch that consumes it (a prefetch hit), the
  states a CUDA run goes through; with ``async_prefetch=False`` it is resident at once (a later
  fetch is a resident hit). No threads are used.

The manager is not thread-safe; one training loop drives it.

Why one module of this length: the tiers, the LRU order, the budget accounting and the statistics
are one state machine that every method reads and updates.
The configuration and the budget error live in :mod:`zerogpu.offload_config` (re-exported here).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from zerosim.errors import ConfigError, require_positive_int
from zerosim.values.unit_state import UnitState

from .offload_config import DEVICE_BUDGET_FIELD, HOST_BUDGET_FIELD, OffloadBudgetError, OffloadConfig

__all__ = ["DEVICE_BUDGET_FIELD", "HOST_BUDGET_FIELD", "OffloadBudgetError", "OffloadConfig",
           "OffloadManager"]

_SHOWN_NAMES = 6  # registered names listed in an unknown-name message


class _Unit:
    """One registered unit: its host copy and, while resident, its device copy."""

    __slots__ = ("name", "host", "nbytes", "device_copy", "state", "ready")

    def __init__(self, name: str, host: torch.Tensor):
        self.name = name
        self.host = host
        self.nbytes = host.numel() * host.element_size()
        self.device_copy: torch.Tensor | None = None
        #: OFFLOADED (no device copy), IN_FLIGHT (copied by a prefetch, not fetched yet), IN_USE
        #: (fetched and not released) or SHARDED (resident and evictable)
        self.state = UnitState.OFFLOADED
        self.ready: Any = None   # CUDA: event recorded after the last copy that read ``host``

    @property
    def in_use(self) -> bool:
        return self.state is UnitState.IN_USE

    @property
    def in_flight(self) -> bool:
        return self.state is UnitState.IN_FLIGHT


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_COUNTERS = ("fetches", "prefetch_hits", "resident_hits", "misses", "prefetches_issued",
             "prefetches_skipped", "prefetches_wasted", "evictions", "invalidations",
             "copies_host_to_device", "bytes_host_to_device", "bytes_device_to_host")


class OffloadManager:
    """Host and device tiers of ZeRO-3 parameter shards under a device budget (see the module docstring).

    Serves "offloaded training is bitwise equal to the same run without offload" (plain copies,
    invalidation on update) and "C-ZERO-004 with the device budget as the bound" (exact accounting,
    eviction before every allocation).
    """

    # device-tier accounting and statistics, (re)set by _reset_device_and_stats
    _device_bytes: int
    _device_peak: int
    _stats: dict[str, int]
    _evicted: list[str]
    _last_skipped: list[str]
    _seconds_copying: float
    _seconds_waited: float
    _timings: list[tuple[Any, Any]]  # CUDA (start, end) events of copies not yet added to _seconds_copying

    def __init__(self, config: OffloadConfig, device: str | torch.device = "cpu"):
        if not isinstance(config, OffloadConfig):
            raise ConfigError("offload.config", type(config).__name__, "must be an OffloadConfig")
        self.config = config
        self.device = self._resolve_device(device)
        self._cuda = self.device.type == "cuda"
        self._pin = self._cuda and config.pin_memory
        self._stream: Any = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._units: dict[str, _Unit] = {}
        self._host_state: dict[str, tuple[torch.Tensor, ...]] = {}
        self._host_state_bytes = 0
        self._host_peak = 0
        self._lru: OrderedDict[str, None] = OrderedDict()  # units holding a device copy, oldest first
        self._validated = False
        self._max_in_use = 1
        self._reset_device_and_stats()

    # ----------------------------------------------------------------------------------- registration

    @staticmethod
    def _resolve_device(device: str | torch.device) -> torch.device:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError("offload.device", device, f"not a torch device ({first})") from None
        if dev.type == "cpu":
            return dev
        if dev.type != "cuda":
            raise ConfigError("offload.device", str(device), "must be 'cpu' or a CUDA device")
        if not torch.cuda.is_available():
            raise ConfigError("offload.device", str(device), "CUDA is not available on this machine")
        return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)

    def register_unit(self, name: str, shard: torch.Tensor) -> None:
        """Register a unit's owned parameter shard (1-D); the manager keeps its own host copy.

        Units keep registration order. The host copy is pinned when the device is CUDA and
        ``pin_memory`` is set; the caller's tensor is not referenced afterwards.
        """
        self._require_new_name(name, self._units, "offload.unit")
        if not isinstance(shard, torch.Tensor):
            raise ConfigError("offload.shard", type(shard).__name__, f"unit {name!r}: must be a torch.Tensor")
        if shard.dim() != 1:
            raise ConfigError("offload.shard", tuple(shard.shape),
                              f"unit {name!r}: the owned shard must be a 1-D tensor")
        if shard.device.type == "meta":
            raise ConfigError("offload.shard", str(shard.device),
                              f"unit {name!r}: a meta tensor holds no values")
        src = shard.detach()
        host = torch.empty(src.shape, dtype=src.dtype, pin_memory=self._pin)
        host.copy_(src)
        self._units[name] = _Unit(name, host)
        self._host_changed()

    def register_host_state(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Account optimizer state / master pieces that live on the host tier (referenced, never moved)."""
        self._require_new_name(name, self._host_state, "offload.host_state")
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        items = tuple(tensors)
        for t in items:
            if not isinstance(t, torch.Tensor):
                raise ConfigError("offload.host_state", type(t).__name__,
                                  f"state {name!r}: every item must be a torch.Tensor")
            if t.device.type != "cpu":
                raise ConfigError("offload.host_state", str(t.device),
                                  f"state {name!r}: host state must live on the CPU")
        self._host_state[name] = items
        self._host_state_bytes += _nbytes(items)
        self._host_changed()

    @staticmethod
    def _require_new_name(name: Any, taken: dict[str, Any], field: str) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(field, name, "the name must be a non-empty string")
        if name in taken:
            raise ConfigError(field, name, "already registered")

    def _host_changed(self) -> None:
        self._validated = False
        self._host_peak = max(self._host_peak, self._host_bytes())

    def _host_bytes(self) -> int:
        return sum(u.nbytes for u in self._units.values()) + self._host_state_bytes

    @property
    def units(self) -> list[str]:
        """Registered unit names, in registration order."""
        return list(self._units)

    def state_of(self, name: str) -> UnitState:
        """The unit's state in the tiers: OFFLOADED, IN_FLIGHT, SHARDED (resident, evictable) or IN_USE."""
        return self._unit(name).state

    def unit_nbytes(self, name: str) -> int:
        """Bytes of the unit's shard (the same in both tiers)."""
        return self._unit(name).nbytes

    def host_copy(self, name: str) -> torch.Tensor:
        """The manager's host copy of a unit (read it; change it only through :meth:`update_host`)."""
        return self._unit(name).host

    # ------------------------------------------------------------------------------------- validation

    def validate(self, *, max_in_use: int = 1) -> None:
        """Refuse budgets that cannot work, before anything is copied (C-ZERO-004 with the device budget).

        Device: the ``max_in_use`` largest units together must fit in ``device_budget_bytes`` (default
        1: the largest unit must fit alone). Host: the owned shards plus the registered host state must
        fit in ``host_budget_bytes`` when one is set. Raises :class:`OffloadBudgetError` (a ConfigError
        with field ``offload.device_budget_bytes`` / ``offload.host_budget_bytes``, value the budget)
        naming the largest unit and the byte counts. ``fetch`` runs this itself when registration
        changed since the last successful call (with the last ``max_in_use``).
        """
        max_in_use = require_positive_int("offload.max_in_use", max_in_use)
        budget = self.config.device_budget_bytes
        by_size = sorted(self._units.values(), key=lambda u: -u.nbytes)
        if by_size and by_size[0].nbytes > budget:
            big = by_size[0]
            raise OffloadBudgetError(
                DEVICE_BUDGET_FIELD, budget,
                f"unit {big.name!r} holds {big.nbytes} bytes, more than the device budget of {budget} "
                f"bytes; the budget must hold at least the largest unit",
                unit=big.name, needed_bytes=big.nbytes)
        together = by_size[:max_in_use]
        need = sum(u.nbytes for u in together)
        if max_in_use > 1 and need > budget:
            names = ", ".join(repr(u.name) for u in together)
            raise OffloadBudgetError(
                DEVICE_BUDGET_FIELD, budget,
                f"the {len(together)} largest units ({names}; largest {by_size[0].name!r} holds "
                f"{by_size[0].nbytes} bytes) hold {need} bytes together, more than the device budget of "
                f"{budget} bytes needed for max_in_use={max_in_use}",
                unit=by_size[0].name, needed_bytes=need)
        host_budget = self.config.host_budget_bytes
        total = self._host_bytes()
        if host_budget is not None and total > host_budget:
            shards = total - self._host_state_bytes
            entries = [(u.nbytes, "unit", u.name) for u in self._units.values()]
            entries += [(_nbytes(ts), "host state", n) for n, ts in self._host_state.items()]
            size, kind, largest = max(entries, key=lambda e: e[0])
            raise OffloadBudgetError(
                HOST_BUDGET_FIELD, host_budget,
                f"the host tier needs {total} bytes (shards {shards} + host state "
                f"{self._host_state_bytes}), more than the host budget of {host_budget} bytes; "
                f"the largest entry is {kind} {largest!r} with {size} bytes",
                unit=largest, needed_bytes=total)
        self._max_in_use = max_in_use
        self._validated = True

    # ---------------------------------------------------------------------------------- fetch/release

    def _unit(self, name: Any, field: str = "offload.unit") -> _Unit:
        unit = self._units.get(name) if isinstance(name, str) else None
        if unit is None:
            known = list(self._units)
            shown = ", ".join(repr(n) for n in known[:_SHOWN_NAMES])
            more = f", ... ({len(known)} in all)" if len(known) > _SHOWN_NAMES else ""
            raise ConfigError(field, name, f"not a registered unit (registered: {shown or 'none'}{more})")
        return unit

    def fetch(self, name: str, upcoming: Sequence[str] = ()) -> torch.Tensor:
        """The unit's shard in the device tier, then prefetches of ``upcoming[:prefetch_depth]``.

        Bitwise the host copy ("offloaded training is bitwise equal to the same run without
        offload"); the device tier stays within its budget ("C-ZERO-004 with the device budget as
        the bound"). The unit is in use until :meth:`release`. Raises :class:`OffloadBudgetError`,
        changing nothing, when the units in use leave no room for this one.
        """
        unit = self._unit(name)
        if isinstance(upcoming, (str, bytes)):
            raise ConfigError("offload.upcoming", upcoming,
                              "must be a sequence of unit names, not one string")
        if not isinstance(upcoming, Sequence):
            raise ConfigError("offload.upcoming", type(upcoming).__name__,
                              "must be a sequence (list or tuple) of unit names")
        ahead = [self._unit(n, "offload.upcoming") for n in upcoming]
        if not self._validated:
            self.validate(max_in_use=self._max_in_use)

        if unit.device_copy is None:
            plan = self._plan_evictions(unit.nbytes, protected=())
            if plan is None:
                in_use = [u for u in self._units.values() if u.in_use]
                held = sum(u.nbytes for u in in_use)
                budget = self.config.device_budget_bytes
                raise OffloadBudgetError(
                    DEVICE_BUDGET_FIELD, budget,
                    f"fetching unit {unit.name!r} ({unit.nbytes} bytes) while units in use "
                    f"({', '.join(repr(u.name) for u in in_use)}) hold {held} bytes needs "
                    f"{held + unit.nbytes} bytes, more than the device budget of {budget} bytes; "
                    f"release units before fetching more",
                    unit=unit.name, needed_bytes=held + unit.nbytes)
            self._evict(plan)
            self._copy_in(unit, wait=True)
            self._stats["misses"] += 1
        elif unit.in_flight:
            self._wait_for(unit)
            self._stats["prefetch_hits"] += 1
        else:
            self._stats["resident_hits"] += 1
        self._stats["fetches"] += 1
        unit.state = UnitState.IN_USE
        self._lru.move_to_end(unit.name)
        out = unit.device_copy
        assert out is not None
        if self._cuda:
            out.record_stream(torch.cuda.current_stream(self.device))

        window = ahead[: self.config.prefetch_depth]
        protected = {u.name for u in window} | {unit.name}
        self._last_skipped = []
        for nxt in window:
            if nxt.device_copy is not None:
                continue
            plan = self._plan_evictions(nxt.nbytes, protected)
            if plan is None:
                self._stats["prefetches_skipped"] += 1
                self._last_skipped.append(nxt.name)
                continue
            self._evict(plan)
            self._copy_in(nxt, wait=not self.config.async_prefetch)
            nxt.state = UnitState.IN_FLIGHT if self.config.async_prefetch else UnitState.SHARDED
            self._stats["prefetches_issued"] += 1
        return out

    def release(self, name: str) -> None:
        """The unit is no longer in use: evictable, but resident (a later fetch hits) until evicted."""
        unit = self._unit(name)
        if unit.in_use:
            unit.state = UnitState.SHARDED

    def update_host(self, name: str, values: torch.Tensor) -> None:
        """The host copy becomes ``values`` (copied in, same numel and dtype); any device copy is dropped.

        Serves "offloaded training is bitwise equal to the same run without offload": the next
        fetch copies exactly these bits. A device copy (resident, in use or in flight) is dropped
        and counted as an invalidation, not an eviction; an in-flight one also as a wasted prefetch.
        """
        unit = self._unit(name)
        if not isinstance(values, torch.Tensor):
            raise ConfigError("offload.values", type(values).__name__,
                              f"unit {name!r}: must be a torch.Tensor")
        if values.numel() != unit.host.numel():
            raise ConfigError("offload.values.numel", values.numel(),
                              f"unit {name!r} holds {unit.host.numel()} elements")
        if values.dtype != unit.host.dtype:
            raise ConfigError("offload.values.dtype", str(values.dtype),
                              f"unit {name!r} holds {unit.host.dtype} (no cast: the bits must be kept)")
        if unit.ready is not None:
            unit.ready.synchronize()  # the last host->device copy has read the old host values
            unit.ready = None
        src = values.detach().reshape(-1)
        if src.device.type == "cpu":
            unit.host.copy_(src)
        else:
            start = time.perf_counter()
            unit.host.copy_(src)
            elapsed = time.perf_counter() - start
            self._seconds_copying += elapsed
            self._seconds_waited += elapsed
            self._stats["bytes_device_to_host"] += unit.nbytes
        if unit.device_copy is not None:
            self._drop(unit)
            self._stats["invalidations"] += 1

    # -------------------------------------------------------------------------- budget and copy moves

    def _plan_evictions(self, need: int, protected: Any) -> list[str] | None:
        """LRU units (oldest first) to evict so ``need`` bytes fit; None when that cannot be done."""
        free = self.config.device_budget_bytes - self._device_bytes
        if need <= free:
            return []
        plan: list[str] = []
        for name in self._lru:
            unit = self._units[name]
            if unit.in_use or name in protected:
                continue
            plan.append(name)
            free += unit.nbytes
            if need <= free:
                return plan
        return None

    def _evict(self, names: list[str]) -> None:
        for name in names:
            self._drop(self._units[name])
            self._stats["evictions"] += 1
            self._evicted.append(name)

    def _drop(self, unit: _Unit) -> None:
        if unit.in_flight:
            self._stats["prefetches_wasted"] += 1
        unit.device_copy = None
        unit.state = UnitState.OFFLOADED
        self._device_bytes -= unit.nbytes
        del self._lru[unit.name]

    def _copy_in(self, unit: _Unit, *, wait: bool) -> None:
        """Copy the host shard into the device tier (room already made); account bytes and peak."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(self._stream):
                start.record(self._stream)
                copy = torch.empty(unit.host.shape, dtype=unit.host.dtype, device=self.device)
                copy.copy_(unit.host, non_blocking=True)
                end.record(self._stream)
            unit.ready = end
            self._timings.append((start, end))
            if len(self._timings) > 256:
                self._fold_timings(block=False)
            if wait:
                self._wait_for(unit)
        else:
            t0 = time.perf_counter()
            copy = unit.host.clone()
            elapsed = time.perf_counter() - t0
            self._seconds_copying += elapsed
            self._seconds_waited += elapsed  # synchronous on the calling thread
        unit.device_copy = copy
        unit.state = UnitState.SHARDED
        self._device_bytes += unit.nbytes
        self._device_peak = max(self._device_peak, self._device_bytes)
        self._lru[unit.name] = None
        self._stats["copies_host_to_device"] += 1
        self._stats["bytes_host_to_device"] += unit.nbytes

    def _wait_for(self, unit: _Unit) -> None:
        """CUDA: block until the unit's copy finished (timed) and order the current stream after it."""
        if not self._cuda or unit.ready is None:
            return
        if not unit.ready.query():
            t0 = time.perf_counter()
            unit.ready.synchronize()
            self._seconds_waited += time.perf_counter() - t0
        torch.cuda.current_stream(self.device).wait_event(unit.ready)

    def _fold_timings(self, *, block: bool) -> None:
        """Add finished CUDA copies' event times to ``seconds_copying`` (all of them when ``block``)."""
        pending = []
        for start, end in self._timings:
            if block:
                end.synchronize()
            if block or end.query():
                self._seconds_copying += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self._timings = pending

    # ------------------------------------------------------------------------------ statistics, reset

    def memory_stats(self) -> dict[str, Any]:
        """Bytes per tier, now and at peak, with the budgets; resident units oldest-used first."""
        host_now = self._host_bytes()
        return {
            "device": {
                "current": self._device_bytes,
                "peak": self._device_peak,
                "budget": self.config.device_budget_bytes,
                "in_use": sum(u.nbytes for u in self._units.values() if u.in_use),
                "in_flight": sum(u.nbytes for u in self._units.values() if u.in_flight),
            },
            "host": {
                "current": host_now,
                "peak": max(self._host_peak, host_now),
                "budget": self.config.host_budget_bytes,
                "shards": host_now - self._host_state_bytes,
                "state": self._host_state_bytes,
                "pinned": self._pin,
            },
            "resident_units": list(self._lru),
        }

    def performance_stats(self) -> dict[str, Any]:
        """Counts, bytes and seconds of the copies since construction or :meth:`reset`.

        On CUDA this waits for the copies issued so far, to read their event times.
        """
        if self._cuda:
            self._fold_timings(block=True)
        out: dict[str, Any] = dict(self._stats)
        out["hits"] = out["prefetch_hits"] + out["resident_hits"]
        copying, waited = self._seconds_copying, self._seconds_waited
        out["seconds_copying"] = copying
        out["seconds_waited"] = waited
        out["overlap_fraction"] = min(1.0, max(0.0, 1.0 - waited / copying)) if copying > 0 else 0.0
        out["asynchronous_copies"] = self._cuda and self.config.async_prefetch
        return out

    def prefetch_status(self) -> dict[str, Any]:
        """Units in flight, copies still queued on the device, resident units (LRU, oldest first), in use.

        ``in_flight``: prefetched and not fetched yet. ``queued``: those whose copy has not finished on
        the CUDA copy stream (always empty on CPU, where copies finish at once). ``resident``: every
        unit holding a device copy, in flight included. ``skipped``: names the last fetch could not
        prefetch within the budget.
        """
        in_flight = [n for n in self._lru if self._units[n].in_flight]
        queued = [n for n in in_flight if self._cuda and self._units[n].ready is not None
                  and not self._units[n].ready.query()]
        return {
            "in_flight": in_flight,
            "queued": queued,
            "resident": list(self._lru),
            "in_use": [n for n in self._lru if self._units[n].in_use],
            "skipped": list(self._last_skipped),
        }

    def eviction_log(self) -> list[str]:
        """Unit names in the order they were evicted (LRU evictions only; invalidations are not listed)."""
        return list(self._evicted)

    def reset(self) -> None:
        """Drop every device copy and all statistics; host copies and host state stay (training goes on)."""
        for unit in self._units.values():
            if unit.ready is not None:
                unit.ready.synchronize()
            unit.ready = None
            unit.device_copy = None
            unit.state = UnitState.OFFLOADED
        self._lru.clear()
        self._host_peak = self._host_bytes()
        self._reset_device_and_stats()

    def _reset_device_and_stats(self) -> None:
        self._lru.clear()
        self._device_bytes = 0
        self._device_peak = 0
        self._stats = dict.fromkeys(_COUNTERS, 0)
        self._evicted = []
        self._last_skipped = []
        self._seconds_copying = 0.0
        self._seconds_waited = 0.0
        self._timings = []
