"""``zerosim bench scale``: how time and peak memory grow with the number of ranks.

Three series, each point in a fresh subprocess (so one point's peak memory never mixes with
another's; the peak is the child's ``ru_maxrss`` from ``os.wait4``):

1. **simulate**: ``zerosim simulate --model tiny --steps 3`` at 8 .. 1024 ranks, wall time of the
   whole command (training, ground truth, every step contract);
2. **plan**: the ZeRO-3 plan of a flat layout of ``total`` parameters over ``ws`` ranks (seed
   partitioner), checked against C-ZERO-001 (every kind of state, replicas) and rendered as
   ``zerosim plan`` prints it, from 10^12 x 2^10 up to 10^15 x 2^20;
3. **check**: C-ZERO-001 on the seed plan of the same sizes (median of 5 checks; plan built first).

For each series the growth exponent ``b`` of ``time ~ ranks^b`` (and of peak memory) is fitted by
least squares on log-log and printed. ``--source DIR`` runs the points against the zerosim package
in ``DIR`` (an older checkout, for a before / after comparison); ``--before FILE`` adds an earlier
report's series to the table and the plot. A point the code refuses (exit status 2, a bounded-work
limit) is recorded as refused with its one-line message. Writes ``bench_scale.json`` and a
log-log PNG ``bench_scale.png`` beside it, in a new ``reports/bench-scale-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..files.outputs import output_file, save_figure, write_text

DEFAULT_OUT = "a new reports/bench-scale-<timestamp>/bench_scale.json"
DEFAULT_SIM_WORLD_SIZES = "8,32,128,512,1024"
DEFAULT_PLAN_EXPONENTS = "10,12,14,16,18,20"
SERIES = ("simulate", "plan", "check")

_PLAN_SNIPPET = """
import io, json, sys, time
from rich.console import Console
from zerosim.checks.partition import check_partition_plan
from zerosim.report.plan_table import render
from zerosim.values.layout import ParamLayout
from zerosim.values.plan import build_plan
from zerosim.values.strategy import ShardingStrategy, Topology
total, ws = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
layout = ParamLayout.from_list([("flat", (total,))], name=f"flat-{total}")
plan = build_plan(layout, ShardingStrategy.parse("full_shard"), "seed", Topology(ws))
t1 = time.perf_counter()
verdict = check_partition_plan(plan)
t2 = time.perf_counter()
render(plan, verdict, (t2 - t1) * 1e3, console=Console(file=io.StringIO(), width=220))
t3 = time.perf_counter()
print(json.dumps({"seconds": t3 - t0, "build_s": t1 - t0, "check_s": t2 - t1, "render_s": t3 - t2,
                  "passed": verdict.passed}))
"""

_CHECK_SNIPPET = """
import json, statistics, sys, time
from zerosim.checks.partition import check_partition_plan
from zerosim.values.layout import ParamLayout
from zerosim.partition import get_partitioner
total, ws = int(sys.argv[1]), int(sys.argv[2])
t0 = time.perf_counter()
plan = get_partitioner("seed")(ParamLayout.from_list([("flat", (total,))]), ws)
build_s = time.perf_counter() - t0
times, verdict = [], None
for _ in range(5):
    t = time.perf_counter()
    verdict = check_partition_plan(plan)
    times.append(time.perf_counter() - t)
print(json.dumps({"seconds": statistics.median(times), "build_s": build_s, "check_min_s": min(times),
                  "passed": verdict.passed}))
