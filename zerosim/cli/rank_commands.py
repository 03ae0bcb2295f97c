"""The options of the rank-side commands a launcher starts: ``zerosim verify``'s ranks, the peers
benchmark's ranks and the MPI benchmark's worker.

The work is in :func:`zerosim.verify.runner.rank_main`, :func:`zerosim.bench.peers_rank.main` and
:func:`zerosim.bench.mpi.worker_main`, functions of the parsed values; every command-line parser of
the project lives in :mod:`zerosim.cli`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench import peers
from ..verify.runner import DEFAULT_TIMEOUT_S, DEVICES, DTYPES, OPTIMIZERS


def verify_rank_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerosim.verify TARGET [options]``."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerosim.verify",
        description="Verify a sharded trainer against the unsharded reference (one "
        "process per rank; rank 0 reports).",
    )
    p.add_argument("target", help="a built-in adapter name or MODULE:FACTORY")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dtype", default="float64", choices=DTYPES)
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--model", default="gpt")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--out", default=None, help="directory for report.json (rank 0)")
    p.add_argument("--json", action="store_true", help="rank 0 prints the report as one JSON object")
    p.add_argument("--quiet", action="store_true", help="print nothing (the launcher reads report.json)")
    p.add_argument(
        "--resume-at", type=int, default=None, help="interrupt each phase after this many of its steps"
    )
    p.add_argument("--resume-dir", default=None, help="where the checkpoints and the first run's state go")
    p.add_argument(
        "--resume-stage",
        default=None,
        choices=("save", "load"),
        help="save: train up to the resume and save; load: load, continue and evaluate",
    )
    p.add_argument(
        "--save-observations",
        default=None,
        metavar="PATH",
        help="rank 0 pickles the phases and every rank's observations to PATH (re-evaluate offline "
        "with zerosim.verify.evaluate.evaluate_saved)",
    )
    return p


def peers_rank_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerosim.bench.peers_rank [options]``."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerosim.bench.peers_rank",
        description="Time one optimizer step under each adapter (one process per rank; rank 0 reports).",
    )
    p.add_argument("--models", default=",".join(peers.DEFAULT_MODELS))
    p.add_argument("--adapters", default=None, help="comma-separated (default: every installed adapter)")
    p.add_argument("--steps", type=int, default=peers.DEFAULT_STEPS)
    p.add_argument("--warmup", type=int, default=peers.DEFAULT_WARMUP)
    p.add_argument("--rounds", type=int, default=peers.DEFAULT_ROUNDS)
    p.add_argument("--min-time", type=float, default=peers.DEFAULT_MIN_TIME_S)
    # not --start: torchrun would take it for an abbreviation of its own --start-method
    p.add_argument("--from-position", type=int, default=0,
                   help="skip the runs before this position of the (round, adapter) order")
    p.add_argument("--skip", default="", help="comma-separated adapters left out (they failed before)")
    p.add_argument("--dtype", default="float32", choices=peers.DTYPES)
    p.add_argument("--device", default="cpu", choices=peers.DEVICES)
    p.add_argument("--optimizer", default="adamw", choices=peers.OPTIMIZERS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=peers.DEFAULT_TIMEOUT_S)
    p.add_argument("--out", default=None,
                   help=f"directory for the report (rank 0; default {peers.DEFAULT_OUT})")
    p.add_argument("--results", default=None,
                   help="rank 0 appends one JSON line per adapter here and writes no report "
                   "(how zerosim bench peers runs it)")
    return p


def bench_worker_parser() -> argparse.ArgumentParser:
    """``python -m zerosim.mpi bench-worker``: one rank of ``zerosim bench mpi`` (not for direct use)."""
    p = argparse.ArgumentParser(prog="python -m zerosim.mpi bench-worker")
    p.add_argument("--sizes", type=int, nargs="+", required=True)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--target-ms", type=float, default=20.0)
    p.add_argument("--out", type=Path, required=True)
    return p
