"""``zerosim bench mpi``: the MPI communicator's collectives against raw mpi4py calls, side by side.

For each world size (``--ranks``, default 2 and 4) the command launches ``mpiexec`` once. Inside
every rank, for each buffer size (``--min-bytes`` .. ``--max-bytes``, powers of 4) and collective
(all-reduce, reduce-scatter, all-gather on float32 buffers) it times, on the **same** input and
output buffers:

- ``raw``: ``comm.Allreduce(x, y, MPI.SUM)`` / ``Reduce_scatter_block`` / ``Allgather``;
- ``ours``: ``MpiCommunicator.all_reduce(x, "sum", out=y)`` ... (``timeout_mode="abort"``, the
  default: blocking call + watchdog);
- ``ours_new``: the same call without ``out=`` (a fresh result array each call, as the engine calls it);
- ``ours_raise``: ``timeout_mode="raise"`` (nonblocking call polled until a deadline), with ``out=``;
- ``raw_again``: raw once more: raw vs raw is the noise floor of the measurement itself.

A measurement is the slowest rank's mean time over enough calls to fill ``--target-ms``. Every
variant is measured ``--repeats`` times, each time paired with a raw measurement taken right next
to it (order alternating), and ``ratio`` is the median over the pairs of raw time / variant time,
so load from other processes hits both sides of a pair alike. GB/s is the algorithm bandwidth:
the full buffer (all-reduce input, reduce-scatter input, all-gather output) over the median time.
Rank 0 of each launch writes its rows; this process prints the table and writes
``bench_mpi.json`` in a new ``reports/bench-mpi-<timestamp>/`` (or ``--out``). Target: ``ours`` at
least 0.9x ``raw`` at every size from 64 KiB up;
shortfalls are flagged with ``!``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..files.outputs import output_file, write_text
from ..values.run_value import RunValue

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather")
VARIANTS = ("raw", "ours", "ours_new", "ours_raise", "raw_again")
TARGET_RATIO = 0.9
TARGET_FROM_BYTES = 64 * 1024
DEFAULT_OUT = "a new reports/bench-mpi-<timestamp>/bench_mpi.json"
MPI_BENCH_RUN_FORMAT = "zerosim-bench-mpi-run/1"


@dataclass(frozen=True)
class MpiBenchRun(RunValue):
    """What every rank of one ``bench mpi`` launch needs, as one value: the buffer sizes, the repeats, the
    time each measurement fills and the file rank 0 writes its rows to. The command writes it to a file
    in its private temporary folder and starts ``python -m zerosim.mpi bench-worker --config FILE``."""

    sizes: tuple[int, ...]
    repeats: int
    target_ms: float
    out: str

    FORMAT = MPI_BENCH_RUN_FORMAT
    WHAT = "bench mpi run file"

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> MpiBenchRun:
        """The value of the file's fields, every one checked (ConfigError naming the first bad one)."""
        sizes = fields.get("sizes")
        if not isinstance(sizes, list) or not sizes:
            raise ConfigError("sizes", sizes, "expected a non-empty list of byte counts")
        for size in sizes:
            require_positive_int("sizes", size)
        repeats = require_positive_int("repeats", fields.get("repeats"))
        target = fields.get("target_ms")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < float("inf"):
            raise ConfigError("target_ms", target, "must be a positive number of milliseconds")
        out = fields.get("out")
        if not isinstance(out, str) or not out:
            raise ConfigError("out", out, "expected a file path")
        return cls(tuple(sizes), repeats, float(target), out)


def read_mpi_bench_run(path: str) -> MpiBenchRun:
    """The :class:`MpiBenchRun` in ``path``; ConfigError naming the file or the field if it is not one."""
    return MpiBenchRun.read(path)


