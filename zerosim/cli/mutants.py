"""``zerosim mutants``: run every catalogued mutant through the contract suite; print the detection matrix.

Each mutant (``zerosim simulate --fault NAME``) runs in a configuration where it acts, on the
simulator by default (``--backend mpi|torch``: one launch per mutant). Prints mutant x contract with
the step each contract first failed at, writes ``mutants.{json,md,png}`` into a new
``reports/mutants-<timestamp>/`` (or ``--out DIR``). Exit status: 0 every mutant killed, 1 one
survived (the contracts missed a bug), 2 bad input or an output that cannot be written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from ..files.outputs import output_dir


def register(sub: Any) -> None:
    p = sub.add_parser("mutants", help="run every deliberately broken variant; print what caught each",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="sim", choices=("sim", "mpi", "torch"),
                   help="sim: in this process (default); mpi / torch: one launched run per mutant")
    p.add_argument("--only", default=None, metavar="NAME[,NAME...]", help="run only these mutants")
    p.add_argument("--trainers", default=None, metavar="MODULE",
                   help="also run the broken trainers MODULE.MUTANTS names (factory -> world size) through "
                        "zerosim verify, e.g. tests.verify_trainers.broken (about 15 s each)")
    p.add_argument("--json", action="store_true",
                   help='print {"mutants": [{"name", "killed", "first_contract", "first_step", ...}]}')
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where mutants.json/.md/.png go (default: a new reports/mutants-<timestamp>/)")
    p.add_argument("--no-report", action="store_true", help="print only; write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..report import mutants

    faults = mutants.select(args.only)
    trainers = mutants.trainer_mutants(args.trainers) if args.trainers else []
    out = None
    if not args.no_report:  # the folder is made (or refused) before anything runs
        out = output_dir(args.out, "mutants")
    progress = None if args.json or not sys.stderr.isatty() else _progress
    from zerogpu.fork_server import serving_launches

    launches_ranks = args.backend == "torch" or bool(trainers)
    with serving_launches() if launches_ranks else contextlib.nullcontext():  # one torch import for all
        matrix = mutants.run_matrix(faults, args.backend, progress=progress, trainers=trainers)
    if not args.no_report:
        paths = mutants.write_report(matrix, out)
    if args.json:
        json.dump(matrix, sys.stdout, indent=1)
        print()
    else:
        _print_table(matrix)
        if not args.no_report:
            print(f"report: {paths['md']} ({paths['png'].name}, {paths['json'].name})")
    return mutants.exit_code(matrix)


def _progress(row: dict[str, Any]) -> None:
    print(f"  {row['name']}: {'killed' if row['killed'] else 'SURVIVED'} ({row['wall_s']:.1f} s)",
          file=sys.stderr)


def _print_table(matrix: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..files.text_tables import print_table

    table = Table(title=f"mutants on {matrix['backend']}: first failing step per contract (plan = before "
                        "training)")
    for col in ("mutant", "where", *matrix["contracts"], "first", "names touched"):
        table.add_column(col)
    for r in matrix["mutants"]:
        first = r["error"] or (f"{r['first_contract']} @ {r['first_step']}" if r["killed"] else "SURVIVED")
        touched = "n/a" if r["names_touched"] is None else "yes" if r["names_touched"] else "no"
        table.add_row(r["name"], r["where"], *(str(r["contracts"].get(c, "·")) for c in matrix["contracts"]),
                      first, touched)
    console = Console()
    print_table(table, console)
    mean = matrix["mean_first_step"]
    print(f"{matrix['killed']} of {matrix['total']} mutants killed; {matrix['caught_on_plan']} on the plan; "
          f"mean step of first detection of the rest: {mean:.2f}" if mean is not None else "")
