"""``zerosim gpu-check [--out DIR] [--cpu] [--only STEPS]``: the prepared check of the CUDA paths on one GPU.

The steps, their limits and sizes, the folder it writes and its exit statuses are described in
:mod:`zerosim.bench.gpu_check`; docs/gpu.md says how to run it and what to commit.
"""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    from ..bench.gpu_check import PERTURB_ENV, STEP_NAMES, TOTAL_LIMIT_S

    p = sub.add_parser(
        "gpu-check",
        help="prove the CUDA paths on one GPU in one command (tests, report, trainer, offload, kernel)",
        description=f"Runs {', '.join(STEP_NAMES)} on one CUDA device, each with its own time limit and "
        f"all within {TOTAL_LIMIT_S:.0f} s, and writes one folder: gpu-check.json, gpu-check.md, "
        "gpu-check.png and each step's output under steps/. Exit 0 every step passed or was skipped "
        "for a stated reason, 1 a step failed, 124 a step timed out, 2 bad input or no CUDA.",
        epilog=f"{PERTURB_ENV}=trainer|kernel perturbs one value that step compares (the check's own test).",
    )
    p.add_argument("--out", default=None, metavar="DIR",
                   help="a new or empty folder (default reports/gpu-check-<UTC time>/)")
    p.add_argument("--cpu", action="store_true",
                   help="the same steps on the CPU at small sizes, limits doubled (no CUDA needed; "
                   "what CI runs)")
    p.add_argument("--only", default=None, metavar="STEPS",
                   help=f"comma-separated steps to run (default all: {','.join(STEP_NAMES)})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..bench.gpu_check import run as gpu_check

    return gpu_check(args)
