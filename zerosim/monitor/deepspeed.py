"""``attach(engine, every=N, out=DIR)``: the monitor on a DeepSpeed engine of ZeRO stage 1, 2 or 3.

The layout is DeepSpeed's own partition metadata (:mod:`zerosim.monitor.deepspeed_layout`).
``attach`` wraps ``engine.step`` so that after each optimizer step (a gradient-accumulation boundary)
the monitor checks with the step number (``engine.global_steps - 1``) and the global gradient norm
DeepSpeed logged (``engine.get_global_grad_norm()``), with nothing else to do in the training loop;
call :meth:`Monitor.close` at the end. ``Monitor(engine, every=N)`` with your own
``after_step(engine.global_steps - 1, grad_norm=...)`` is the same monitor, for a loop that logs its
own norm.

The logged norm is compared with the norm recomputed from DeepSpeed's own reduced gradient
partitions, measured inside its step before it unscales and clips them
(:class:`~zerosim.monitor.deepspeed_layout.GradientSquares`), and across ranks. An engine whose stage
or metadata the monitor does not know: one line, and training goes on unmonitored.
"""

from __future__ import annotations

from typing import Any

from .deepspeed_layout import deepspeed_layout  # noqa: F401 (read through this module by hf and users)
from .monitor import Monitor


def attach(engine: Any, *, every: Any = 100, out: Any = None, on_violation: str = "log",
           **options: Any) -> Monitor:
    """A :class:`Monitor` of ``engine`` that checks after every ``every``-th optimizer step by itself
    (see the module docstring); ``options`` go to the monitor (``log``). A ``max_norm`` option is
    accepted and not needed: the gradient is measured before DeepSpeed clips it."""
    options.pop("max_norm", None)
    monitor = Monitor(engine, None, every=every, out=out, on_violation=on_violation, **options)
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
