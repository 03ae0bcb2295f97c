"""The ZeRO-Offload step as a pure plan: which shard goes down or up when, within the device budget.

:func:`plan_step` computes, from unit sizes alone (no tensors, no device), the order of events of
one offloaded ZeRO-3 step and what they cost:

- **forward**, units in ``forward_order``: each unit's parameter shard is fetched into the device tier
  (copied host->device unless resident), used, released; the next ``prefetch_depth`` units are copied
  ahead on the copy stream. The policy is :class:`zerogpu.offload.OffloadManager`'s, replayed on
  byte counts: a unit already resident is a resident hit, one copied ahead a prefetch hit, otherwise
  a miss copied at once; room is made by evicting least-recently-used units that are neither in use
  nor in the prefetch window; a prefetch that cannot fit is skipped.
- **backward**, units in ``backward_order``: the same fetches, and with ``offload_optimizer`` each
  unit's reduced gradient shard (``grad_nbytes``) appears on the device after its reduce-scatter, is
  copied device->host on the copy stream while the next unit's backward computes, and is freed once
  that compute ends (the copy had all of it to finish); the host then steps that unit's fp32 master
  and optimizer state (a ``host_step`` event, on the CPU, while the device goes on). The last unit's
  gradient copy has no compute after it to hide behind: it is waited for.
- **update**: every unit's device copy is dropped (its host values changed: an invalidation); the
  next step's forward fetches the updated shards (the parameters going up).

Accounting, exact and in integers: the device tier's bytes after every event (parameter shards,
copies in flight and gradient shards on the device), its peak, bytes host->device and device->host,
and which copies are issued *ahead* (a prefetch, or a gradient copy with a unit's compute after it)
or *blocking* (a miss, the last gradient copy). ``ahead_fraction`` = ahead bytes / copied bytes is
what the schedule allows to overlap with compute: the measured overlap on a GPU can reach it only if
each copy is no longer than the compute it runs beside.

A unit's gradient is taken as ready right after its own backward compute, in ``backward_order``.
A unit whose gradients complete later than its parameters are gathered (a root unit holding the
embedding, whose gradient comes last, and parameters used first in backward) is modelled by its place in
``backward_order``: the default order (registration order reversed) puts such a root last, where its
gradient completes; the fetches it needs earlier are then counted as a later fetch.

The plan raises :class:`zerogpu.offload_config.OffloadBudgetError` when the budget cannot hold what
one event needs (a unit in use and, with ``offload_optimizer``, two gradient shards).
tests/test_zerogpu_offload_plan.py replays every plan through a real OffloadManager on the CPU and
requires the same fetch outcomes, evictions, bytes and device peak.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zerosim.errors import ConfigError, require_non_negative_int, require_positive_int

from .offload_config import DEVICE_BUDGET_FIELD, OffloadBudgetError

PHASES = ("forward", "backward", "update")
#: event kinds: a parameter shard copied host->device (``ahead`` when it is a prefetch), a unit's
#: compute, an eviction, a gradient shard produced on the device, copied device->host, freed, a host
#: optimizer step of a unit's master piece, an invalidation after the update
EVENT_KINDS = ("h2d_param", "compute", "evict", "grad_on_device", "d2h_grad", "free_grad", "host_step",
               "invalidate")


@dataclass(frozen=True)
class Event:
    """One event of the plan; ``device_bytes`` is the device tier's bytes right after it."""

    phase: str
    kind: str
    unit: str
    nbytes: int
    ahead: bool
    device_bytes: int


