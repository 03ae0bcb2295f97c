"""``zerosim bench <what>``: benchmarks that print ratios measured side by side and write JSON into a new
reports/bench-<what>-<timestamp>/ folder (or ``--out``).

Each benchmark lives in ``zerosim.bench.<what>`` and exposes ``register(subparsers)``.
"""

from __future__ import annotations

import importlib

BENCH_MODULES = ("sim", "mpi", "check", "peers", "scale", "offload")


def register(sub) -> None:
    p = sub.add_parser("bench",
                       help="benchmarks (ratios measured side by side, JSON into a new reports/ folder)")
    inner = p.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCH_MODULES:
        importlib.import_module(f"zerosim.bench.{name}").register(inner)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
