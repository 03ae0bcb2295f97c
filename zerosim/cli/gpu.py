"""The options of ``python -m zerogpu report`` and ``torchrun ... -m zerogpu selftest-comm``.

The commands themselves live in :mod:`zerogpu.gpu_report` and :mod:`zerogpu.selftest`; every
command-line parser of the project lives in :mod:`zerosim.cli`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.config import XP_NAMES
from ..engine.run_file import BACKEND_OPTIONS
from ..numerics.precision import PRECISION_NAMES
from ..values.presets import simulator_presets

#: where ``python -m zerogpu report`` writes by default
DEFAULT_REPORT_OUT = Path("reports/gpu")


def report_parser() -> argparse.ArgumentParser:
    """``python -m zerogpu report [options]``."""
    p = argparse.ArgumentParser(
        prog="python -m zerogpu report",
        description="GPU equivalence report: every strategy under torchrun on NCCL, "
        "contract verdicts and error vs ground truth, as JSON + markdown.",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_REPORT_OUT,
                   help=f"output folder (default {DEFAULT_REPORT_OUT})")
    p.add_argument("--world-size", "--world", dest="world_size", type=int, default=None, metavar="N",
                   help="ranks, one GPU each (default: the number of visible GPUs; 2 with --cpu)")
    p.add_argument("--cpu", action="store_true", help="no CUDA needed: gloo on the CPU (the same report)")
    p.add_argument("--strategies", default="all", metavar="LIST", help="comma-separated, or 'all' (default)")
    p.add_argument("--model", default="tiny", metavar="PRESET",
                   help=f"block-model preset (default tiny): {', '.join(simulator_presets())}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=PRECISION_NAMES)
    p.add_argument("--xp", default="torch", choices=XP_NAMES,
                   help="the engine's arrays: torch on the device (default) or host numpy")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout in seconds (default 120)")
    p.add_argument(
        "--launch-timeout", type=float, default=1800.0, help="the whole torchrun launch (default 1800)"
    )
    return p


def selftest_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerogpu selftest-comm [options]``."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerogpu selftest-comm",
        description="Check every TorchCommunicator collective against numpy on these ranks.",
    )
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:N")
    p.add_argument("--dist-backend", default="auto", choices=BACKEND_OPTIONS["torch"]["dist_backend"])
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds (default 60)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p

