"""The error-to-bound ratios of a correct and a broken trainer in each regime ``zerosim verify`` judges.

For each regime (gradient accumulation, the named meshes, the logged gradient norm, a user's own
model, transformers' GPT-2, a bug that starts late) this runs ``zerosim verify`` twice with the same
options, once on a trainer that is right and once on one that carries the regime's bug
(``tests/verify_trainers``), and prints one markdown row per pair: each run's verdict, its worst
``error_over_tolerance`` of C-ZERO-002 (parameters and optimizer state) and of C-ZERO-008 (the logged
norm, where the trainer logs one), the first bug class the diagnosis names, and the launch's wall
time. Run from the repository root (the trainers are imported from ``tests``):

    python tools/verify_regimes.py [--world 4] [--only accum-dropped,late] [--json rows.json]
    python tools/verify_regimes.py --table rows.json   # print a saved table again

A row takes two launches of the default run (24 steps at ``--world``), so the whole table takes a few
minutes; it is a measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

B = "tests.verify_trainers.broken"
A = "tests.verify_trainers.accumulation"
OWN_MODEL = "tests.verify_trainers.models:regressor"


@dataclass
class Regime:
    key: str
    title: str
    correct: str
    broken: str
    options: dict[str, Any] = field(default_factory=dict)


REGIMES = [
    Regime("default", "default (24 steps)", "fsdp2", f"{B}:summed_gradient"),
    Regime("accum-dropped", "--grad-accum 3", "ddp", f"{A}:last_micro_batch_only", {"grad_accum": 3}),
    Regime("accum-sum", "--grad-accum 3", "ddp", f"{A}:summed_micro_batches", {"grad_accum": 3}),
    Regime("mesh-4x1", "--mesh 4x1", f"{B}:hybrid_mesh_zero1", f"{B}:hybrid_skips_replica_reduce",
           {"mesh": (4, 1)}),
    Regime("mesh-2x2", "--mesh 2x2", f"{B}:hybrid_mesh_zero1", f"{B}:hybrid_skips_replica_reduce",
           {"mesh": (2, 2)}),
    Regime("norm", "logged norm", "fsdp2", f"{A}:local_shard_norm"),
    Regime("own-model", f"--model {OWN_MODEL}", "ddp", f"{B}:summed_gradient", {"model": OWN_MODEL}),
    Regime("hf-gpt2", "--model hf-gpt2", "ddp", f"{B}:summed_gradient", {"model": "hf-gpt2"}),
    Regime("late", "late bug (rank 1 stops at phase step 5)", "examples.zero1_trainer:make_trainer",
           f"{B}:rank_stops_updating_late"),
]


def measured(target: str, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """One launch of ``zerosim verify target``: verdict, worst error/bound of C-ZERO-002 and -008,
    the first diagnosed bug class, the launch's wall time."""
    from zerosim.verify.runner import verify

    started = time.monotonic()
    report = verify(target, world=world, timeout_s=300, **options)
    wall = time.monotonic() - started

    def ratio(cid: str) -> float | None:
        outcome = report.contracts.get(cid)
        value = outcome.details.get("error_over_tolerance") if outcome is not None else None
        return None if value is None else float(value)

    return {
        "target": target,
        "verdict": report.verdict,
        "c002": ratio("C-ZERO-002"),
        "c008": ratio("C-ZERO-008"),
        "failed": [cid for cid, o in report.contracts.items() if o.status == "fail"],
        "diagnosis": report.diagnosis[0].bug_class if report.diagnosis else "",
        "wall_s": round(wall, 1),
        "launch_wall_s": report.extra.get("wall_s"),
    }


def _ratios(run: dict[str, Any]) -> str:
    parts = [f"002 {run['c002']:.3g}" if run["c002"] is not None else "002 -"]
    if run["c008"] is not None:
        parts.append(f"008 {run['c008']:.3g}")
    return ", ".join(parts)


HEADER = ("| regime | correct trainer | verdict | worst error/bound | wall s | broken trainer | verdict | "
          "worst error/bound | diagnosis | wall s |\n|---|---|---|---|---|---|---|---|---|---|")


def row(regime: Regime, good: dict[str, Any], bad: dict[str, Any]) -> str:
    def short(target: str) -> str:
        """``broken:summed_gradient`` for ``tests.verify_trainers.broken:summed_gradient``."""
        module, _, attr = target.partition(":")
        return f"{module.rsplit('.', 1)[-1]}:{attr}" if attr else target

    return (f"| {regime.title} | {short(good['target'])} | {good['verdict']} | {_ratios(good)} | "
            f"{good['wall_s']} | {short(bad['target'])} | {bad['verdict']} | {_ratios(bad)} | "
            f"{bad['diagnosis'] or '-'} | {bad['wall_s']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated regime keys: "
                        + ", ".join(r.key for r in REGIMES))
    parser.add_argument("--json", default=None, help="also write the measured rows to this file")
    parser.add_argument("--table", default=None, help="print the rows saved with --json; run nothing")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            saved = json.load(f)
        titles = {r.key: r for r in REGIMES}
        print(f"world {saved['world']}\n\n{HEADER}")
        for r in saved["rows"]:
            print(row(titles[r["regime"]], r["correct"], r["broken"]))
        return 0
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    keys = [k for k in args.only.split(",") if k]
    unknown = sorted(set(keys) - {r.key for r in REGIMES})
    if unknown:
        parser.error(f"--only: unknown regime(s) {', '.join(unknown)}")
    chosen = [r for r in REGIMES if not keys or r.key in keys]
    print(f"world {args.world}\n\n{HEADER}", flush=True)
    rows = []
    for regime in chosen:
        good = measured(regime.correct, args.world, regime.options)
        bad = measured(regime.broken, args.world, regime.options)
        rows.append({"regime": regime.key, "options": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in regime.options.items()},
                     "correct": good, "broken": bad})
        print(row(regime, good, bad), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": args.world, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
