"""Run one ``zerosim`` benchmark in two checkouts, alternately, and compare what each reports.

Each checkout (``--base``, ``--new``) runs with its own virtual environment's interpreter
(``DIR/.venv/bin/python -m zerosim ...``, working directory ``DIR``), so each measures its own code
on the same machine. The runs alternate, base then new, for ``--rounds`` rounds, so a load that
changes during the comparison falls on both. For every run this records the wall time, the load
average before and after (``uptime``), and the figures the benchmark wrote to its JSON report
(``{out}`` in the command is replaced by a fresh file for each run). Per figure it gives each
version's median and range, and the ratio new/base of the medians:

* timings and time ratios: ``within noise`` when the two ranges overlap, ``slower`` or ``faster``
  beyond noise when they do not (every new run above every base run, or below);
* memory figures and counts (accounted peaks, budgets, bytes copied, fetches): most depend on the
  code only, so they must be *equal* in every run of both versions; anything else is reported as
  ``DIFFERS`` (with ``varies run to run`` where one version's own runs disagree, as tracemalloc's
  process peak, which counts Python objects too, does), with the ratio of the medians.

Results go to one JSON (``--json``; an existing one keeps its other benchmarks, this one's entry is
replaced after every round, so a comparison stopped part-way keeps the rounds it finished) and a
markdown rendering of the whole JSON (``--md``). Without a command, the summaries and the markdown
are derived again from the runs the JSON holds. Standard library only.

    python tools/compare_versions.py --base ../bench5-base --new . --name sim --rounds 3 \\
        --json reports/engine-before-after.json --md reports/engine-before-after.md \\
        -- bench sim --world-sizes 8 --repeats 3 --out {out}
    python tools/compare_versions.py --json reports/engine-before-after.json --md out.md  # summaries again
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Figures = dict[str, Any]


class UsageError(Exception):
    """A bad option or checkout: one line for the user, exit 2."""


def sim_figures(report: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Figures of ``zerosim bench sim``: per world size, the median timed steps, the sim/unsharded
    ratio, and the memory accounting (the ranks' accounted peaks and tracemalloc's process peak)."""
    out: dict[str, tuple[str, Any]] = {}
    for r in report["results"]:
        p = f"{r['world_size']} ranks: "
        out[p + "simulated step (s)"] = ("time", statistics.median(r["sim_step_s"]))
        out[p + "unsharded step (s)"] = ("time", statistics.median(r["baseline_step_s"]))
        out[p + "ratio_median"] = ("time", r["ratio_median"])
        for key in ("sum_rank_peak_bytes", "max_rank_peak_bytes", "sum_rank_init_state_bytes",
                    "process_peak_bytes"):
            out[p + key] = ("exact", r["memory"][key])
    return out


def offload_figures(report: dict[str, Any]) -> dict[str, tuple[str, Any]]:
    """Figures of ``zerosim bench offload``: both ZeroTrainers' median steps and their ratio, the
    device tier's budget and peaks, the offload manager's counts, and bitwise equality."""
    out: dict[str, tuple[str, Any]] = {
        "step without offload (s)": ("time", report["median_step_s"]["plain"]),
        "step with offload (s)": ("time", report["median_step_s"]["offload"]),
        "offload_over_plain": ("time", report["offload_over_plain"]),
        "bitwise_equal": ("exact", report["bitwise_equal"]),
    }
    for key in ("device_budget_bytes", "device_peak_bytes", "host_peak_bytes"):
        out[key] = ("exact", report[key])
    perf = report["performance_stats"]
    for key in ("fetches", "prefetch_hits", "resident_hits", "misses", "evictions",
                "bytes_host_to_device"):
        out[key] = ("exact", perf[key])
    return out


EXTRACTORS: dict[str, Callable[[dict[str, Any]], dict[str, tuple[str, Any]]]] = {
    "sim": sim_figures,
    "offload": offload_figures,
}


def load_now() -> dict[str, Any]:
    """The 1, 5 and 15 minute load averages and ``uptime``'s own line."""
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "uptime": line}


