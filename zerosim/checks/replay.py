"""C-ZERO-002 clause ``replay`` on a monitored run: the local gradient a rank contributed to the reduction
is the one its own computation gives again.

On a due step every rank runs the same micro-batch's backward once more without reducing
(:meth:`zerosim.monitor.Monitor.replay_check`) and compares, tensor by tensor, the projections of the
recomputed local gradient with those of the one it contributed (:mod:`zerosim.monitor.step_probe`):
computed by the same kernels from the same inputs, they are bitwise equal, so the bound is 0. A rank
whose projections differ recomputes a second time and the mismatch is classified:

* ``transient``: the second recomputation equals the first: the contributed gradient was a one-off
  (a compute fault in that backward: every replica then agreed on the wrong value);
* ``persistent``: the two recomputations differ from each other too: the computation does not
  reproduce on that rank (a faulty device or a nondeterministic kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..values.observe import MonitorObservation
from .collect import ViolationCollector

CLASSES = ("transient", "persistent")


def classify(finding: dict[str, Any]) -> str | None:
    """None when the recomputation equals the contributed projection within the finding's bound, else
    ``transient`` or ``persistent`` (see the module docstring)."""
    if finding.get("tensor") is None:
        return None
    contributed, first, second = finding["contributed"], finding["first"], finding["second"]
    bound = float(finding.get("bound") or 0.0)
    if abs(first - contributed) <= bound:
        return None
    return "transient" if second is not None and abs(second - first) <= bound else "persistent"


def replay_violations(rows: Sequence[MonitorObservation], step: int, out: ViolationCollector) -> int:
    """Clause ``replay``: every rank's replay finding carried by this check; the tensors replayed."""
    replayed = 0
    for obs in rows:
        finding = obs.replay
        if not finding:
            continue
        replayed += int(finding.get("checked", 0))
        kind = classify(finding)
        if kind is None:
            continue
        second = finding["second"]
        out.add(
            "replay",
            f"{kind}: rank {obs.rank}'s local gradient of {finding['tensor']} at step {finding['step']} "
            f"does not reproduce: the contributed one projects to {finding['contributed']!r}, its "
            f"recomputation to {finding['first']!r}"
            + ("" if second is None else f", a second one to {second!r}"),
            step=step,
            ranks=(obs.rank,),
            tensor=finding["tensor"],
            expected=finding["first"],
            got=finding["contributed"],
            context={"replay": kind, "replayed_step": finding["step"]},
        )
    return replayed
