"""What one rank of a DeepSpeed ZeRO run holds (stage 1, 2 or 3), read from DeepSpeed's own partition
metadata, and the sum of squares of its reduced gradient partition, measured inside DeepSpeed's step.

The layout:

* stages 1 and 2: every parameter is held whole by every rank (gathered after the step: C-ZERO-003
  compares them); each parameter group is one flat buffer cut into equal partitions
  (``partition_size``), rank ``r`` owning partition ``r``; the fp32 master partition
  (``single_partition_of_fp32_groups``) keys the optimizer state;
* stage 3: every parameter is cut alone into equal partitions; the rank holds its ``ds_tensor`` (its
  element range ``[r * part, (r + 1) * part)`` clipped to the parameter) and owns that range; the
  state is keyed by the group's flat fp32 partition (``fp32_partitioned_groups_flat``), laid out as
  the group's parameters' partitions in order.

The gradient (C-ZERO-002's ``grad_norm`` clause): DeepSpeed frees its gradient partitions inside its
step, before a training loop could look at them. :class:`GradientSquares` wraps two methods of the
engine's ZeRO optimizer (instance attributes; the class is untouched): ``step``, to note the engine's
step number and the loss scale the backward used, and ``unscale_and_clip_grads``, which DeepSpeed calls
once per parameter group with that group's reduced fp32 gradient partition after computing the norm it
logs and before it unscales and clips it (stages 1 and 2: ``single_partition_of_fp32_groups[i].grad``;
stage 3: ``fp32_partitioned_groups_flat[i].grad``). On a step the monitor checks, the wrapper adds the
squares of the owned elements of that partition (:func:`~zerosim.monitor.row.grad_accumulation`)
(padding left out) and calls DeepSpeed's method unchanged; it reads, never writes, so every training
number keeps its bits. The sum is divided by the square of the loss scale (a power of two: exact),
giving the squares of the gradient whose norm ``engine.get_global_grad_norm()`` reports.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .layouts import LiveLayout, OwnedState, dtype_name
from .row import grad_accumulation

#: why a layout read without :class:`GradientSquares` has no gradient
GRADS_NOTE = "DeepSpeed frees its gradient partitions inside its step"
#: why a layout read with it has none at this check
UNMEASURED_NOTE = ("DeepSpeed's last step measured no gradient partition: a step skipped on an fp16 "
                   "overflow, a check at a step that is not DeepSpeed's (engine.global_steps - 1, a "
                   "multiple of every), or a DeepSpeed whose ZeRO step no longer calls "
                   "unscale_and_clip_grads once per group")


def is_deepspeed_engine(obj: Any) -> bool:
    """A DeepSpeed engine (``deepspeed.initialize``'s first result), told by what the monitor reads."""
    return all(hasattr(obj, a) for a in ("zero_optimization_stage", "optimizer", "module", "global_steps"))


def engine_stage(engine: Any) -> int:
    """The engine's ZeRO stage; ConfigError unless 1, 2 or 3."""
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else -1
    if stage not in (1, 2, 3):
        raise ConfigError("zero_optimization.stage", stage,
                          "the monitor reads DeepSpeed ZeRO stages 1, 2 and 3")
    return stage


def owned_grad_slices(optimizer: Any, stage: int, rank: int) -> list[list[tuple[int, int]]]:
    """Per parameter group, the (offset, count) slices of the rank's flat gradient partition that hold
    owned elements (the rest is padding)."""
    out: list[list[tuple[int, int]]] = []
    if stage == 3:
        for params in optimizer.fp16_groups:
            slices, offset = [], 0
            for p in params:
                part = int(p.ds_tensor.ds_numel)
                count = min(part, int(p.ds_numel) - rank * part)
                if count > 0:
                    slices.append((offset, count))
                offset += part
            out.append(slices)
        return out
    for group, params in enumerate(optimizer.round_robin_bit16_groups):
        part = int(optimizer.partition_size[group])
        total = sum(p.numel() for p in params)
        count = min(part, total - rank * part)
        out.append([(0, count)] if count > 0 else [])
    return out


class GradientSquares:
    """The sum of squares (each piece's norm accumulated as :func:`~zerosim.monitor.row.grad_accumulation`
    says, squared and summed in float64) of this rank's reduced gradient partition at the steps the monitor
    checks (every ``every``-th DeepSpeed step), measured inside DeepSpeed's step (see the module
    docstring)."""

    def __init__(self, engine: Any, every: int):
        self.engine = engine
        self.every = every
        self.optimizer = engine.optimizer
        self.stage = engine_stage(engine)
        self.slices = owned_grad_slices(self.optimizer, self.stage, dist.get_rank())
        self._armed_step: int | None = None
        self._scale = 1.0
        self._norms: list[torch.Tensor] = []
        self._count = 0  # owned elements summed so far in this step
        self._groups = 0  # parameter groups measured so far in this step
        self._measured: tuple[int, float, int] | None = None  # (step, sum of squares, elements)
        self._installed = False

    def install(self) -> None:
        """Wrap the optimizer's ``step`` and ``unscale_and_clip_grads`` (once)."""
        if self._installed:
            return
        opt = self.optimizer
        original_step, original_unscale = opt.step, opt.unscale_and_clip_grads

        def step(*args: Any, **kwargs: Any) -> Any:
            self._begin(int(self.engine.global_steps))
            try:
                return original_step(*args, **kwargs)
            finally:
                self._end()

        first = "sub_group_id" if self.stage == 3 else "grad_groups_flat"  # DeepSpeed's parameter names

        def unscale_and_clip_grads(*args: Any, **kwargs: Any) -> Any:
            if self._armed_step is not None:
                self._add(args[0] if args else kwargs[first])
            return original_unscale(*args, **kwargs)

        opt.step, opt.unscale_and_clip_grads = step, unscale_and_clip_grads
        self._installed = True

    def remove(self) -> None:
        """Take the wrappers off (DeepSpeed's own methods again)."""
        if self._installed:
            for name in ("step", "unscale_and_clip_grads"):
                self.optimizer.__dict__.pop(name, None)
            self._installed = False

    def _begin(self, step: int) -> None:
        self._measured = None
        self._norms, self._count, self._groups = [], 0, 0
        self._armed_step = step if step % self.every == 0 else None
        self._scale = float(getattr(self.optimizer, "loss_scale", 1.0) or 1.0)

    def _add(self, which: Any) -> None:
        """The squares of one group's partition: ``which`` is the group index (stage 3) or the list
        holding the partition (stages 1 and 2), told apart by identity with the groups' ``.grad``."""
        if self.stage == 3:
            group = int(which)
            grad = self.optimizer.fp32_partitioned_groups_flat[group].grad
        else:
            grad = which[0] if isinstance(which, (list, tuple)) else which
            masters = self.optimizer.single_partition_of_fp32_groups
            group = next((i for i, m in enumerate(masters) if m.grad is grad), -1)
            if group < 0:
                return
        pieces = [grad.view(-1).narrow(0, a, n) for a, n in self.slices[group]]
        if pieces:
            self._norms.extend(torch._foreach_norm(pieces, 2, dtype=grad_accumulation(grad.dtype)))
        self._count += sum(n for _, n in self.slices[group])
        self._groups += 1

    def _end(self) -> None:
        """Keep the step's sum when every group was measured (a step DeepSpeed skips on an overflow
        clips no group: nothing kept)."""
        step, self._armed_step = self._armed_step, None
        norms, self._norms = self._norms, []
        if step is None or self._groups != len(self.slices):
            return
        squares = float((torch.stack(norms) ** 2).sum()) if norms else 0.0
        # the partitions hold the loss-scaled gradient (scale 1 without fp16; DeepSpeed's dynamic
        # scale is a power of two, so this division is exact)
        self._measured = (step, squares / (self._scale * self._scale), self._count)

    def measured(self) -> tuple[float, int] | None:
        """(sum of squares, elements) of the engine's last optimizer step, when it was measured."""
        m = self._measured
        if m is None or m[0] != int(self.engine.global_steps) - 1:
            return None
        return m[1], m[2]


def deepspeed_layout(engine: Any, squares: GradientSquares | None = None) -> LiveLayout:
    """The layout of a DeepSpeed engine on this rank (see the module docstring); with ``squares``, the
    reduced gradient's squares it measured at the last step (else a note says why there are none)."""
    stage = engine_stage(engine)
    optimizer = engine.optimizer
    named = list(engine.module.named_parameters())
    layout = LiveLayout(f"deepspeed-{stage}", numels={}, grads_note=None if squares else GRADS_NOTE)
    if squares is not None:
        layout.grad_squares = squares.measured()
        layout.grads_note = UNMEASURED_NOTE if layout.grad_squares is None else None
    for name, p in named:
        layout.numels[name] = int(p.ds_numel) if stage == 3 else p.numel()
        layout.owned[name] = []
        layout.grad_dtype = dtype_name(p)
    name_of = {id(p): name for name, p in named}
    rank = dist.get_rank()
    inner = optimizer.optimizer.state
    if stage == 3:
        for group, params in enumerate(optimizer.fp16_groups):
            flat = optimizer.fp32_partitioned_groups_flat[group]
            state = inner.get(flat)
            offset = 0
            for p in params:
                part = int(p.ds_tensor.ds_numel)
                start, stop = rank * part, min((rank + 1) * part, int(p.ds_numel))
                name = name_of[id(p)]
                if stop > start:
                    layout.held.append((name, start, stop, p.ds_tensor[: stop - start]))
                    layout.owned[name].append((start, stop))
                    layout.states.append(OwnedState(name, stop - start, _slice(state, offset, stop - start)))
                offset += part
        return layout
    for name, p in named:
        layout.held.append((name, 0, p.numel(), p.detach()))
    for group, params in enumerate(optimizer.round_robin_bit16_groups):
        part = int(optimizer.partition_size[group])
        state = inner.get(optimizer.single_partition_of_fp32_groups[group])
        lo, hi, offset = rank * part, (rank + 1) * part, 0
        for p in params:
            start, stop = max(lo, offset), min(hi, offset + p.numel())
            if stop > start:
                name = name_of[id(p)]
                layout.owned[name].append((start - offset, stop - offset))
                layout.states.append(OwnedState(name, stop - start, _slice(state, start - lo, stop - start)))
            offset += p.numel()
    return layout


def _slice(state: dict[str, Any] | None, at: int, count: int) -> dict[str, Any] | None:
    """One piece of a flat partition's optimizer state (the step counter kept whole)."""
    if not state:
        return None
    return {k: (v if k == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0 else v[at: at + count])
            for k, v in state.items()}


class DeepSpeedReader:
    """The monitor's layout reader of a DeepSpeed engine: installs :class:`GradientSquares` on its first
    read (so a monitor turned off by bad input wraps nothing) and removes it at :meth:`close`."""

    def __init__(self, engine: Any, every: int):
        self.engine = engine
        self.every = every
        self.squares: GradientSquares | None = None

    def __call__(self) -> LiveLayout:
        if self.squares is None:
            squares = GradientSquares(self.engine, self.every)
            layout = deepspeed_layout(self.engine, squares)  # raises before wrapping when unreadable
            squares.install()
            self.squares = squares
            return layout
        return deepspeed_layout(self.engine, self.squares)

    def close(self) -> None:
        if self.squares is not None:
            self.squares.remove()