def checkout(path: str, role: str) -> dict[str, Any]:
    """A checkout's root, interpreter and commit; UsageError unless its venv imports its own zerosim."""
    root = Path(path).resolve()
    python = root / ".venv" / "bin" / "python"
    if not python.is_file():
        raise UsageError(f"--{role}: {root} has no .venv/bin/python")
    probe = subprocess.run([str(python), "-c", "import zerosim; print(zerosim.__file__)"], cwd=root,
                           capture_output=True, text=True, timeout=120, env=_env(root))
    where = Path(probe.stdout.strip() or "?").resolve()
    if probe.returncode != 0 or root not in where.parents:
        raise UsageError(f"--{role}: {python} imports zerosim from {where}, not from {root}")
    git = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%H %s"], capture_output=True,
                         text=True, timeout=30)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, timeout=30).stdout.strip() != ""
    return {"path": str(root), "python": str(python), "commit": git.stdout.strip(), "dirty": dirty}


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(root / ".venv")
    env["PATH"] = f"{root / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_once(side: dict[str, Any], command: list[str], timeout: float, tmp: Path,
             tag: str) -> tuple[Figures, dict[str, str]]:
    """One benchmark run in one checkout: (wall time, load before and after, rc and the figures;
    each figure's kind)."""
    out = tmp / f"{tag}.json"
    argv = [side["python"], "-m", "zerosim", *(a.replace("{out}", str(out)) for a in command)]
    before = load_now()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=side["path"], env=_env(Path(side["path"])), capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UsageError(f"{tag}: no result within --timeout {timeout:g} s") from None
    wall = time.perf_counter() - t0
    after = load_now()
    if not out.is_file():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UsageError(f"{tag}: exit {proc.returncode} and no JSON report: {tail[0]}")
    report = json.loads(out.read_text())
    name = report.get("benchmark")
    if name not in EXTRACTORS:
        raise UsageError(f"{tag}: benchmark {name!r} has no figures here (known: {', '.join(EXTRACTORS)})")
    figures = {"wall time (s)": ("time", wall), **EXTRACTORS[name](report)}
    record = {"rc": proc.returncode, "wall_s": round(wall, 3), "load_before": before, "load_after": after,
              "figures": {k: v for k, (_, v) in figures.items()}}
    return record, {k: kind for k, (kind, _) in figures.items()}


def summarise(runs: list[dict[str, Any]], kinds: dict[str, str]) -> list[dict[str, Any]]:
    """Per figure (``kinds``: figure -> time or exact): each version's values, median and range,
    new/base of the medians, and the verdict."""
    rows = []
    for fig, kind in kinds.items():
        row: dict[str, Any] = {"figure": fig, "kind": kind}
        for ver in ("base", "new"):
            vals = [r[ver]["figures"].get(fig) for r in runs]
            row[ver] = {"values": vals}
            if kind == "time":
                row[ver].update(median=statistics.median(vals), min=min(vals), max=max(vals))
        if kind == "time":
            b, n = row["base"], row["new"]
            row["ratio_new_over_base"] = n["median"] / b["median"] if b["median"] else None
            row["verdict"] = ("one run each: no spread" if len(runs) < 2
                              else "slower beyond noise" if n["min"] > b["max"]
                              else "faster beyond noise" if n["max"] < b["min"] else "within noise")
        else:
            base, new = row["base"]["values"], row["new"]["values"]
            steady = all(v == base[0] for v in base) and all(v == new[0] for v in new)
            row["verdict"] = ("equal" if steady and base[0] == new[0]
                              else "DIFFERS" if steady else "DIFFERS, and varies run to run")
            if row["verdict"] != "equal" and all(_number(v) for v in base + new):
                row["ratio_new_over_base"] = statistics.median(new) / statistics.median(base)
        rows.append(row)
    return rows


def render_markdown(doc: dict[str, Any]) -> str:
    """The whole JSON as markdown: per benchmark, the command, checkouts, load and the figure table."""
    lines = ["# Before and after: the same benchmarks on two checkouts", "",
             "Generated by `tools/compare_versions.py` from the JSON beside this file. Runs alternate "
             "base, new, base, new, ...; time figures give median [min-max] over the rounds, memory "
             "figures and counts must be equal in every run.", ""]
    for name, bench in doc["benchmarks"].items():
        loads = [r[v][k]["loadavg"][0] for r in bench["runs"] for v in ("base", "new")
                 for k in ("load_before", "load_after")]
        lines += [f"## {name}", "", f"`zerosim {' '.join(bench['command'])}`, {_rounds(bench)}, "
                  f"started {bench['started_utc']}; 1-minute load average {min(loads):.2f}-{max(loads):.2f} "
                  "across the runs.", ""]
        if bench.get("note"):
            lines += [f"Note: {bench['note']}.", ""]
        for ver in ("base", "new"):
            c = bench["checkouts"][ver]
            dirty = " (uncommitted changes)" if c["dirty"] else ""
            lines.append(f"- {ver}: `{c['commit'][:7]}` {c['commit'][41:]}{dirty}")
        lines += ["", "| figure | base | new | new/base | verdict |", "|---|---|---|---|---|"]
        for row in bench["summary"]:
            if row["kind"] == "time":
                cells = [_spread(row[v]) for v in ("base", "new")]
                ratio = f"{row['ratio_new_over_base']:.3f}" if row["ratio_new_over_base"] else "-"
            else:
                cells = [_exact(row[v]["values"]) for v in ("base", "new")]
                ratio = f"{row['ratio_new_over_base']:.4f}" if "ratio_new_over_base" in row else "-"
            lines.append(f"| {row['figure']} | {cells[0]} | {cells[1]} | {ratio} | {row['verdict']} |")
        lines.append("")
    return "\n".join(lines)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _rounds(bench: dict[str, Any]) -> str:
    done, asked = bench["rounds"], bench.get("rounds_asked", bench["rounds"])
    return f"{done} rounds" if done == asked else f"{done} of {asked} rounds (stopped)"