@dataclass
class StepPlan:
    """The events of one offloaded step and their accounting (see the module docstring)."""

    events: list[Event] = field(default_factory=list)
    device_peak: int = 0
    budget: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    bytes_host_to_device: int = 0
    bytes_device_to_host: int = 0
    bytes_ahead: int = 0
    bytes_blocking: int = 0
    evicted: list[str] = field(default_factory=list)

    @property
    def ahead_fraction(self) -> float:
        """Copied bytes issued ahead of their use over all copied bytes (0 when nothing is copied)."""
        total = self.bytes_ahead + self.bytes_blocking
        return self.bytes_ahead / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"device_peak": self.device_peak, "budget": self.budget, "counters": dict(self.counters),
                "bytes_host_to_device": self.bytes_host_to_device,
                "bytes_device_to_host": self.bytes_device_to_host, "bytes_ahead": self.bytes_ahead,
                "bytes_blocking": self.bytes_blocking, "ahead_fraction": self.ahead_fraction,
                "evicted": list(self.evicted), "events": len(self.events)}


_COUNTERS = ("fetches", "prefetch_hits", "resident_hits", "misses", "prefetches_issued",
             "prefetches_skipped", "prefetches_wasted", "evictions", "invalidations")


class _Planner:
    """The offload manager's tiers on byte counts: resident units (LRU order), their states."""

    def __init__(self, sizes: dict[str, int], budget: int, depth: int, async_prefetch: bool):
        self.sizes, self.budget, self.depth, self.async_prefetch = sizes, budget, depth, async_prefetch
        #: resident unit -> "in_use" | "in_flight" | "resident", least recently used first
        self.lru: OrderedDict[str, str] = OrderedDict()
        self.grad_bytes = 0
        self.plan = StepPlan(budget=budget, counters=dict.fromkeys(_COUNTERS, 0))
        self.phase = "forward"

    def used(self) -> int:
        return sum(self.sizes[n] for n in self.lru) + self.grad_bytes

    def emit(self, kind: str, unit: str, nbytes: int, ahead: bool = False) -> None:
        now = self.used()
        self.plan.events.append(Event(self.phase, kind, unit, nbytes, ahead, now))
        self.plan.device_peak = max(self.plan.device_peak, now)

    def room(self, need: int, protected: set[str]) -> list[str] | None:
        free = self.budget - self.used()
        if need <= free:
            return []
        out: list[str] = []
        for name, state in self.lru.items():
            if state == "in_use" or name in protected:
                continue
            out.append(name)
            free += self.sizes[name]
            if need <= free:
                return out
        return None

    def evict(self, names: list[str]) -> None:
        for name in names:
            if self.lru.pop(name) == "in_flight":
                self.plan.counters["prefetches_wasted"] += 1
            self.plan.counters["evictions"] += 1
            self.plan.evicted.append(name)
            self.emit("evict", name, self.sizes[name])

    def copy_in(self, name: str, *, ahead: bool) -> None:
        self.lru[name] = "in_flight" if ahead and self.async_prefetch else "resident"
        nbytes = self.sizes[name]
        self.plan.bytes_host_to_device += nbytes
        if ahead and self.async_prefetch:
            self.plan.bytes_ahead += nbytes
        else:
            self.plan.bytes_blocking += nbytes
        self.emit("h2d_param", name, nbytes, ahead=ahead and self.async_prefetch)

    def refuse(self, what: str, unit: str, need: int) -> OffloadBudgetError:
        held = [n for n, s in self.lru.items() if s == "in_use"]
        names = ", ".join(map(repr, held)) or "none"
        return OffloadBudgetError(
            DEVICE_BUDGET_FIELD, self.budget,
            f"{what} of unit {unit!r} ({need} bytes) does not fit the device budget of {self.budget} bytes "
            f"beside units in use ({names}: {sum(self.sizes[n] for n in held)} bytes) and gradient shards "
            f"({self.grad_bytes} bytes)", unit=unit, needed_bytes=need)

    def fetch(self, name: str, upcoming: Sequence[str]) -> None:
        c = self.plan.counters
        state = self.lru.get(name)
        if state is None:
            plan = self.room(self.sizes[name], set())
            if plan is None:
                raise self.refuse("fetching", name, self.sizes[name])
            self.evict(plan)
            self.copy_in(name, ahead=False)
            c["misses"] += 1
        elif state == "in_flight":
            c["prefetch_hits"] += 1
        else:
            c["resident_hits"] += 1
        c["fetches"] += 1
        self.lru[name] = "in_use"
        self.lru.move_to_end(name)
        window = list(upcoming[: self.depth])
        protected = {*window, name}
        for nxt in window:
            if nxt in self.lru:
                continue
            plan = self.room(self.sizes[nxt], protected)
            if plan is None:
                c["prefetches_skipped"] += 1
                continue
            self.evict(plan)
            self.copy_in(nxt, ahead=True)
            c["prefetches_issued"] += 1

    def release(self, name: str) -> None:
        if self.lru.get(name) == "in_use":
            self.lru[name] = "resident"