def buffer_sizes(min_bytes: int, max_bytes: int) -> list[int]:
    """Powers of 4 times ``min_bytes`` up to ``max_bytes`` (both included when ``max`` is on the grid)."""
    require_positive_int("min_bytes", min_bytes)
    require_positive_int("max_bytes", max_bytes)
    if max_bytes < min_bytes:
        raise ConfigError("max_bytes", max_bytes, f"must be >= min_bytes={min_bytes}")
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def run(args: Any) -> int:
    from ..mpi.launch import run_mpiexec

    sizes = buffer_sizes(args.min_bytes, args.max_bytes)
    for n in args.ranks:
        require_positive_int("ranks", n)
    require_positive_int("repeats", args.repeats)
    if not args.target_ms > 0:
        raise ConfigError("target_ms", args.target_ms, "must be positive")
    out = output_file(args.out, "bench-mpi", "bench_mpi.json")  # refused before anything runs
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zerosim-bench-mpi-") as tmp:
        for n in args.ranks:
            part = Path(tmp) / f"ranks{n}.json"
            run_file = MpiBenchRun(tuple(sizes), args.repeats, float(args.target_ms), str(part)).write(
                Path(tmp) / f"ranks{n}.run.json")
            argv = ["-m", "zerosim.mpi", "bench-worker", "--config", str(run_file)]
            print(
                f"launching mpiexec -n {n} ({len(sizes)} sizes x {len(COLLECTIVES)} collectives)...",
                file=sys.stderr,
            )
            result = run_mpiexec(n, argv, args.launch_timeout)
            if result.returncode != 0 or not part.exists():
                sys.stderr.write(result.stderr or "")
                print(f"error: the {n}-rank benchmark failed (exit {result.returncode}"
                      f"{', timed out' if result.timed_out else ''})", file=sys.stderr)
                return 1
            data = json.loads(part.read_text())
            rows.extend(data["rows"])
            meta = data["meta"]
    below = [r for r in rows if r["bytes"] >= TARGET_FROM_BYTES and r["ratio"] < TARGET_RATIO]
    report = {
        "benchmark": "zerosim bench mpi",
        "target": {"ratio": TARGET_RATIO, "from_bytes": TARGET_FROM_BYTES, "variant": "ours"},
        "config": {"ranks": args.ranks, "sizes": sizes, "repeats": args.repeats, "target_ms": args.target_ms},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            **meta,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "rows": rows,
        "below_target": [{k: r[k] for k in ("collective", "ranks", "bytes", "ratio")} for r in below],
    }
    write_text(out, json.dumps(report, indent=1) + "\n")
    print_table(rows)
    verdict = "met" if not below else f"MISSED at {len(below)} point(s) (flagged with !)"
    print(f"target: ours >= {TARGET_RATIO}x raw at every size >= {TARGET_FROM_BYTES // 1024} KiB: {verdict}")
    print(f"wrote {out}")
    return 0