def _spread(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def _exact(values: list[Any]) -> str:
    shown = [f"{v:,}" if _number(v) else str(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def _write(path: Path, text: str) -> None:
    """Replace ``path`` whole (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def compare(args: argparse.Namespace, save: Callable[[dict[str, Any]], None]) -> None:
    """The rounds of one benchmark, alternating base and new; ``save`` gets the JSON entry for it
    after every round, so a comparison stopped part-way keeps the rounds it finished."""
    sides = {"base": checkout(args.base, "base"), "new": checkout(args.new, "new")}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    runs: list[dict[str, Any]] = []
    kinds: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="zerosim-compare-") as tmp:
        for i in range(1, args.rounds + 1):
            entry: dict[str, Any] = {"round": i}
            for ver in ("base", "new"):
                tag = f"{args.name} round {i} {ver}"
                print(f"{tag}: running ...", flush=True)
                entry[ver], kinds = run_once(sides[ver], args.command, args.timeout, Path(tmp),
                                             tag.replace(" ", "-"))
                print(f"{tag}: {entry[ver]['wall_s']:.1f} s, rc {entry[ver]['rc']}, load "
                      f"{entry[ver]['load_before']['loadavg']} -> {entry[ver]['load_after']['loadavg']}",
                      flush=True)
            runs.append(entry)
            save({"command": args.command, "rounds": len(runs), "rounds_asked": args.rounds,
                  "started_utc": started, "checkouts": sides, "runs": runs,
                  "summary": summarise(runs, kinds)})


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", help="checkout measured first in each round (its .venv is used)")
    p.add_argument("--new", help="checkout measured second in each round")
    p.add_argument("--name", help="this benchmark's key in the JSON")
    p.add_argument("--rounds", type=int, default=3, help="base+new pairs (default 3)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds per run before it fails (default 900)")
    p.add_argument("--json", required=True, help="results JSON (other benchmarks in it are kept)")
    p.add_argument("--md", required=True, help="markdown rendering of the whole JSON")
    p.add_argument("command", nargs="*", help="zerosim arguments after --, with {out} for the report file")
    args = p.parse_args(argv)
    if args.command:
        for opt in ("base", "new", "name"):
            if not getattr(args, opt):
                raise UsageError(f"--{opt} is required to run a comparison")
        if args.rounds < 1:
            raise UsageError(f"--rounds: {args.rounds} must be >= 1")
        if not any("{out}" in a for a in args.command):
            raise UsageError("command: no {out} placeholder for the benchmark's JSON report")
    return args


def main(argv: list[str]) -> int:
    # a stopped comparison ends its running benchmark (subprocess.run kills it on the way out) and
    # removes its temporary reports; the JSON and markdown hold the rounds finished before it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        args = parse(argv)
        path = Path(args.json)
        doc: dict[str, Any] = {"benchmarks": {}}
        if path.is_file():
            doc = json.loads(path.read_text())
        if args.command:
            def save(entry: dict[str, Any]) -> None:
                doc["benchmarks"][args.name] = entry
                _write(path, json.dumps(doc, indent=2) + "\n")
                _write(Path(args.md), render_markdown(doc))

            compare(args, save)
        elif not doc["benchmarks"]:
            raise UsageError(f"--json: {path} holds no comparison to render")
        else:  # render only: the summaries derived again from the runs the JSON holds
            for bench in doc["benchmarks"].values():
                kinds = {row["figure"]: row["kind"] for row in bench["summary"]}
                bench["summary"] = summarise(bench["runs"], kinds)
            _write(path, json.dumps(doc, indent=2) + "\n")
            _write(Path(args.md), render_markdown(doc))
    except UsageError as e:
        print(f"compare_versions: {e}", file=sys.stderr)
        return 2
    print(render_markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
