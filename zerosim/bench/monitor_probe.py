"""The step checks' own time in ``zerosim bench monitor``: a :class:`~zerosim.monitor.step_probe.StepProbe`
whose hooks and replay are timed, per check kind.

The step checks (C-ZERO-002 ``grad_accounting``, ``update``, ``replay``) do most of their work outside
the monitor's own timed calls: in a tensor hook during backward (each micro-batch's local gradient
projected), in the optimizer's step pre- and post-hooks (the consumed gradient projected; the update's
samples before and after, recomputed in float64), in :meth:`Monitor.replay_check` (a second forward and
backward) and in :meth:`StepProbe.take` (the fields read back for the row). ``Monitor.seconds`` does not
hold them, so the benchmark makes the monitor build :class:`TimedStepProbe` instead
(:func:`timing_step_checks`; the update's hooks in their own class where the probe keeps them there)
and adds :data:`SPENT` to what the monitor accounts. The row's encoding and
the judging of the step clauses run inside the monitor's timed calls and are counted there.

``without_step_checks`` takes a monitor's probe away (its hooks removed; its rows carry an empty
step-check section): the monitor as it checks without the step clauses, for the variants that measure
the other checks alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..monitor import monitor as monitor_module
from ..monitor import step_probe as step_probe_module
from ..monitor.step_probe import StepProbe

#: check kind -> the probe methods whose time it is, as (class, method): the class is StepProbe or, where
#: the update's observation is a class of its own, that class (``UpdateProbe``); a method a class does not
#: have is not timed, and a kind none of whose methods exists is named by :func:`missing_kinds`
TIMED: dict[str, tuple[tuple[str, str], ...]] = {
    "grad_accounting": (("StepProbe", "_local"), ("StepProbe", "_consume")),
    "update": (("StepProbe", "_before_update"), ("StepProbe", "_after_update"),
               ("UpdateProbe", "_before"), ("UpdateProbe", "_after")),
    "replay": (("StepProbe", "replay"),),
    "fields": (("StepProbe", "take"),),
}
KINDS = tuple(TIMED)
#: seconds spent per kind since the last :func:`reset` (one run at a time per rank process)
SPENT: dict[str, float] = dict.fromkeys(KINDS, 0.0)
#: since the last :func:`reset`: ``observed``, the check steps whose fields the probe gave (one per
#: check this rank made); per kind, those of them that carried its finding
CARRIED: dict[str, int] = dict.fromkeys(("observed", "grad_accounting", "update", "replay"), 0)
#: the field of :meth:`StepProbe.take` that carries each kind's finding
FIELD = {"grad_accounting": "accounting", "update": "update", "replay": "replay"}


def reset() -> None:
    for kind in SPENT:
        SPENT[kind] = 0.0
    for kind in CARRIED:
        CARRIED[kind] = 0


def snapshot() -> tuple[dict[str, float], dict[str, int]]:
    return dict(SPENT), dict(CARRIED)


def _timed(kind: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            SPENT[kind] += time.perf_counter() - start

    call.__name__ = method.__name__
    call.__doc__ = method.__doc__
    return call


class TimedStepProbe(StepProbe):
    """:class:`StepProbe` with its methods of :data:`TIMED` timed into :data:`SPENT`, and the findings
    each check's fields carry counted into :data:`CARRIED`."""

    def take(self, step: int) -> dict[str, Any]:
        fields = super().take(step)
        CARRIED["observed"] += int(step % self.every == 0)
        for kind, field in FIELD.items():
            CARRIED[kind] += int(fields.get(field) is not None)
        return fields


#: the probe classes the monitor builds (by the name it builds them under) and their timed subclasses
CLASSES: dict[str, tuple[type, type]] = {"StepProbe": (StepProbe, TimedStepProbe)}
if isinstance(getattr(step_probe_module, "UpdateProbe", None), type):
    _update = step_probe_module.UpdateProbe
    CLASSES["UpdateProbe"] = (_update, type("TimedUpdateProbe", (_update,), {}))
for _kind, _methods in TIMED.items():
    for _class, _name in _methods:
        if _class in CLASSES and callable(getattr(CLASSES[_class][0], _name, None)):
            _timed_class = CLASSES[_class][1]
            setattr(_timed_class, _name, _timed(_kind, getattr(_timed_class, _name)))


def missing_kinds() -> list[str]:
    """The kinds none of whose timed methods the probe classes have (their time would read 0)."""
    return [kind for kind, methods in TIMED.items()
            if not any(c in CLASSES and callable(getattr(CLASSES[c][0], n, None)) for c, n in methods)]


@contextmanager
def timing_step_checks() -> Iterator[None]:
    """Within it, a ``Monitor`` built in this process observes its steps with the timed probe classes
    (the names the monitor and the step probe build them under, restored on leaving: the instances
    built meanwhile keep their timed class)."""
    homes = {"StepProbe": monitor_module, "UpdateProbe": step_probe_module}
    saved = {name: getattr(homes[name], name) for name in CLASSES}
    for name, (_, timed_class) in CLASSES.items():
        setattr(homes[name], name, timed_class)
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(homes[name], name, original)


def without_step_checks(monitor: Any) -> None:
    """Take the step checks away from ``monitor`` on this rank (every rank does the same): the probe's
    hooks removed and no probe left, so its rows carry an empty step-check section and no step clause
    is judged; the other checks are unchanged."""
    probe = getattr(monitor, "_probe", None)
    if probe is not None:
        probe.close()
        monitor._probe = None
        monitor._taken = {}