"""


def total_for(exponent: int) -> int:
    """Parameters of the plan point with 2^exponent ranks: 10^12 at 2^10 up to 10^15 at 2^20."""
    return int(round(10 ** (12 + 0.3 * (exponent - 10))))


def _point(argv: list[str], timeout: int, env: dict[str, str], cwd: Path | None) -> dict[str, Any]:
    """One point in a fresh child; the peak RSS comes from wait4 on that child alone."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd)
    deadline = t0 + timeout
    out_chunks: list[bytes] = []
    err_chunks: list[bytes] = []

    def drain(stream: Any, sink: list[bytes]) -> None:
        for chunk in iter(lambda: stream.read(65536), b""):
            sink.append(chunk)

    readers = [threading.Thread(target=drain, args=(proc.stdout, out_chunks), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, err_chunks), daemon=True)]
    for r in readers:
        r.start()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.perf_counter() > deadline:
            proc.kill()
            os.wait4(proc.pid, 0)
            return {"status": "timeout", "seconds": None, "timeout_s": timeout}
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    for r in readers:
        r.join(5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    out = b"".join(out_chunks).decode(errors="replace")
    err = b"".join(err_chunks).decode(errors="replace")
    rec: dict[str, Any] = {"wall_s": wall, "peak_rss_bytes": usage.ru_maxrss * 1024,
                           "returncode": proc.returncode}
    last_err = (err.strip().splitlines() or [""])[-1]
    if proc.returncode == 2 or "ConfigError" in last_err:  # a bounded-work limit (API points raise it)
        rec.update(status="refused", seconds=None,
                   message=(err.strip().splitlines() or [""])[-1][:300])
    elif proc.returncode != 0:
        rec.update(status="failed", seconds=None, message=(err.strip().splitlines() or [""])[-1][:300])
    else:
        rec["status"] = "ok"
        last = out.strip().splitlines()[-1] if out.strip() else ""
        if last.startswith("{"):
            rec.update(json.loads(last))
        else:
            rec["seconds"] = wall
    return rec


def _imported_from(py: str, env: dict[str, str], cwd: Path | None) -> str:
    """Where the points' zerosim package comes from (checks that ``--source`` took effect)."""
    out = subprocess.run([py, "-c", "import zerosim; print(zerosim.__file__)"], capture_output=True,
                         text=True,
                         env=env, cwd=cwd, timeout=60)
    return out.stdout.strip()


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Slope of log(y) on log(x) by least squares; None with fewer than two points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return None
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def _exponents(points: list[dict[str, Any]]) -> dict[str, float | None]:
    ok = [p for p in points if p.get("status") == "ok"]
    return {"time": fit_exponent([p["world_size"] for p in ok], [p["seconds"] for p in ok]),
            "peak_rss": fit_exponent([p["world_size"] for p in ok], [p["peak_rss_bytes"] for p in ok])}


def run(args: Any) -> int:
    from ..files.int_text import parse_int_list

    series = [s.strip() for s in str(args.series).split(",") if s.strip()]
    for s in series:
        if s not in SERIES:
            raise ConfigError("series", s, f"known: {', '.join(SERIES)}")
    sim_sizes = parse_int_list(args.sim_world_sizes, "sim_world_sizes")
    for n in sim_sizes:
        require_positive_int("sim_world_sizes", n)
    exps = parse_int_list(args.plan_exponents, "plan_exponents")
    for k in exps:
        if not 0 <= k <= 30:
            raise ConfigError("plan_exponents", k, "must be in [0, 30] (2^k ranks)")
    timeout = require_positive_int("timeout", args.timeout)
    env = dict(os.environ)
    source = None
    if args.source is not None:
        source = Path(args.source).resolve()
        if not (source / "zerosim" / "__init__.py").is_file():
            raise ConfigError("source", args.source, "must be a directory holding a zerosim package")
        env["PYTHONPATH"] = str(source) + os.pathsep + env.get("PYTHONPATH", "")
    label = args.label or ("before" if source else "after")
    before = None
    if args.before is not None:
        try:
            before = json.loads(Path(args.before).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError("before", args.before, f"must be a bench_scale JSON report ({e})") from None
    out = output_file(args.out, "bench-scale", "bench_scale.json")  # refused before anything runs

    py = sys.executable
    results: dict[str, list[dict[str, Any]]] = {}
    for name in series:
        points = []
        jobs: list[tuple[int, int | None, list[str]]]
        if name == "simulate":
            jobs = [(n, None, [py, "-m", "zerosim", "simulate", "--model", "tiny", "--world-size", str(n),
                               "--steps", "3"]) for n in sim_sizes]
        else:
            snippet = _PLAN_SNIPPET if name == "plan" else _CHECK_SNIPPET
            jobs = [(2**k, total_for(k), [py, "-c", snippet, str(total_for(k)), str(2**k)]) for k in exps]
        for ws, total, argv in jobs:
            rec = _point(argv, timeout, env, source)  # the child imports zerosim from its cwd first
            rec.update(world_size=ws, total=total)
            points.append(rec)
            what = f"{name:8s} {ws:>8,} ranks" + (f" x {total:.0e} params" if total else "")
            if rec["status"] == "ok":
                print(f"{what}: {rec['seconds']:9.3f} s, peak RSS {rec['peak_rss_bytes'] / 2**20:8.1f} MiB",
                      flush=True)
            else:
                print(f"{what}: {rec['status']}: {rec.get('message', '')}", flush=True)
        results[name] = points

    fitted = {name: _exponents(points) for name, points in results.items()}
    for name, fit in fitted.items():
        t, m = fit["time"], fit["peak_rss"]
        print(f"{label} {name}: time ~ ranks^{t:.2f}" if t is not None
              else f"{label} {name}: time: too few points",
              f", peak RSS ~ ranks^{m:.2f}" if m is not None else "")
    report = {
        "benchmark": "scale", "label": label, "source": str(source) if source else None,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "series": results, "exponents": fitted,
        "zerosim": _imported_from(py, env, source),
        "targets": {"simulate_tiny_1024_s": 30.0, "check_1e15_x_2p20_s": 0.2, "plan_2p20_s": 2.0,
                    "plan_2p20_peak_bytes": 2**30},
    }
    if before is not None:
        report["before"] = {"label": before.get("label", "before"), "series": before.get("series", {}),
                            "exponents": before.get("exponents", {})}
    write_text(out, json.dumps(report, indent=2) + "\n")
    png = out.with_suffix(".png")
    _plot(report, png)
    print(f"wrote {out} and {png}")
    return 0


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(report["label"], report["series"], "-o")]
    if "before" in report:
        runs.insert(0, (report["before"]["label"], report["before"]["series"], "--x"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, series, style in runs:
        for name, points in series.items():
            ok = [p for p in points if p.get("status") == "ok"]
            if not ok:
                continue
            xs = [p["world_size"] for p in ok]
            axes[0].plot(xs, [p["seconds"] for p in ok], style, label=f"{name} ({label})")
            axes[1].plot(xs, [p["peak_rss_bytes"] / 2**20 for p in ok], style, label=f"{name} ({label})")
    for ax, ylabel in zip(axes, ("seconds", "peak RSS (MiB)"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("time: simulate (tiny, 3 steps), plan, C-ZERO-001 check")
    axes[1].set_title("peak memory of each point's process")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)
