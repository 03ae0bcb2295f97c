"""``zerosim bench monitor --trace``: every monitored run writes its observation files, and each is
judged again offline, as ``zerosim check trace`` judges it, beside what the live run found.

A run's folder holds one line per check per rank (the step checks' fields, the update's samples
included). :func:`judge_folder` reads it with :func:`zerosim.monitor.trace_reader.read_trace` and judges
it with :func:`zerosim.monitor.judge.judge` (the command's own two calls), and counts the observations
that carried each step check. :func:`compare` sets, per run, whether the offline verdict is the live
one: the same number of checks judged, the same number of violations, nothing incomplete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the observation fields of the step checks, by clause
STEP_FIELDS = {"grad_accounting": "accounting", "update": "update", "replay": "replay"}


def judge_folder(folder: Path) -> dict[str, Any]:
    """The offline verdict on one run's observation files: checks judged, incomplete checks,
    violations (and the first three), and per step clause the observations (rank lines) carrying it."""
    from ..monitor.judge import judge
    from ..monitor.trace_reader import read_trace

    trace = read_trace(folder)
    observations = trace.observations()
    verdicts = judge(observations)
    found = [str(v) for verdict in verdicts for v in verdict.violations]
    return {"checks_judged": len(trace.complete), "incomplete": len(trace.incomplete),
            "violations": sum(v.details.get("violation_count", len(v.violations)) for v in verdicts),
            "first_violations": found[:3],
            "lines_with": {clause: sum(getattr(o, field, None) is not None for o in observations)
                           for clause, field in STEP_FIELDS.items()}}


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Judge the folder of every row that has one (``trace_dir``), put the verdict in the row as
    ``offline`` with ``agrees`` (offline checks and violations equal to the live run's, none
    incomplete); the totals over all rows."""
    totals = {"runs": 0, "agree": 0, "checks_judged": 0, "violations": 0}
    for row in rows:
        folder = row.pop("trace_dir", None)
        if folder is None:
            continue
        try:
            offline = judge_folder(Path(folder))
        except Exception as err:  # noqa: BLE001 - a trace the reader refuses is this run's finding
            offline = {"error": f"{type(err).__name__}: {err}"}
        offline["agrees"] = ("error" not in offline and offline["incomplete"] == 0
                             and offline["checks_judged"] == row["live_checks"]
                             and offline["violations"] == row["violations"])
        row["offline"] = offline
        totals["runs"] += 1
        totals["agree"] += int(offline["agrees"])
        totals["checks_judged"] += offline.get("checks_judged", 0)
        totals["violations"] += offline.get("violations", 0)
    return totals
