"""Running the zoo: every entry's bug and fixed twin through ``zerosim verify`` and the monitored loop.

For each selected entry (:mod:`zerosim.zoo.catalogue`) with a verify plan, the bug trainer and its twin
run through :func:`zerosim.verify.verify` (world 2, a few steps, the entry's options; one fork server
for every launch). Every entry with a live plan runs in ONE launch of :mod:`zerosim.zoo.live` (world 2,
:func:`zerogpu.launch.run_ranks`), the bug and its twin each monitored into a folder of their own, and
each folder is judged again offline as ``zerosim check trace`` judges it. The result is one matrix:
per entry, what each judge said of the bug and of the twin, the step of first detection, and whether
that is what the catalogue expects (a lost catch or a new false alarm is a broken expectation).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..verify.errors import RankFailure
from .catalogue import BY_ID, CATCH, ENTRIES, FINDING, MISS, VERIFY_STEPS, WORLD, Entry

PASS, FALSE_ALARM, ERROR = "pass", "false alarm", "error"
LIVE_BOUND_S = 600.0  #: the one live launch (every mechanism twice, six monitored steps each)


def select(only: str | None) -> list[Entry]:
    """The entries ``--only ID,...`` names (all without it); ConfigError naming an unknown id."""
    if only is None:
        return list(ENTRIES)
    ids = [part.strip() for part in only.split(",") if part.strip()]
    if not ids:
        raise ConfigError("only", only, "names no entry")
    for entry_id in ids:
        if entry_id not in BY_ID:
            raise ConfigError("only", entry_id, "is not an entry of the zoo (zerosim zoo --json lists them)")
    return [BY_ID[i] for i in dict.fromkeys(ids)]


def _verify_outcome(report: Any) -> tuple[str, int | None, list[str]]:
    """(catch | finding | miss, the first step a contract failed at, the failing contracts)."""
    failing = [cid for cid, c in report.contracts.items() if c.status in ("fail", "finding")]
    steps = [v["step"] for cid in failing for v in report.contracts[cid].violations
             if isinstance(v.get("step"), int)]
    first = min(steps) if steps else None
    if report.verdict == "fail":
        return CATCH, first, failing
    return (FINDING if report.findings else MISS), first, failing


def run_verify(entry: Entry) -> dict[str, Any]:
    """The entry's bug and twin through verify: their outcomes, first step, contracts and wall time."""
    from ..verify import verify
    from ..verify.errors import TrainerError

    assert entry.verify is not None
    out: dict[str, Any] = {}
    for kind in ("broken", "fixed"):
        started = time.perf_counter()
        target = f"zerosim.zoo.bugs:{kind}_{entry.verify.mechanism}"
        try:
            report = verify(target, world=WORLD, steps=VERIFY_STEPS, **entry.verify.options)
            outcome, first, contracts = _verify_outcome(report)
            classes = [d.bug_class for d in report.diagnosis]
        except (RankFailure, TrainerError, ConfigError) as err:
            outcome, first, contracts, classes = ERROR, None, [], [f"{type(err).__name__}: {err}"]
        out[kind] = {"target": target, "outcome": outcome, "first_step": first, "contracts": contracts,
                     "bug_classes": classes[:3], "wall_s": round(time.perf_counter() - started, 2)}
    return out


def run_live(entries: Sequence[Entry], work: Path) -> dict[str, dict[str, Any]]:
    """Every live plan of ``entries`` in one launch: mechanism -> {"broken": ..., "fixed": ...}."""
    from zerogpu.launch import run_ranks

    mechanisms = list(dict.fromkeys(e.live.mechanism for e in entries if e.live is not None))
    if not mechanisms:
        return {}
    results = work / "live.jsonl"
    started = time.perf_counter()
    run = run_ranks(WORLD, ["-m", "zerosim.zoo.live", str(results), str(work / "traces"), *mechanisms],
                    LIVE_BOUND_S, env={"PYTHONWARNINGS": "ignore"})
    wall = time.perf_counter() - started
    if run.timed_out or run.returncode != 0:
        tail = (run.stderr or "")[-800:].strip().replace("\n", " | ")
        raise RankFailure(-1, f"the monitored loops did not finish (exit {run.returncode}): {tail}")
    out: dict[str, dict[str, Any]] = {}
    for record in map(json.loads, results.read_text().splitlines()):
        kind = "broken" if record["bug"] else "fixed"
        steps = [v["step"] + 1 for v in record["violations"] if isinstance(v.get("step"), int)]
        trace_passed = _trace_passes(Path(record["folder"]))
        live_caught = record["violation_count"] > 0
        outcome = CATCH if live_caught and not trace_passed else MISS if not live_caught and trace_passed \
            else ERROR  # the live verdict and the offline one disagree
        out.setdefault(record["mechanism"], {})[kind] = {
            "outcome": outcome, "first_step": min(steps) if steps else None,
            "contracts": sorted({f"{v['contract']} {v['clause']}" for v in record["violations"]}),
            "checks": record["checks"], "trace_passed": trace_passed,
            "wall_s": round(wall / (2 * len(mechanisms)), 2)}
    return out


