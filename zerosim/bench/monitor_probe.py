"""The step checks' own time in ``zerosim bench monitor``: a :class:`~zerosim.monitor.step_probe.StepProbe`
whose hooks and replay are timed, per check kind.

The step checks (C-ZERO-002 ``grad_accounting``, ``update``, ``replay``) do most of their work outside
the monitor's own timed calls: in a tensor hook during backward (each micro-batch's local gradient
projected), in the optimizer's step pre- and post-hooks (the consumed gradient projected; the update's
samples before and after, recomputed in float64), in :meth:`Monitor.replay_check` (a second forward and
backward) and in :meth:`StepProbe.take` (the fields read back for the row). ``Monitor.seconds`` does not
hold them, so the benchmark makes the monitor build :class:`TimedStepProbe` instead
(:func:`timing_step_checks`) and adds :data:`SPENT` to what the monitor accounts. The row's encoding and
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
from ..monitor.step_probe import StepProbe

#: check kind -> the StepProbe methods whose time it is
TIMED = {
    "grad_accounting": ("_local", "_consume"),
    "update": ("_before_update", "_after_update"),
    "replay": ("replay",),
    "fields": ("take",),
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


def missing_methods() -> list[str]:
    """The timed method names :class:`StepProbe` no longer has (the timing would silently miss them)."""
    return [name for names in TIMED.values() for name in names
            if not callable(getattr(StepProbe, name, None))]


class TimedStepProbe(StepProbe):
    """:class:`StepProbe` with every method of :data:`TIMED` timed into :data:`SPENT`, and the findings
    each check's fields carry counted into :data:`CARRIED`."""

    def take(self, step: int) -> dict[str, Any]:
        fields = super().take(step)
        CARRIED["observed"] += int(step % self.every == 0)
        for kind, field in FIELD.items():
            CARRIED[kind] += int(fields.get(field) is not None)
        return fields


for _kind, _names in TIMED.items():
    for _name in _names:
        if callable(getattr(TimedStepProbe, _name, None)):
            setattr(TimedStepProbe, _name, _timed(_kind, getattr(TimedStepProbe, _name)))


@contextmanager
def timing_step_checks() -> Iterator[None]:
    """Within it, a ``Monitor`` built in this process observes its steps with :class:`TimedStepProbe`
    (the monitor module's name for the probe class, restored on leaving)."""
    original = monitor_module.StepProbe
    monitor_module.StepProbe = TimedStepProbe  # type: ignore[misc]
    try:
        yield
    finally:
        monitor_module.StepProbe = original  # type: ignore[misc]


def without_step_checks(monitor: Any) -> None:
    """Take the step checks away from ``monitor`` on this rank (every rank does the same): the probe's
    hooks removed and no probe left, so its rows carry an empty step-check section and no step clause
    is judged; the other checks are unchanged."""
    probe = getattr(monitor, "_probe", None)
    if probe is not None:
        probe.close()
        monitor._probe = None
        monitor._taken = {}
