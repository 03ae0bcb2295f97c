"""The unit table: where each flat unit's parameters are on one rank, and the only code that writes it.

Every driver of the engine (the block model's schedule, the autograd hooks over a torch module)
moves a unit between the states of :class:`~zerosim.values.unit_state.UnitState` through these methods
and no other way, so the transitions a rank's units may take are read here in one place:

* ``unshard``: the full unit is unpacked for the computation that needs it (-> ``GATHERED``).
* ``start_gather``: an all-gather of the unit was started, or gathered ahead and kept packed, before
  its turn (a ``SHARDED`` unit -> ``IN_FLIGHT``; a unit already ``GATHERED`` stays so).
* ``reshard``: the full unit is freed; the rank holds its shard only (-> ``SHARDED``).
* ``release``: a gathered unit is freed after its use; back to ``SHARDED`` unless its next
  all-gather is already under way (-> ``IN_FLIGHT``).
* ``drop_gather``: a unit's packed gather is freed before its turn (``IN_FLIGHT`` -> ``SHARDED``).
* ``drop_in_flight``: gathers started and never taken are dropped (every ``IN_FLIGHT`` -> ``SHARDED``).

C-ZERO-004 (a rank holds its shard, plus gathered units only while they are in use) is read off
these states: between steps every ZeRO-3 unit is ``SHARDED``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from ..values.unit_state import UnitState


class UnitTable:
    """The state of every unit of one rank (C-ZERO-004). ZeRO-3 units start as their shard; every
    other strategy holds the full parameters, so its units are ``GATHERED`` throughout."""

    def __init__(self, names: Iterable[str], sharded: bool):
        initial = UnitState.SHARDED if sharded else UnitState.GATHERED
        self._states: dict[str, UnitState] = {name: initial for name in names}

    def __getitem__(self, name: str) -> UnitState:
        return self._states[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def values(self) -> list[UnitState]:
        """Every unit's state, in unit order."""
        return list(self._states.values())

    def unshard(self, name: str) -> None:
        """The full unit is unpacked for the computation that needs it."""
        self._states[name] = UnitState.GATHERED

    def start_gather(self, name: str) -> None:
        """An all-gather of the unit was started (or gathered ahead and kept packed) before its turn."""
        if self._states[name] is UnitState.SHARDED:
            self._states[name] = UnitState.IN_FLIGHT

    def reshard(self, name: str) -> None:
        """The full unit (or its packed gather) is freed; the rank holds its shard only."""
        self._states[name] = UnitState.SHARDED

    def release(self, name: str, regathering: bool = False) -> None:
        """A gathered unit is freed after its use; ``regathering``: its next all-gather is under way."""
        self._states[name] = UnitState.IN_FLIGHT if regathering else UnitState.SHARDED

    def drop_gather(self, name: str) -> None:
        """The unit's packed gather is freed before it was unpacked: an in-flight unit is back to its
        shard."""
        if self._states[name] is UnitState.IN_FLIGHT:
            self._states[name] = UnitState.SHARDED

    def drop_in_flight(self) -> None:
        """Gathers started and never taken are dropped: every in-flight unit is back to its shard."""
        for name, state in self._states.items():
            if state is UnitState.IN_FLIGHT:
                self._states[name] = UnitState.SHARDED
