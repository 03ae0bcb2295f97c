"""Where a flat unit's parameters are, as one value: the state every driver and the offload tier track.

A unit (:class:`~zerosim.values.flat_buffers.FlatUnit`) is a group of tensors sharded, gathered, reduced
and offloaded together. Its state says which memory holds its parameters on this rank; each member
names that memory exactly, so C-ZERO-004 (a rank holds its shard, plus gathered units only while
they are in use) can be read off the states:

* ``OFFLOADED``: the rank's shard lives on the host tier only; the device holds nothing of the unit.
* ``IN_FLIGHT``: the unit was fetched or gathered ahead of its turn and not yet taken (an offload
  prefetch copy not yet fetched, an all-gather started ahead and not waited for, or a prefetched
  all-gather kept packed until its unit is unpacked). The destination memory is allocated and
  counted; the unit's parameters cannot be computed with yet.
* ``SHARDED``: the device holds this rank's shard of the unit and nothing more (the state between
  uses under ZeRO-3; an offloaded shard resident in the device tier and evictable).
* ``IN_USE``: the rank's shard is pinned on the device while a collective reads it (an offload
  fetch until its release): the shard's memory, which may not be evicted.
* ``GATHERED``: the device holds the full unit (every rank's chunk, unpacked), for the forward or
  backward computation that needs it; freed back to ``SHARDED`` after that use.

Plain data (no torch, no numpy): the unit table (:mod:`zerosim.engine.unit_table`), the autograd-hook driver
(:mod:`zerogpu.module_engine`) and the offload manager (:mod:`zerogpu.offload`) all use it.
"""

from __future__ import annotations

from enum import Enum


class UnitState(Enum):
    """The memory a unit's parameters occupy on this rank (see the module docstring)."""

    OFFLOADED = "offloaded"
    IN_FLIGHT = "in_flight"
    SHARDED = "sharded"
    IN_USE = "in_use"
    GATHERED = "gathered"

    @property
    def on_device(self) -> bool:
        """Whether device memory is allocated for the unit beyond nothing (every state but OFFLOADED)."""
        return self is not UnitState.OFFLOADED
