"""``zerosim zoo``: reported silent-correctness bugs, reproduced, and which of zerosim's judges catch them.

Each catalogued bug (:mod:`zerosim.zoo.catalogue`) and its fixed twin run through ``zerosim verify``
and, where the bug can happen inside a live run, through a monitored training loop judged by
``zerosim.monitor`` and ``zerosim check trace`` (world 2 on the CPU). Writes ``zoo.{json,md,png}`` into
a new ``reports/zoo-<timestamp>/`` (or ``--out DIR``). Exit status: 0 every outcome the catalogue
expects holds (every recorded catch, finding and known miss, and a pass for every twin; a known miss
a judge now catches is listed, not failed), 1 one does not (a lost catch or a new false alarm), 2 bad
input (an unknown ``--only`` id), 3 the launch of the monitored loops failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..errors import EXIT_RUN_FAILED
from ..files.outputs import output_dir


def register(sub: Any) -> None:
    p = sub.add_parser("zoo", help="reported silent training bugs, reproduced: what verify and the monitor "
                       "catch", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, metavar="ID[,ID...]", help="run only these entries")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where zoo.json/.md/.png go (default: a new reports/zoo-<timestamp>/)")
    p.add_argument("--json", action="store_true", help="print the whole matrix as one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..verify.errors import RankFailure
    from ..zoo import report, runner

    entries = runner.select(args.only)
    out = output_dir(args.out, "zoo")  # made (or refused) before anything runs
    progress = None if args.json or not sys.stderr.isatty() else _progress
    try:
        matrix = runner.run_zoo(entries, progress=progress)
    except RankFailure as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_RUN_FAILED
    paths = report.write_report(matrix, out)
    if args.json:
        json.dump(matrix, sys.stdout, indent=1)
        print()
    else:
        _print_summary(matrix)
        print(f"report: {paths['md']} ({paths['png'].name}, {paths['json'].name})")
    return runner.exit_code(matrix)


def _progress(line: str) -> None:
    print(f"  {line}", file=sys.stderr)


def _print_summary(matrix: dict[str, Any]) -> None:
    from ..zoo.report import _cell, _twin

    width = max(len(r["id"]) for r in matrix["entries"])
    print(f"{'entry':<{width}}  {'verify':<22} {'monitor':<22} twin")
    for row in matrix["entries"]:
        v = row["verdicts"]
        print(f"{row['id']:<{width}}  {_cell(v['verify']):<22} {_cell(v['monitor']):<22} {_twin(v)}")
    for judge in ("verify", "monitor"):
        rate = matrix[judge]
        pct = "n/a" if rate["rate"] is None else f"{100 * rate['rate']:.0f}%"
        print(f"{judge}: {rate['caught']} of {rate['reach']} in reach caught ({pct}), "
              f"{rate['false_alarms']} false alarm(s) on {rate['twins']} twins")
    if matrix["catches_gained"]:
        gained = ", ".join(matrix["catches_gained"])
        print(f"known misses now caught (record them in the catalogue): {gained}")
    broken = matrix["expectations_broken"]
    print(f"wall time {matrix['wall_s']:.0f} s; expectations "
          + (f"BROKEN for {', '.join(broken)}" if broken else "all hold"))