def _human(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..files.text_tables import print_table

    table = Table(title="MpiCommunicator vs raw mpi4py (GB/s = full buffer / time; ratio = raw time / ours)")
    for col in (
        "size",
        "collective",
        "ranks",
        "ours GB/s",
        "raw GB/s",
        "ratio",
        "new-array ratio",
        "raise-mode ratio",
        "raw/raw (noise)",
    ):
        table.add_column(col, justify="left" if col == "collective" else "right")
    for r in sorted(rows, key=lambda r: (r["ranks"], r["collective"], r["bytes"])):
        flag = " !" if r["bytes"] >= TARGET_FROM_BYTES and r["ratio"] < TARGET_RATIO else ""
        table.add_row(_human(r["bytes"]), r["collective"], str(r["ranks"]), f"{r['gbps']['ours']:.3f}",
                      f"{r['gbps']['raw']:.3f}", f"{r['ratio']:.3f}{flag}", f"{r['ratio_new']:.3f}",
                      f"{r['ratio_raise']:.3f}", f"{r['ratio_raw_again']:.3f}")
    print_table(table, Console(width=140))


def _paired(pairs: list[tuple[float, float]]) -> float:
    """Median over repeats of raw time / other time, each pair measured back to back."""
    return statistics.median(raw / other for raw, other in pairs)


# ---- inside each rank (python -m zerosim.mpi bench-worker ...) ------------------------------------

def worker_main(args: MpiBenchRun) -> int:
    """One rank of the benchmark, its settings one value (:class:`MpiBenchRun`). Rank 0 writes ``out``."""

    import mpi4py
    import numpy as np
    from mpi4py import MPI

    from ..comm.mpi import MpiCommunicator

    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    ours = MpiCommunicator(world, timeout_mode="abort", timeout_s=300.0)
    ours_raise = MpiCommunicator(world, timeout_mode="raise", timeout_s=300.0, group_name="world.raise")

    def variants(collective: str, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        if collective == "all_reduce":
            return {"raw": lambda: world.Allreduce(x, y, MPI.SUM),
                    "ours": lambda: ours.all_reduce(x, "sum", out=y),
                    "ours_new": lambda: ours.all_reduce(x, "sum"),
                    "ours_raise": lambda: ours_raise.all_reduce(x, "sum", out=y),
                    "raw_again": lambda: world.Allreduce(x, y, MPI.SUM)}
        if collective == "reduce_scatter":
            return {"raw": lambda: world.Reduce_scatter_block(x, y, MPI.SUM),
                    "ours": lambda: ours.reduce_scatter(x, "sum", out=y),
                    "ours_new": lambda: ours.reduce_scatter(x, "sum"),
                    "ours_raise": lambda: ours_raise.reduce_scatter(x, "sum", out=y),
                    "raw_again": lambda: world.Reduce_scatter_block(x, y, MPI.SUM)}
        return {"raw": lambda: world.Allgather(x, y),
                "ours": lambda: ours.all_gather(x, out=y),
                "ours_new": lambda: ours.all_gather(x),
                "ours_raise": lambda: ours_raise.all_gather(x, out=y),
                "raw_again": lambda: world.Allgather(x, y)}

    slowest = np.empty(1)

    def timed(fn: Any, iters: int) -> float:
        """Mean seconds per call of the slowest rank."""
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dt = np.array([(time.perf_counter() - t0) / iters])
        world.Allreduce(dt, slowest, MPI.MAX)
        return float(slowest[0])

    rows = []
    for nbytes in args.sizes:
        full = max(n, nbytes // 4 // n * n)  # float32 elements, divisible by the group size
        for collective in COLLECTIVES:
            if collective == "all_reduce":
                x, y = np.ones(full, np.float32), np.empty(full, np.float32)
            elif collective == "reduce_scatter":
                x, y = np.ones(full, np.float32), np.empty(full // n, np.float32)
            else:
                x, y = np.ones(full // n, np.float32), np.empty(full, np.float32)
            fns = variants(collective, x, y)
            for fn in fns.values():  # warm up: connections, pages, algorithm selection
                fn()
            probe = timed(fns["raw"], 3)
            iters = max(1, min(2000, int(args.target_ms / 1e3 / max(probe, 1e-7))))
            pairs: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS[1:]}
            for rep in range(args.repeats):
                for v in VARIANTS[1:]:
                    first, second = ("raw", v) if rep % 2 == 0 else (v, "raw")
                    t_first, t_second = timed(fns[first], iters), timed(fns[second], iters)
                    pairs[v].append((t_first, t_second) if first == "raw" else (t_second, t_first))
            payload = full * 4
            times = {
                "raw": [r for v in pairs for r, _ in pairs[v]],
                **{v: [o for _, o in pairs[v]] for v in pairs},
            }
            med = {v: statistics.median(ts) for v, ts in times.items()}
            rows.append(
                {
                    "collective": collective,
                    "ranks": n,
                    "bytes": payload,
                    "iters": iters,
                    "median_s": med,
                    "min_s": {v: min(ts) for v, ts in times.items()},
                    "gbps": {v: payload / t / 1e9 for v, t in med.items()},
                    "ratio": _paired(pairs["ours"]),
                    "ratio_new": _paired(pairs["ours_new"]),
                    "ratio_raise": _paired(pairs["ours_raise"]),
                    "ratio_raw_again": _paired(pairs["raw_again"]),
                    "ratio_of_min": min(times["raw"]) / min(times["ours"]),
                }
            )
    if me == 0:
        meta = {
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "mpi4py": mpi4py.__version__,
            "numpy": np.__version__,
            "thread_level": MPI.Query_thread(),
        }
        Path(args.out).write_text(json.dumps({"rows": rows, "meta": meta}))
    return 0
