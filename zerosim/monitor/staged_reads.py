"""Device values read on the host without making the host wait, for C-ZERO-002's step checks
(``grad_accounting``, ``update``) on an accelerator.

A step check needs a few values the device holds: the sampled gradient, parameter and optimizer state
before and after the step, the step counter a fused optimizer keeps on the device, the gradients'
projections. Reading one there (``.tolist()``, ``float()``) makes the host wait for every kernel queued
before it. :class:`Staged` takes a nest of dicts, lists and tuples whose leaves are tensors: the leaves
on an accelerator are converted to float64 and concatenated there, copied into pinned host memory by one
non-blocking copy per device, and a CUDA event is recorded behind the copy; the leaves on the host are
read at once (a read is free there). :meth:`Staged.result` gives the same nest with each tensor replaced
by its values, flat (a list, or a number for a 0-d tensor), as ``tensor.double().cpu().reshape(-1)
.tolist()`` gives them.
It is meant to be called at a later check (or at close), when :meth:`Staged.ready` is long true; if the
copy has not landed yet (checks coming faster than the device runs the steps) it waits for it then.

``defer=False`` reads every leaf at once, as the step checks read on the CPU; ``defer=True`` on the CPU
copies the values at staging and gives them at :meth:`Staged.result` (the same values, later), which is
how the deferred path is tested without an accelerator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def defers(device: torch.device | str) -> bool:
    """Whether the step checks stage their reads on ``device`` (C-ZERO-002): on a CUDA device, where a
    read makes the host wait for the step; not on the host, where a read is free."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class _Slot:
    """Where a staged leaf's values are: the device group, the offset in its vector, the count, and
    whether the leaf was 0-d (given back as a number)."""

    group: int
    start: int
    count: int
    scalar: bool


class Staged:
    """The tensor leaves of ``tree`` on their way to the host (see the module docstring; C-ZERO-002)."""

    def __init__(self, tree: Any, defer: bool):
        self.defer = defer
        self.waited = False  # whether result() found a copy still under way and waited for it
        self._parts: dict[torch.device, list[torch.Tensor]] = {}
        self._sizes: dict[torch.device, int] = {}
        self._skeleton = self._strip(tree)
        #: per device group: its values on the host, or the pinned tensor a copy is landing in
        self._host: list[list[float] | torch.Tensor] = []
        self._events: list[Any] = []
        for device, parts in self._parts.items():
            flat = torch.cat(parts)
            if device.type == "cuda":
                self._host.append(flat.to("cpu", non_blocking=True))  # pinned, behind the step's kernels
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))
                self._events.append(event)
            else:
                self._host.append(flat.tolist())  # a copy of the values now: free on the host
        self._parts = {}

    def _strip(self, node: Any) -> Any:
        """``node`` with each tensor leaf replaced by its :class:`_Slot` (deferring: queued for one
        copy per device) or its :class:`_Value` (not deferring: read now)."""
        if isinstance(node, torch.Tensor):
            leaf = node.detach()
            if not self.defer:
                values = leaf.double().cpu()
                return _Value(values.item() if leaf.dim() == 0 else values.reshape(-1).tolist())
            device = leaf.device
            group = list(self._parts).index(device) if device in self._parts else len(self._parts)
            start = self._sizes.get(device, 0)
            flat = leaf.reshape(-1).to(torch.float64)
            self._parts.setdefault(device, []).append(flat)
            self._sizes[device] = start + flat.numel()
            return _Slot(group, start, flat.numel(), leaf.dim() == 0)
        if isinstance(node, dict):
            return {k: self._strip(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(self._strip(v) for v in node)
        return node

    def ready(self) -> bool:
        """Whether every copy has landed (never waits)."""
        return all(event.query() for event in self._events)

    def result(self) -> Any:
        """The nest with each tensor leaf replaced by its float64 values (a list; a number for a 0-d
        tensor); waits for a copy still under way (:attr:`waited` says so)."""
        if self._events:
            if not self.ready():
                self.waited = True
                for event in self._events:
                    event.synchronize()
            self._events = []
            self._host = [h.tolist() if isinstance(h, torch.Tensor) else h for h in self._host]
        return self._fill(self._skeleton)

    def _fill(self, node: Any) -> Any:
        if isinstance(node, _Value):
            return node.values
        if isinstance(node, _Slot):
            host = self._host[node.group]
            assert not isinstance(host, torch.Tensor)  # result() read every landed copy
            values = host[node.start : node.start + node.count]
            return values[0] if node.scalar else values
        if isinstance(node, dict):
            return {k: self._fill(v) for k, v in node.items()}
        if isinstance(node, list | tuple):
            return type(node)(self._fill(v) for v in node)
        return node


@dataclass(frozen=True)
class _Value:
    """A leaf read at staging (``values``: a list, or a number for a 0-d tensor)."""

    values: Any
