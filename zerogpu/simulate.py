"""``torchrun --nproc-per-node N -m zerogpu simulate [options]``: the reference engine, one process per rank.

Every rank parses the options of ``zerosim simulate`` (:func:`zerosim.cli.simulate.add_run_arguments`)
plus the torch ones below, runs the engine's SPMD program on a :class:`zerogpu.comm.TorchCommunicator`
(NCCL on ``cuda:<LOCAL_RANK>``, gloo on the CPU) and sends its observations to rank 0, which checks
C-ZERO-002..005 and prints the same verdict table / JSON as the in-process simulator. Exit status,
the same on every rank: 0 every contract holds, 1 a contract failed, 2 bad input (printed once, by
rank 0, before any process group exists), 3 a rank failed or a collective timed out (``rank R
failed: ...`` printed once; torchrun then stops the other ranks). torchrun's own exit status is 1
for any non-zero worker; ``zerosim simulate --backend torch`` (:mod:`zerogpu.launch`) recovers ours.

Torch options: ``--device auto|cpu|cuda[:N]``, ``--dist-backend auto|gloo|nccl``, ``--xp torch|numpy``
(the engine's arrays: torch tensors on the device, default; or host numpy with only the collectives
on the device), ``--reduce-scatter auto|native|reduce|all_reduce``, ``--all-gather
auto|native|broadcast`` (how those two collectives travel: :mod:`zerogpu.comm`) and
``--save-observations PATH``.
``--world-size`` defaults to the number of ranks torchrun started; ``--timeout`` is the
``init_process_group`` timeout and every collective's.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from zerosim import datafile
from zerosim.engine.config import XP_NAMES
from zerosim.errors import ConfigError, ZeroSimError

# zerogpu.comm's choices, repeated so that parsing (and refusing bad input) does not import torch
DIST_BACKENDS = ("auto", "gloo", "nccl")
REDUCE_SCATTER_MODES = ("auto", "native", "reduce", "all_reduce")
ALL_GATHER_MODES = ("auto", "native", "broadcast")


def add_torch_arguments(p: argparse.ArgumentParser) -> None:
    """The torch-only options (shared by ``simulate`` and ``equivalence``)."""
    g = p.add_argument_group("torch.distributed")
    g.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:<LOCAL_RANK> if CUDA is available, else cpu), cpu, cuda, cuda:N",
    )
    g.add_argument("--dist-backend", default="auto", choices=DIST_BACKENDS,
                   help="auto: nccl for CUDA, gloo for the CPU")
    g.add_argument("--xp", default="torch", choices=XP_NAMES,
                   help="the engine's arrays: torch tensors on the device (default) or host numpy")
    g.add_argument("--reduce-scatter", default="auto", choices=REDUCE_SCATTER_MODES,
                   help="auto: one reduce per chunk on gloo, the backend's own on NCCL (all-reduce + slice "
                        "where it has none)")
    g.add_argument("--all-gather", default="auto", choices=ALL_GATHER_MODES,
                   help="auto: one broadcast per chunk on gloo, the backend's own on NCCL")


def build_parser() -> argparse.ArgumentParser:
    from zerosim.engine.run_args import add_run_arguments

    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerogpu simulate",
        description="Run the reference engine under torchrun; rank 0 prints the verdicts.",
    )
    add_run_arguments(p)
    p.set_defaults(world_size=None, backend=None)  # world size: the number of ranks torchrun started
    add_torch_arguments(p)
    p.add_argument("--save-observations", type=Path, default=None, metavar="PATH",
                   help="rank 0 stores every rank's RankObservation list in PATH (zerosim.datafile; "
                   "for comparing backends)")
    return p


def resolve_setup(args: argparse.Namespace) -> tuple[Any, str, str]:
    """(validated RunConfig, device, dist backend) from the options; ConfigError on bad input.
    Deterministic, so every rank reaches the same verdict without talking to the others."""
    from zerosim.engine.run_args import config_from_args

    from .program import require_launcher

    if args.backend not in (None, "torch"):
        raise ConfigError("backend", args.backend, "under torchrun the backend is torch; drop --backend")
    args.world_size = require_launcher(args.world_size)
    from .comm import resolve_backend, resolve_device  # imports torch: only once we know we are a rank

    cfg = config_from_args(args).replace(xp=args.xp)
    cfg.validate()
    device = resolve_device(args.device)
    return cfg, device, resolve_backend(args.dist_backend, device)


def main(argv: list[str]) -> NoReturn:
    from .rank import fail_on_bad_input, parse_once, run_rank

    args = parse_once(build_parser(), argv)
    try:
        cfg, device, backend = resolve_setup(args)
    except ZeroSimError as e:
        fail_on_bad_input(e)

    def body() -> int:
        from zerosim.engine.run_output import render
        from zerosim.engine.run_result import evaluate

        from .comm import init_distributed
        from .program import agree_on_exit, exact_float32_math, gather_observations, rank_program_on_device

        exact_float32_math(device)
        comm = init_distributed(backend, device, cfg.timeout_s, reduce_scatter=args.reduce_scatter,
                                all_gather=args.all_gather)
        run = cfg.resolve()
        observations = gather_observations(comm, rank_program_on_device(comm, run))
        code = None
        if comm.rank == 0:
            assert observations is not None
            if args.save_observations is not None:
                datafile.save(args.save_observations, observations)
            code = render(evaluate(run, observations), args.json)
        return agree_on_exit(comm, code)

    run_rank(body)
