"""zerosim.monitor: the contracts checked inside real training runs, every N steps, for a small share of
step time. ``Monitor(model, optimizer, every=N, out=DIR)`` and one ``monitor.after_step(step, ...)``
per step (:mod:`zerosim.monitor.monitor`); DeepSpeed engines through :mod:`zerosim.monitor.deepspeed`,
Hugging Face ``Trainer`` runs through :mod:`zerosim.monitor.hf`; the files it writes are judged again
offline by ``zerosim check trace DIR`` (:mod:`zerosim.monitor.trace_reader`,
:mod:`zerosim.monitor.judge`). ``Monitor`` is imported on first use, so the offline judge, which needs
no torch, starts without importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .monitor import Monitor, MonitorViolation

__all__ = ["Monitor", "MonitorViolation"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import monitor

        return getattr(monitor, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