def plan_step(units: Sequence[tuple[str, int]], budget: int, *, forward_order: Sequence[str] | None = None,
              backward_order: Sequence[str] | None = None, prefetch_depth: int = 1,
              async_prefetch: bool = True, offload_optimizer: bool = True,
              grad_nbytes: dict[str, int] | None = None) -> StepPlan:
    """The plan of one offloaded step (module docstring). ``units``: ``(name, parameter shard bytes)``
    in registration order; orders default to that order and its reverse; ``grad_nbytes`` (default:
    the parameter shard's bytes, fp32 gradients) the reduced gradient shard of each unit."""
    sizes: dict[str, int] = {}
    for name, nbytes in units:
        if not isinstance(name, str) or not name or name in sizes:
            raise ConfigError("offload_plan.units", name, "unit names must be distinct non-empty strings")
        sizes[name] = require_non_negative_int(f"offload_plan.units[{name!r}]", nbytes)
    require_positive_int(DEVICE_BUDGET_FIELD, budget)
    require_non_negative_int("offload.prefetch_depth", prefetch_depth)
    fwd = list(forward_order) if forward_order is not None else list(sizes)
    bwd = list(backward_order) if backward_order is not None else list(reversed(fwd))
    for order_name, order in (("forward_order", fwd), ("backward_order", bwd)):
        unknown = [n for n in order if n not in sizes]
        if unknown:
            raise ConfigError(f"offload_plan.{order_name}", unknown[0], "not a unit of the plan")
    grads = {n: (grad_nbytes or {}).get(n, sizes[n]) for n in sizes}
    p = _Planner(sizes, budget, prefetch_depth, async_prefetch)

    for at, name in enumerate(fwd):
        p.fetch(name, fwd[at + 1:])
        p.emit("compute", name, 0)
        p.release(name)

    p.phase = "backward"
    pending: str | None = None  # the gradient shard whose copy runs beside the current compute
    for at, name in enumerate(bwd):
        p.fetch(name, bwd[at + 1:])
        p.emit("compute", name, 0)
        p.release(name)
        if offload_optimizer:
            if p.room(grads[name], set()) is None:
                raise p.refuse("the reduced gradient shard", name, grads[name])
            p.evict(p.room(grads[name], set()) or [])
            p.grad_bytes += grads[name]
            p.emit("grad_on_device", name, grads[name])
            if pending is not None:  # its copy ran beside this unit's compute: done, freed, stepped
                p.grad_bytes -= grads[pending]
                p.emit("free_grad", pending, grads[pending])
                p.emit("host_step", pending, 0)
            last = at == len(bwd) - 1
            p.plan.bytes_device_to_host += grads[name]
            if last:
                p.plan.bytes_blocking += grads[name]
            else:
                p.plan.bytes_ahead += grads[name]
            p.emit("d2h_grad", name, grads[name], ahead=not last)
            pending = name
    if pending is not None:
        p.grad_bytes -= grads[pending]
        p.emit("free_grad", pending, grads[pending])
        p.emit("host_step", pending, 0)

    p.phase = "update"
    for name in list(sizes):
        if name in p.lru:
            if p.lru.pop(name) == "in_flight":
                p.plan.counters["prefetches_wasted"] += 1
            p.plan.counters["invalidations"] += 1
            p.emit("invalidate", name, sizes[name])
    return p.plan
