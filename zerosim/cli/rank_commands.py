"""The options of the rank-side commands a launcher starts: ``zerosim verify``'s ranks and the peers
benchmark's ranks.

``zerosim verify``'s own launches give their ranks one argument, ``--run-file FILE`` (a
:class:`~zerosim.verify.run_value.VerifyRun`); ranks a user starts give TARGET and options, turned into
the same value here (:func:`verify_rank_run`). The launchers of ``zerosim bench`` ship their ranks one
value in a file (``--config FILE``) too; the peers options here serve ranks a user starts under an
external launcher.

The work is in :func:`zerosim.verify.runner.rank_main` and :func:`zerosim.bench.peers_rank.main`,
functions of the parsed values; every command-line parser of the project lives in :mod:`zerosim.cli`.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..bench import peers
from ..bench.peers_run import PeersRun
from ..errors import ConfigError, ZeroSimError
from ..verify.run_value import VerifyRun, read_verify_run


def verify_rank_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerosim.verify TARGET [options]``: the options of one verify run
    (:func:`zerosim.cli.verify.add_run_arguments`, shared with ``zerosim verify``) and the rank's own."""
    from .verify import add_run_arguments

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerosim.verify",
        description="Verify a sharded trainer against the unsharded reference (one "
        "process per rank; rank 0 reports).",
    )
    add_run_arguments(p)
    p.add_argument("--run-file", default=None, metavar="FILE",
                   help="the whole run as one JSON value (what zerosim verify writes for its ranks); "
                   "no other option with it")
    p.add_argument("--seed", default=None)
    p.add_argument("--quiet", action="store_true", help="print nothing (the launcher reads report.json)")
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
        help="rank 0 writes the phases and every rank's observations to PATH as plain data (re-evaluate "
        "offline with zerosim.verify.evaluate.evaluate_saved)",
    )
    return p


def verify_rank_run(argv: list[str]) -> VerifyRun:
    """The :class:`VerifyRun` of one verify rank: loaded from ``--run-file FILE``, or built from TARGET and
    options (C-ZERO-001..005 are judged on it). Usage errors and a bad run file: one line from rank 0,
    every rank exits 2."""
    from zerogpu.rank import fail_on_bad_input, parse_once

    args = parse_once(verify_rank_parser(), argv)
    try:
        if args.run_file is not None:
            if len(argv) != 2 and not (len(argv) == 1 and argv[0].startswith("--run-file=")):
                raise ConfigError("run_file", args.run_file, "give --run-file FILE alone: the file holds "
                                  "every option")
            return read_verify_run(args.run_file)
        if args.target is None:
            raise ConfigError("target", None, "give TARGET (a built-in adapter name or MODULE:FACTORY)")
        return verify_run_from_args(args)
    except ZeroSimError as e:
        fail_on_bad_input(e)


def verify_run_from_args(args: Any, world: int | None = None) -> VerifyRun:
    """The value a rank's parsed options (:func:`verify_rank_parser`) describe
    (:func:`zerosim.cli.verify.verify_run`, the one conversion of verify's options)."""
    from .verify import verify_run

    return verify_run(args, world)


def peers_rank_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerosim.bench.peers_rank [options]``: the options of one peers
    benchmark (:func:`zerosim.cli.bench.add_peers_arguments`, shared with ``zerosim bench peers``) and
    the rank's own."""
    from .bench import add_peers_arguments

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerosim.bench.peers_rank",
        description="Time one optimizer step under each adapter (one process per rank; rank 0 reports).",
    )
    add_peers_arguments(p)
    # not --start: torchrun would take it for an abbreviation of its own --start-method
    p.add_argument("--from-position", default="0",
                   help="skip the runs before this position of the (round, adapter) order")
    p.add_argument("--skip", default="", help="comma-separated adapters left out (they failed before)")
    p.add_argument("--seed", default="0")
    p.add_argument("--results", default=None,
                   help="rank 0 appends one JSON line per adapter here and writes no report "
                   "(how zerosim bench peers runs it)")
    return p


def peers_rank_run(args: argparse.Namespace) -> PeersRun:
    """The :class:`~zerosim.bench.peers_run.PeersRun` the options of :func:`peers_rank_parser` describe
    (ConfigError naming the first bad one; the timings it sets up serve no contract, they compare
    trainers)."""
    from ..values.dtypes import canonical_dtype

    run = PeersRun(
        models=tuple(peers.select_models(args.models)),
        adapters=tuple(peers.select_adapters(args.adapters)),
        steps=peers.parse_int("steps", args.steps),
        warmup=peers.parse_int("warmup", args.warmup),
        rounds=peers.parse_int("rounds", args.rounds),
        min_time_s=peers.parse_seconds("min_time", args.min_time, allow_zero=True),
        dtype=canonical_dtype(args.dtype, "dtype", allowed=peers.DTYPES),
        device=args.device,
        optimizer=args.optimizer,
        seed=peers.parse_int("seed", args.seed),
        timeout_s=peers.parse_seconds("timeout", args.timeout),
        from_position=peers.parse_int("from_position", args.from_position),
        skip=tuple(name for name in args.skip.split(",") if name),
        out=args.out,
        results=args.results,
    )
    run.validate()
    return run
