"""``attach(engine, every=N, out=DIR)``: the monitor on a DeepSpeed engine of ZeRO stage 1, 2 or 3.

The layout is DeepSpeed's own partition metadata:

* stages 1 and 2: every parameter is held whole by every rank (gathered after the step: C-ZERO-003
  compares them); each parameter group is one flat buffer cut into equal partitions
  (``partition_size``), rank ``r`` owning partition ``r``; the fp32 master partition
  (``single_partition_of_fp32_groups``) keys the optimizer state;
* stage 3: every parameter is cut alone into equal partitions; the rank holds its ``ds_tensor`` (its
  element range ``[r * part, (r + 1) * part)`` clipped to the parameter) and owns that range; the
  state is keyed by the group's flat fp32 partition (``fp32_partitioned_groups_flat``), laid out as
  the group's parameters' partitions in order.

``attach`` wraps ``engine.step`` so that after each optimizer step (a gradient-accumulation boundary)
the monitor checks with the step number (``engine.global_steps - 1``), the global gradient norm DeepSpeed
logged (``engine.get_global_grad_norm()``; DeepSpeed clips with ``gradient_clipping``, passed on as
``max_norm``) and nothing else to do in the training loop; call :meth:`Monitor.close` at the end.
DeepSpeed frees its gradient partitions inside its step, so the recomputed-norm comparison is left out
(``grads`` None; the summary's ``notes`` say so once); the logged norms are still compared across
ranks. An engine whose stage or metadata the monitor does not know: one line, and training goes on
unmonitored.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .layouts import LiveLayout, OwnedState, dtype_name
from .monitor import Monitor


def deepspeed_layout(engine: Any) -> LiveLayout:
    """The layout of a DeepSpeed engine on this rank (see the module docstring)."""
    stage = int(engine.zero_optimization_stage()) if hasattr(engine, "zero_optimization_stage") else -1
    if stage not in (1, 2, 3):
        raise ConfigError("zero_optimization.stage", stage,
                          "the monitor reads DeepSpeed ZeRO stages 1, 2 and 3")
    optimizer = engine.optimizer
    named = list(engine.module.named_parameters())
    layout = LiveLayout(f"deepspeed-{stage}", numels={},
                        grads_note="DeepSpeed frees its gradient partitions inside its step")
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


def attach(engine: Any, *, every: Any = 100, out: Any = None, on_violation: str = "log",
           **options: Any) -> Monitor:
    """A :class:`Monitor` of ``engine`` that checks after every ``every``-th optimizer step by itself
    (see the module docstring); ``options`` go to the monitor (``log``, ``max_norm``)."""
    clip = options.pop("max_norm", None)
    if clip is None:
        value = getattr(engine, "gradient_clipping", lambda: 0.0)()
        clip = float(value) if value else None
    monitor = Monitor(engine.module, None, every=every, out=out, on_violation=on_violation, max_norm=clip,
                      layout_reader=lambda: deepspeed_layout(engine), **options)
    if not monitor.enabled:
        return monitor
    original = engine.step

    def step(*args: Any, **kwargs: Any) -> Any:
        boundary = engine.is_gradient_accumulation_boundary()
        result = original(*args, **kwargs)
        if boundary:
            norm = engine.get_global_grad_norm()
            monitor.after_step(engine.global_steps - 1, grad_norm=None if norm is None else float(norm))
        return result

    engine.step = step
    return monitor
