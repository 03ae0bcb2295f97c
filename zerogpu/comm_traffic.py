"""Traffic accounting of the TorchCommunicator: the collective the engine asked for, ring model.

Every path a collective takes on torch.distributed (native, or one of the decompositions of
:mod:`zerogpu.comm_decompose`) records the traffic of **the collective the engine asked for**, in the
ring attribution of :func:`zerosim.comm.base.ring_bytes` the simulator and the MPI backend use,
because C-ZERO-005 checks the engine's schedule, not the transport. Calls a fallback served (a
reduce-scatter done as an all-reduce, about twice the bytes) are counted apart, per collective, so a
report can say so.
"""

from __future__ import annotations

import torch

from zerosim.comm.base import TrafficCounter, dtype_name


def nbytes(t: torch.Tensor) -> int:
    """The bytes of a tensor's elements."""
    return int(t.numel() * t.element_size())


class GroupTraffic:
    """One group's records in a (possibly shared) :class:`TrafficCounter`, with its fallback counts."""

    def __init__(self, counter: TrafficCounter, group_name: str, world_size: int,
                 fallbacks: dict[str, int]):
        self.counter, self.group_name, self.world_size = counter, group_name, world_size
        self.fallbacks = fallbacks  # collective -> calls done by a fallback (shared with split groups)

    def all_reduce(self, t: torch.Tensor) -> None:
        self.counter.record(self.group_name, "all_reduce", nbytes(t), self.world_size, dtype=dtype_name(t))

    def reduce_scatter(self, t: torch.Tensor) -> None:
        """``t``: the full input buffer."""
        self.counter.record(self.group_name, "reduce_scatter", nbytes(t), self.world_size,
                            dtype=dtype_name(t))

    def all_gather(self, t: torch.Tensor) -> None:
        """``t``: this rank's chunk (the gathered buffer is ``world_size`` of them)."""
        self.counter.record(self.group_name, "all_gather", nbytes(t) * self.world_size, self.world_size,
                            dtype=dtype_name(t))

    def broadcast(self, t: torch.Tensor, is_root: bool) -> None:
        self.counter.record(self.group_name, "broadcast", nbytes(t), self.world_size, is_root=is_root,
                            dtype=dtype_name(t))

    def barrier(self) -> None:
        self.counter.record(self.group_name, "barrier", 0, self.world_size)

    def fallback(self, collective: str) -> None:
        """One call of ``collective`` served by a fallback path."""
        self.fallbacks[collective] = self.fallbacks.get(collective, 0) + 1
