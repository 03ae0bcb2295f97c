"""``zerosim check <target>``: run a contract check and exit 1 on any violation, 0 when all hold.

Targets: ``partition`` (C-ZERO-001 on a user's partition function or a built-in partitioner) and
``trace`` (C-ZERO-001..003 on the observation files :mod:`zerosim.monitor` wrote during a training run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..checks.judges import judge
from ..checks.partition import CONTRACT
from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..files.int_text import parse_int_list
from ..partition import PARTITIONERS, get_partitioner
from ..testing.check_impl import (
    BALANCE_MODES,
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_TOTALS,
    DEFAULT_WORLD_SIZES,
    check_partition,
    check_sweep_size,
    describe_ints,
)
from ..values.layout import ParamLayout
from ..values.presets import PRESETS
from ..values.verdict import Violation
from ._args import pipe_safe
from .violation_groups import DEFAULT_CASES_PER_KIND, grouped_lines


def register(sub: Any) -> None:
    p = sub.add_parser("check", help="check contracts; exit 1 on a violation, 0 when all hold",
                       description="Check a contract. Exit status: 0 all hold, 1 a violation, 2 bad input.")
    inner = p.add_subparsers(dest="check_target", metavar="TARGET")
    _register_partition(inner)
    _register_trace(inner)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _register_partition(inner: Any) -> None:
    p = inner.add_parser(
        "partition", help="C-ZERO-001 on a partition function (--impl) or a built-in partitioner",
        description=(
            "Check C-ZERO-001 (coverage, disjointness, balance, padding never counted as data).\n"
            "--impl MODULE:FUNCTION: FUNCTION(rank, world_size, total) returns (start, end) or a list of\n"
            "ranges; it is swept over world sizes 1..64 and 1024 and totals from 0 to 10^12 and beyond.\n"
            "--partitioner NAME: a built-in partitioner on --model PRESET or flat --total N layouts.\n"
            "One line per violation; exit 1 on any violation, 0 when all hold, 2 on bad input."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group()
    what.add_argument("--impl", metavar="MODULE:FUNCTION",
                      help="your partition function, e.g. examples.my_partitioner:even_split (or file.py:fn)")
    what.add_argument("--partitioner", metavar="NAME",
                      help=f"a built-in partitioner: {', '.join(sorted(PARTITIONERS))}")
    p.add_argument("--model", metavar="PRESET", help=f"--partitioner on a preset model: {', '.join(PRESETS)}")
    p.add_argument("--world-size", "--world", dest="world_size", type=str, action="append", metavar="N",
                   help="check this world size only (repeatable)")
    p.add_argument("--world-sizes", metavar="LIST", help="world sizes, e.g. '1..64,1024' (the default)")
    p.add_argument("--total", type=str, action="append", metavar="N",
                   help="a total number of parameters (repeatable; 10**12 and 1e12 accepted)")
    p.add_argument("--totals", metavar="LIST", help="totals, e.g. '0,1,7,1e12' (default: a built-in sweep)")
    p.add_argument(
        "--balance",
        default=None,
        metavar="MODE",
        help=f"--impl balance rule: {', '.join(BALANCE_MODES)} or an integer bound (default: seed)",
    )
    p.add_argument("--call-timeout", default=None, metavar="S",
                   help="--impl: seconds one call (or the import) may take "
                        f"(default {DEFAULT_CALL_TIMEOUT_S:g})")
    p.add_argument("--limit", type=int, default=DEFAULT_CASES_PER_KIND,
                   help="violations are grouped by kind (clause and message, one line each with its count); "
                        f"cases listed under each kind (0 = every case; default {DEFAULT_CASES_PER_KIND})")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(func=run_partition)


def _call_timeout(text: str | None) -> float:
    if text is None:
        return DEFAULT_CALL_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86_400:
        raise ConfigError("call-timeout", text, "must be a number of seconds in (0, 86400]")
    return value


def _collect(single: list[str] | None, listed: str | None, field: str) -> list[int] | None:
    values: list[int] = []
    for text in single or []:
        values += parse_int_list(text, field)
    if listed is not None:
        values += parse_int_list(listed, field + "s")
    return values or None


@pipe_safe
def run_partition(args: argparse.Namespace) -> int:
    world_sizes = _collect(args.world_size, args.world_sizes, "world_size")
    totals = _collect(args.total, args.totals, "total")
    for w in world_sizes or []:
        require_positive_int("world_size", w)
    for t in totals or []:
        require_non_negative_int("total", t)
    limit = require_non_negative_int("limit", args.limit)
    if args.impl is None and args.partitioner is None:
        raise ConfigError(
            "impl", None, "give --impl MODULE:FUNCTION (your partition function) or --partitioner NAME"
        )
    if args.impl is not None:
        if args.model is not None:
            raise ConfigError(
                "model", args.model, "applies to --partitioner only (--impl works on flat totals)"
            )
        report = check_partition(args.impl, world_sizes or DEFAULT_WORLD_SIZES, totals or DEFAULT_TOTALS,
                                 balance=args.balance if args.balance is not None else "seed",
                                 call_timeout=_call_timeout(args.call_timeout))
        if args.json:
            json.dump(report.to_json(), sys.stdout, indent=2)
            print()
        else:
            for line in grouped_lines(report.violations, limit or None, report.suppressed):
                print(line)
            print(report.summary())
        return 0 if report.passed else 1
    if args.balance is not None:
        raise ConfigError(
            "balance", args.balance, "applies to --impl only (each partitioner has its own bound)"
        )
    if args.call_timeout is not None:
        raise ConfigError("call-timeout", args.call_timeout, "applies to --impl only")
    return _check_builtin(args, world_sizes, totals, limit)


def _check_builtin(args: argparse.Namespace, world_sizes: list[int] | None, totals: list[int] | None,
                   limit: int) -> int:
    partitioner = get_partitioner(args.partitioner)
    if args.model is not None and totals is not None:
        raise ConfigError("total", totals, "give either --model or --total, not both")
    if totals is not None:
        layouts = [ParamLayout.from_list([("flat", (t,))], name=f"flat-{t}") for t in totals]
    else:
        layouts = [ParamLayout.from_config(args.model or "gpt2-small")]
    # the same bounds as an --impl sweep (a rank's shard per rank per case), before the first case
    check_sweep_size(world_sizes or DEFAULT_WORLD_SIZES, len(layouts), "rank shards")
    cases: list[dict[str, Any]] = []
    violations: list[Violation] = []
    n_violations = 0
    for layout in layouts:
        for ws in world_sizes or DEFAULT_WORLD_SIZES:
            t0 = time.perf_counter()
            plan = partitioner(layout, ws)
            t1 = time.perf_counter()
            verdict = judge(CONTRACT, plan)
            t2 = time.perf_counter()
            n = sum(verdict.details.get("violations_by_clause", {}).values())
            n_violations += n
            violations += verdict.violations
            cases.append(
                {
                    "model": layout.name,
                    "total": layout.total_numel,
                    "world_size": ws,
                    "passed": verdict.passed,
                    "num_intervals": verdict.details.get("num_intervals"),
                    "balance_bound": plan.balance_bound,
                    "spread": verdict.details.get("spread"),
                    "padding": plan.total_padding,
                    "build_ms": (t1 - t0) * 1e3,
                    "check_ms": (t2 - t1) * 1e3,
                    "violations": [v.to_json() for v in verdict.violations],
                }
            )
    passed = n_violations == 0
    if args.json:
        json.dump({"contract": CONTRACT, "partitioner": partitioner.name, "passed": passed,
                   "total_violations": n_violations, "cases": cases}, sys.stdout, indent=2)
        print()
        return 0 if passed else 1
    for line in grouped_lines(violations, limit or None, n_violations - len(violations)):
        print(line)
    check_ms = [c["check_ms"] for c in cases]
    build_ms = [c["build_ms"] for c in cases]
    models = sorted({c["model"] for c in cases})
    intervals = max(c["num_intervals"] or 0 for c in cases)
    where = (
        f"{len(cases)} case(s) on {', '.join(models[:3])}{' ...' if len(models) > 3 else ''}; world sizes "
        f"{describe_ints(list(world_sizes or DEFAULT_WORLD_SIZES))}; up to {intervals:,} intervals"
    )
    timing = (f"plan built in {max(build_ms):.1f} ms, checked in {max(check_ms):.2f} ms (slowest case)"
              if len(cases) > 1 else f"plan built in {build_ms[0]:.1f} ms, checked in {check_ms[0]:.2f} ms")
    verb = "holds for" if passed else f"violated ({n_violations} violations) by"
    print(f"{CONTRACT} {verb} partitioner {partitioner.name}: {where}; {timing}")
    return 0 if passed else 1


def _register_trace(inner: Any) -> None:
    from ..monitor.trace_reader import MAX_LINE_BYTES, MAX_TRACE_BYTES

    p = inner.add_parser(
        "trace", help="C-ZERO-001..003 on a monitored run's observation files (zerosim.monitor's out=DIR)",
        description=(
            "Judge the per-rank observation files (rank-NNNNN.jsonl) zerosim.monitor wrote during a\n"
            "training run with the checks the live monitor ran: C-ZERO-001 (owned ranges cover every\n"
            "parameter), C-ZERO-002's live clauses (optimizer state present and finite, equal step\n"
            "counters, logged vs recomputed gradient norm), C-ZERO-003 (replicas hold identical bytes).\n"
            "Only checks every rank wrote are judged; one some ranks did not finish (a killed run) is\n"
            "listed as incomplete. The folder is read as untrusted input: regular files only, lines of\n"
            f"at most {MAX_LINE_BYTES:,} bytes, strict JSON, one consistent world.\n"
            "One line per violation; exit 1 on any violation, 0 when all hold, 2 on bad input or when no\n"
            "check is complete (nothing could be judged)."),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", metavar="DIR", help="the monitor's out directory")
    p.add_argument("--limit", type=int, default=50,
                   help="violation and incomplete-check lines to print (0 = all; default 50)")
    p.add_argument("--max-bytes", type=int, default=MAX_TRACE_BYTES, metavar="N",
                   help=f"the most bytes the rank files may hold together (default {MAX_TRACE_BYTES:,})")
    p.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    p.set_defaults(func=run_trace)


@pipe_safe
def run_trace(args: argparse.Namespace) -> int:
    from ..monitor.judge import judge, summary_line
    from ..monitor.trace_reader import read_trace

    limit = require_non_negative_int("limit", args.limit)
    max_bytes = require_positive_int("max-bytes", args.max_bytes)
    trace = read_trace(args.directory, max_bytes=max_bytes)
    if not trace.complete:
        raise ConfigError("DIR", args.directory, f"holds {len(trace.incomplete)} check(s), none of them "
                          f"written by all {trace.world_size} ranks: nothing to judge")
    verdicts = judge(trace.observations())
    passed = all(v.passed for v in verdicts)
    steps = sorted(trace.complete)
    incomplete = sorted(trace.incomplete.items())
    if args.json:
        json.dump({"passed": passed, "world_size": trace.world_size, "checks_judged": len(steps),
                   "steps": len(steps), "ranks": list(range(trace.world_size)),
                   "incomplete": [{"step": step, "missing_ranks": ranks} for step, ranks in incomplete],
                   "notes": trace.notes, "verdicts": [v.to_json() for v in verdicts]}, sys.stdout, indent=2)
        print()
        return 0 if passed else 1
    lines = [str(v) for verdict in verdicts for v in verdict.violations]
    lines += [f"incomplete: step {step}: no line from rank(s) {_ranks(ranks)}, not judged"
              for step, ranks in incomplete]
    for line in lines[: limit or None]:
        print(line)
    if limit and len(lines) > limit:
        print(f"... {len(lines) - limit} more line(s) not shown (use --limit 0 or --json)")
    for note in trace.notes:
        print(f"note: {note}")
    span = f"steps {steps[0]}..{steps[-1]}"
    skipped = f", {len(incomplete)} incomplete check(s) not judged" if incomplete else ""
    print(f"{'PASS' if passed else 'FAIL'} {len(steps)} check(s) judged ({span}) of {trace.world_size} "
          f"rank(s){skipped}: {summary_line(None, verdicts)}")
    return 0 if passed else 1


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks[:8])) + (f",... ({len(ranks)} ranks)" if len(ranks) > 8 else "")