def _trace_passes(folder: Path) -> bool:
    """``zerosim check trace FOLDER``'s verdict: True when every complete check passes."""
    from ..monitor.judge import judge
    from ..monitor.trace_reader import read_trace

    trace = read_trace(folder)
    return all(v.passed for v in judge(trace.observations()))


def _as_twin(outcome: str) -> str:
    """A twin's outcome: anything a judge flags on it is a false alarm."""
    return PASS if outcome == MISS else ERROR if outcome == ERROR else FALSE_ALARM


def run_zoo(entries: Sequence[Entry], progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The matrix of every entry: per judge the bug's and the twin's outcome, expectations, figures."""
    from zerogpu.fork_server import serving_launches

    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="zerosim-zoo-") as tmp, serving_launches():
        for entry in entries:
            row: dict[str, Any] = {**entry.to_json(), "verify_run": None, "live_run": None}
            if entry.verify is not None:
                row["verify_run"] = run_verify(entry)
                if progress:
                    v = row["verify_run"]
                    progress(f"{entry.id}: verify {v['broken']['outcome']}, twin "
                             f"{_as_twin(v['fixed']['outcome'])}")
            rows.append(row)
        live = run_live(entries, Path(tmp))
    for row, entry in zip(rows, entries, strict=True):
        if entry.live is not None:
            row["live_run"] = live[entry.live.mechanism]
        row["verdicts"] = _verdicts(row, entry)
    return _matrix(rows, time.perf_counter() - started)


def _verdicts(row: dict[str, Any], entry: Entry) -> dict[str, Any]:
    """Per judge: what the bug got, what the twin got, and whether both are what the catalogue expects."""
    out: dict[str, Any] = {}
    judges = (("verify", entry.verify, row["verify_run"]), ("monitor", entry.live, row["live_run"]))
    for judge, plan, run in judges:
        if plan is None:
            out[judge] = {"bug": "out of reach", "twin": "out of reach", "expected": None, "holds": True,
                          "first_step": None, "gained": False}
            continue
        bug, twin = run["broken"]["outcome"], _as_twin(run["fixed"]["outcome"])
        gained = plan.expect == MISS and bug == CATCH  # a known miss a new check now catches
        out[judge] = {"bug": bug, "twin": twin, "expected": plan.expect,
                      "first_step": run["broken"]["first_step"],
                      "holds": (bug == plan.expect or gained) and twin == PASS, "gained": gained}
    return out


def _rate(rows: list[dict[str, Any]], judge: str) -> dict[str, Any]:
    reached = [r for r in rows if r["verdicts"][judge]["expected"] is not None]
    caught = [r for r in reached if r["verdicts"][judge]["bug"] in (CATCH, FINDING)]
    twins = [r for r in reached if r["verdicts"][judge]["twin"] != PASS]
    steps = sorted(r["verdicts"][judge]["first_step"] for r in caught
                   if r["verdicts"][judge]["first_step"] is not None)
    return {"reach": len(reached), "caught": len(caught),
            "rate": len(caught) / len(reached) if reached else None,
            "false_alarms": len(twins), "twins": len(reached),
            "first_step_median": steps[len(steps) // 2] if steps else None,
            "first_step_max": steps[-1] if steps else None}


def _matrix(rows: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    broken = [r["id"] for r in rows if not all(v["holds"] for v in r["verdicts"].values())]
    gained = [r["id"] for r in rows if any(v.get("gained") for v in r["verdicts"].values())]
    return {"entries": rows, "total": len(rows), "verify": _rate(rows, "verify"),
            "monitor": _rate(rows, "monitor"), "expectations_broken": broken, "catches_gained": gained,
            "wall_s": round(wall_s, 1), "python": sys.version.split()[0]}


def exit_code(matrix: dict[str, Any]) -> int:
    """0 when every entry's recorded expectations hold, 1 otherwise (a known miss that a judge now
    catches holds: it is listed in ``catches_gained``, for the catalogue to record)."""
    return 1 if matrix["expectations_broken"] else 0
