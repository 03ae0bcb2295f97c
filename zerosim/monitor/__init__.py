"""zerosim.monitor: the contracts checked inside real training runs, every N steps, for a small share of
step time. ``Monitor(model, optimizer, every=N, out=DIR)`` and one ``monitor.after_step(step, ...)``
per step (:mod:`zerosim.monitor.monitor`); DeepSpeed engines through :mod:`zerosim.monitor.deepspeed`,
Hugging Face ``Trainer`` runs through :mod:`zerosim.monitor.hf`; the files it writes are judged again
offline by ``zerosim check trace DIR`` (:mod:`zerosim.monitor.trace`, :mod:`zerosim.monitor.judge`).
"""

from __future__ import annotations

from .monitor import Monitor, MonitorViolation

__all__ = ["Monitor", "MonitorViolation"]
