"""Reduced gradient shards down to the host optimizer, and each unit's host step once its copy landed.

The runtime half of :func:`zerogpu.offload_plan.plan_step`'s backward phase. After a unit's
reduce-scatter the engine hands its gradient shard to :meth:`GradientOffload.grad_ready`; the shard
is copied into the unit's piece of the :class:`zerogpu.host_optimizer.HostOptimizer`'s gradient
buffer and, once that copy has landed, the host steps the unit's piece of the fp32 master and
optimizer state (:meth:`HostOptimizer.step_piece`). :meth:`GradientOffload.finish` waits for the
copies still in flight, steps their pieces and ends the step; the updated master pieces are then
what goes up (:meth:`GradientOffload.updated`), e.g. into :meth:`zerogpu.offload.OffloadManager.update_host`.

On CUDA each copy is issued ``non_blocking`` on a side stream, ordered after the work queued so far
on the current stream (an event), into pinned host memory, and timed with CUDA events; a piece is
stepped at the next :meth:`grad_ready` whose check finds its copy done (a query, no wait), or at
:meth:`finish` (a wait, timed: ``seconds_waited``). The gradient tensor is ``record_stream``-ed on the
side stream so its memory is not reused before the copy has read it. On the CPU the copy is a plain
copy on the calling thread and the piece is stepped at once: the same pieces, in the same order, with
the same bits, so the bookkeeping is tested anywhere (tests/test_zerogpu_offload_gradients.py).

Bits: the copy moves bits and the pieces tile the shard, so the step equals the host optimizer's
whole-shard step (bitwise for the reference kernel at any piece boundaries, for the fused kernel where
piece lengths are multiples of 16: see :mod:`zerogpu.host_optimizer`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from zerosim.errors import ConfigError

from .host_optimizer import HostOptimizer


class GradientOffload:
    """Gradient shards of named units (``pieces``: name -> ``(lo, hi)`` in the host shard) down to
    ``host``, each piece stepped once its copy has landed; one optimizer step per :meth:`finish`."""

    def __init__(self, host: HostOptimizer, pieces: dict[str, tuple[int, int]],
                 device: str | torch.device = "cpu"):
        if not isinstance(host, HostOptimizer):
            raise ConfigError("offload_gradients.host", type(host).__name__, "must be a HostOptimizer")
        covered = 0
        for name, (lo, hi) in sorted(pieces.items(), key=lambda kv: kv[1]):
            if lo != covered or hi < lo:
                raise ConfigError("offload_gradients.pieces", {name: (lo, hi)},
                                  f"the pieces must tile [0, {host.numel}) once (next expected at {covered})")
            covered = hi
        if covered != host.numel:
            raise ConfigError("offload_gradients.pieces", covered, f"the pieces cover [0, {covered}), "
                              f"not the host shard's [0, {host.numel})")
        self.host = host
        self.pieces = dict(pieces)
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda and not host.pinned:
            raise ConfigError("offload_gradients.host", "not pinned",
                              "copies from a GPU need the host optimizer's buffers pinned (pin_memory=True)")
        self._stream: Any = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._pending: list[tuple[str, Any, Any]] = []  # (unit, start event, done event), in copy order
        self._received: set[str] = set()
        self.stats = {"copies_device_to_host": 0, "bytes_device_to_host": 0, "pieces_stepped_early": 0,
                      "pieces_stepped_at_finish": 0}
        self.seconds_copying = 0.0
        self.seconds_waited = 0.0

    def grad_ready(self, name: str, grad: torch.Tensor) -> None:
        """The unit's reduced gradient shard is complete (queued on the current stream): copy it down."""
        if name not in self.pieces:
            raise ConfigError("offload_gradients.unit", name, f"not a unit of this shard "
                              f"({', '.join(map(repr, list(self.pieces)[:6]))}, ...)")
        if name in self._received:
            raise ConfigError("offload_gradients.unit", name, "its gradient was already received this step")
        lo, hi = self.pieces[name]
        dtype = self.host.grad.dtype
        if not isinstance(grad, torch.Tensor) or grad.numel() != hi - lo or grad.dtype != dtype:
            raise ConfigError("offload_gradients.grad", getattr(grad, "shape", type(grad).__name__),
                              f"unit {name!r} needs {hi - lo} elements of {self.host.grad.dtype}")
        target = self.host.grad[lo:hi]
        src = grad.detach().reshape(-1)
        if self._cuda:
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                start.record(self._stream)
                target.copy_(src, non_blocking=True)
                done.record(self._stream)
            src.record_stream(self._stream)
            self._pending.append((name, start, done))
        else:
            t0 = time.perf_counter()
            target.copy_(src)
            self.seconds_copying += time.perf_counter() - t0
            self._pending.append((name, None, None))
        self._received.add(name)
        self.stats["copies_device_to_host"] += 1
        self.stats["bytes_device_to_host"] += (hi - lo) * target.element_size()
        self._step_landed(block=False)

    def _step_landed(self, *, block: bool) -> None:
        """Step the pieces whose copies have finished, in copy order (all of them when ``block``)."""
        still: list[tuple[str, Any, Any]] = []
        for name, start, done in self._pending:
            if still or (done is not None and not block and not done.query()):
                still.append((name, start, done))  # keep copy order: nothing steps past a pending copy
                continue
            if done is not None:
                if not done.query():
                    t0 = time.perf_counter()
                    done.synchronize()
                    self.seconds_waited += time.perf_counter() - t0
                self.seconds_copying += start.elapsed_time(done) / 1000.0
            lo, hi = self.pieces[name]
            self.host.step_piece(lo, hi)
            self.stats["pieces_stepped_at_finish" if block else "pieces_stepped_early"] += 1
        self._pending = still

    def finish(self) -> None:
        """Wait for the copies in flight, step their pieces, end the optimizer step. Every unit's
        gradient must have been received."""
        missing = [n for n in self.pieces if n not in self._received]
        if missing:
            raise ConfigError("offload_gradients.finish", missing[:6],
                              "no gradient received for these units this step")
        self._step_landed(block=True)
        self.host.finish_step()
        self._received.clear()

    def updated(self, name: str) -> torch.Tensor:
        """The unit's piece of the updated master (a view of host memory): what goes up next."""
        lo, hi = self.pieces[name]
        return self.host.master[lo:hi]
