"""``zerosim bench check``: C-ZERO-001 by interval arithmetic vs a flag per parameter, side by side.

The seed's own completeness test allocates one boolean per parameter (``vec![false; total]``) and
marks each rank's range. That is O(total) memory and time: fine at 10^6, impossible at 10^12. Ours
sorts the ranks' intervals: O(world size log world size). This benchmark

1. times our check on a ``--total`` x ``--world-size`` seed plan (default 10^12 x 1024);
2. times both checkers side by side on the same plans at sizes the flag checker can handle, and
   fits the flag checker's time per element to extrapolate it to ``--total``;
3. shows the flag checker cannot run at ``--total``: the bytes it needs vs this machine's memory,
   and, where the kernel is sure to refuse (no overcommit for a request above RAM + swap), the
   ``MemoryError`` that ``numpy.zeros(total, bool)`` actually raises (nothing is ever touched);
4. writes everything to ``bench_check.json`` in a new ``reports/bench-check-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..checks.judges import judge
from ..errors import ConfigError, require_positive_int
from ..files.outputs import output_file, write_text
from ..partition import get_partitioner
from ..partition.base import ShardPlan
from ..values.layout import ParamLayout

DEFAULT_OUT = "a new reports/bench-check-<timestamp>/bench_check.json"


def flag_check(plan: ShardPlan) -> bool:
    """The seed's approach: one flag per parameter, every element of every shard touched."""
    covered = np.zeros(plan.total, dtype=bool)
    for shard in plan.shards:
        for s, e in shard.intervals:
            if covered[s:e].any():
                return False
            covered[s:e] = True
    return bool(covered.all())


def seed_plan(total: int, world_size: int) -> ShardPlan:
    return get_partitioner("seed")(
        ParamLayout.from_list([("flat", (total,))], name=f"flat-{total}"), world_size
    )


def _time(fn: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _meminfo() -> dict[str, int]:
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except OSError:
        try:
            info["MemTotal"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    return info


def _overcommit_mode() -> int | None:
    try:
        return int(Path("/proc/sys/vm/overcommit_memory").read_text().strip())
    except (OSError, ValueError):
        return None


def try_flag_allocation(total: int, mem: dict[str, int]) -> dict[str, Any]:
    """Ask numpy for the flag array only when the kernel is sure to refuse it; never touch it."""
    limit = mem.get("MemTotal", 0) + mem.get("SwapTotal", 0)
    mode = _overcommit_mode()
    safe = mode == 2 or (mode == 0 and limit and total > limit)
    if not safe:
        return {"attempted": False, "reason": f"not attempted: overcommit mode {mode} could grant it lazily"}
    try:
        flags = np.zeros(total, dtype=bool)
    except MemoryError as e:
        return {"attempted": True, "error": f"MemoryError: {e}"}
    nbytes = flags.nbytes
    del flags  # granted lazily: release it without touching a page
    return {"attempted": True, "error": None, "note": f"{nbytes} bytes granted lazily and released untouched"}


def run(args: Any) -> int:
    from ..cost.units import format_bytes
    from ..files.int_text import parse_int_expr, parse_int_list

    total = parse_int_expr(str(args.total), "total")
    if total < 0:
        raise ConfigError("total", total, "must be a non-negative integer")
    ws = require_positive_int("world_size", args.world_size)
    repeats = require_positive_int("repeats", args.repeats)
    flag_sizes = parse_int_list(args.flag_sizes, "flag_sizes")
    mem = _meminfo()
    available = mem.get("MemAvailable", mem.get("MemTotal", 0))
    for n in flag_sizes:
        if n <= 0 or n > available // 4:
            raise ConfigError(
                "flag_sizes", n, f"must be in [1, {available // 4}] (a quarter of available memory)"
            )
    out = output_file(args.out, "bench-check", "bench_check.json")  # refused before anything runs

    # 1. our check on the big plan
    t0 = time.perf_counter()
    big = seed_plan(total, ws)
    build_s = time.perf_counter() - t0
    verdict = judge("C-ZERO-001", big)
    times = _time(lambda: judge("C-ZERO-001", big), repeats)
    ours = {
        "total": total,
        "world_size": ws,
        "passed": verdict.passed,
        "intervals": verdict.details["num_intervals"],
        "build_ms": build_s * 1e3,
        "check_ms_median": statistics.median(times) * 1e3,
        "check_ms_min": min(times) * 1e3,
        "check_ms_max": max(times) * 1e3,
        "repeats": repeats,
        "target_ms": 50.0,
        "meets_target": statistics.median(times) * 1e3 < 50.0,
    }
    print(f"interval check, {total:,} params x {ws} ranks: median {ours['check_ms_median']:.2f} ms "
          f"(min {ours['check_ms_min']:.2f}, max {ours['check_ms_max']:.2f}; {repeats} runs; target < 50 ms: "
          f"{'met' if ours['meets_target'] else 'MISSED'}); plan built in {ours['build_ms']:.1f} ms; "
          f"C-ZERO-001 {'holds' if verdict.passed else 'VIOLATED'}")

    # 2. side by side where the flag checker fits
    side: list[dict[str, Any]] = []
    for n in flag_sizes:
        plan = seed_plan(n, ws)
        flag_s = min(_time(lambda plan=plan: flag_check(plan), 3))
        ival_s = min(_time(lambda plan=plan: judge("C-ZERO-001", plan), 5))
        side.append({"total": n, "world_size": ws, "flag_ms": flag_s * 1e3, "interval_ms": ival_s * 1e3,
                     "flag_bytes": n, "ratio_flag_over_interval": flag_s / ival_s if ival_s else None})
        print(
            f"  total {n:>15,}: flag-per-parameter {flag_s * 1e3:10.2f} ms "
            f"({format_bytes(n, binary=True, digits=4)} of flags), "
            f"intervals {ival_s * 1e3:7.2f} ms -> {flag_s / ival_s:,.1f}x"
        )

    # 3. the flag checker at the big size
    largest = side[-1]
    per_elem_s = largest["flag_ms"] / 1e3 / largest["total"]
    need = total  # numpy bool: one byte per flag (Rust's Vec<bool> too)
    alloc = try_flag_allocation(total, mem)
    flag_big = {"bytes_needed": need, "mem_total": mem.get("MemTotal"), "mem_available": available,
                "fits": need <= available, "extrapolated_s": per_elem_s * total,
                "extrapolated_from_total": largest["total"], "allocation": alloc}
    print(
        f"flag-per-parameter at {total:,}: needs {format_bytes(need, binary=True, digits=4)} of flags; this "
        "machine has "
        f"{format_bytes(available, binary=True, digits=4)} available "
        f"({format_bytes(mem.get('MemTotal', 0), binary=True, digits=4)} total): "
        f"{'fits' if flag_big['fits'] else 'cannot run'}; extrapolated time "
        f"{flag_big['extrapolated_s']:,.0f} s "
        f"(linear from {largest['total']:,})"
    )
    if alloc.get("attempted"):
        print(f"  numpy.zeros({total}, bool): {alloc.get('error') or alloc.get('note')}")

    report = {
        "benchmark": "check", "contract": "C-ZERO-001",
        "machine": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "interval_check": ours, "side_by_side": side, "flag_check_at_total": flag_big,
    }
    write_text(out, json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if verdict.passed else 1
