"""The options that describe one training run, shared by every way of starting one.

``zerosim simulate`` (in process), ``mpiexec -n N python -m zerosim.mpi simulate`` and
``torchrun --nproc-per-node N -m zerogpu simulate`` accept the same run options;
:func:`add_run_arguments` declares them and :func:`config_from_args` turns them into the
:class:`~zerosim.engine.config.RunConfig` (bad input: a ConfigError naming the field). The rank
commands' own options (``--timeout-mode``; ``--device``, ``--dist-backend``, ...) and the
:class:`~zerosim.engine.run_file.RankRun` they describe are here too (:func:`mpi_simulate_parser`,
:func:`torch_simulate_parser`): a rank started with options parses them here, once; a rank started
with ``--config FILE`` parses nothing.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..comm.sim import SCHEDULES
from ..engine.config import XP_NAMES, RunConfig
from ..engine.fault_catalog import FAULTS
from ..engine.run_file import BACKEND_OPTIONS, RankRun
from ..errors import ConfigError
from ..numerics.precision import PRECISION_NAMES
from ..values.dtypes import precision_name
from ..values.presets import simulator_presets

STRATEGY_HELP = ("no_shard|ddp|zero1|zero2|zero3|full_shard|shard_grad_op|hybrid_shard[:K]|"
                 "hybrid_shard_zero2[:K] (default full_shard)")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by ``zerosim simulate``, ``python -m zerosim.mpi simulate`` and
    ``python -m zerogpu simulate``."""
    g = p.add_argument_group("run")
    g.add_argument(
        "--model", default="tiny", metavar="PRESET",
        help=f"block-model preset (default tiny): {', '.join(simulator_presets())}",
    )
    g.add_argument("--world-size", "--world", dest="world_size", type=int, default=4, metavar="N",
                   help="number of ranks (default 4)")
    g.add_argument("--strategy", default="full_shard", metavar="S", help=STRATEGY_HELP)
    g.add_argument("--partitioner", default="fsdp", metavar="P",
                   help="how shards are cut (default fsdp): fsdp, deepspeed, deepspeed-zero3, seed, "
                        "zero-redundancy, round-robin, contiguous")
    g.add_argument(
        "--optimizer", default="adamw", metavar="O",
        help="sgd (momentum 0.9) | adam | adamw (default) | muon (torch's recipe: Muon on 2-D tensors, "
             "AdamW on the others) | adafactor; muon and adafactor are not elementwise: each tensor is "
             "stepped whole by one owner rank (the default partitioner fsdp becomes zero-redundancy; "
             "round-robin and contiguous also keep tensors whole)")
    g.add_argument("--matrix-layout", default=None, choices=("whole-tensor", "flat-slices"),
                   help="muon / adafactor: whole tensors per owner (default), or flat-slices, the "
                        "deliberately wrong layout (each rank steps its slices as if they were tensors: "
                        "C-ZERO-002 fails)")
    g.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3; adafactor 1e-2)")
    g.add_argument("--max-grad-norm", default="1.0", metavar="X",
                   help="global-norm clipping threshold, or 'none' (default 1.0)")
    g.add_argument("--steps", type=int, default=3, metavar="K", help="optimizer steps (default 3)")
    g.add_argument(
        "--micro-batches", type=int, default=1, metavar="M", help="gradient accumulation steps (default 1)"
    )
    g.add_argument("--precision", default="fp32", metavar="{fp32,bf16,fp16}",
                   help="fp32 (default), bf16 or fp16; float32, bfloat16 and float16 spell the same")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="ranks per node (topology; the hybrid shard group size by default)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--batch-size", type=int, default=None, help="sequences per micro-batch per rank (default 2)"
    )
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the preset's)")
    g.add_argument("--prefetch", type=int, default=0, help="ZeRO-3: blocks gathered ahead of use (default 0)")
    g.add_argument("--offload", action="store_true", help="ZeRO-3: keep master + optimizer state on the host")
    g.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="collective timeout: a rank that never arrives fails the run (default 60)")
    g.add_argument("--schedule", default="serial", choices=SCHEDULES,
                   help="simulator: one rank at a time (default) or all threads at once")
    g.add_argument("--observe", default="auto", choices=("auto", "full", "digest"),
                   help="keep shard values for C-ZERO-002 (full), digests only, or full when small (auto)")
    g.add_argument("--fault", default=None, metavar="NAME",
                   help="run a deliberately broken variant (shows what the contracts catch; `zerosim "
                        "mutants` runs them all): " + ", ".join(sorted(FAULTS)))
    g.add_argument("--load", default="seed", choices=("seed", "broadcast"),
                   help="initial weights built on every rank from the seed (default), or on rank 0 only "
                        "and broadcast tensor by tensor, each rank keeping its shard")
    g.add_argument("--reshard-at", type=int, default=None, metavar="STEP",
                   help="after STEP, save the full state dict and load it back (a state-dict round trip)")
    g.add_argument("--inject-nan", default=None, metavar="RANK:STEP:TENSOR",
                   help="test hook: a NaN in TENSOR's gradient on RANK at STEP (e.g. 1:0:blocks.0.mlp.w_in)")
    g.add_argument(
        "--zero1-reduce",
        default="all_reduce",
        metavar="{all_reduce,reduce_scatter}",
        help="ZeRO-1 gradient averaging: all_reduce of the full gradient (torch ZeroRedundancyOptimizer, "
        "default) or reduce_scatter into the rank's shard (DeepSpeed stage 1, the paper's "
        "2(N-1)/N Psi); other strategies ignore it",
    )
    g.add_argument("--backend", default="sim", choices=("sim", "mpi", "torch"),
                   help="sim: N threads in this process (default); mpi: mpiexec -n N processes; "
                        "torch: torchrun --nproc-per-node N processes (gloo on CPU, NCCL on GPU)")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")


def _parse_max_norm(text: Any) -> float | None:
    if text is None or str(text).strip().lower() in ("none", "off", "0"):
        return None
    try:
        v = float(text)
    except ValueError:
        raise ConfigError("max_grad_norm", text, "must be a positive number or 'none'") from None
    if not v > 0:
        raise ConfigError("max_grad_norm", text, "must be a positive number or 'none'")
    return v


def _parse_injection(text: str | None) -> dict[str, Any] | None:
    if text is None:
        return None
    parts = str(text).split(":", 2)
    if len(parts) != 3:
        raise ConfigError("inject_nan", text, "expected RANK:STEP:TENSOR, e.g. 1:0:blocks.0.mlp.w_in")
    try:
        return {"rank": int(parts[0]), "step": int(parts[1]), "tensor": parts[2]}
    except ValueError:
        raise ConfigError("inject_nan", text, "RANK and STEP must be integers") from None


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The RunConfig the options describe (validate() it before running)."""
    return RunConfig(
        model=args.model,
        world_size=args.world_size,
        strategy=args.strategy,
        partitioner=args.partitioner,
        optimizer=args.optimizer,
        precision=precision_name(args.precision, "precision", PRECISION_NAMES),
        steps=args.steps,
        micro_batches=args.micro_batches,
        seed=args.seed,
        ranks_per_node=args.ranks_per_node,
        lr=args.lr,
        max_grad_norm=_parse_max_norm(args.max_grad_norm),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        offload=bool(args.offload),
        prefetch=args.prefetch,
        timeout_s=args.timeout,
        schedule=args.schedule,
        observe=args.observe,
        inject_nan=_parse_injection(args.inject_nan),
        fault=args.fault,
        load=getattr(args, "load", "seed"),
        reshard_at=getattr(args, "reshard_at", None),
        zero1_grad_reduce=getattr(args, "zero1_reduce", "all_reduce"),
        extra={} if getattr(args, "matrix_layout", None) is None else {"matrix_layout": args.matrix_layout},
    )


# ---- the rank commands' options -----------------------------------------------------------------------

def mpi_simulate_parser() -> argparse.ArgumentParser:
    """``mpiexec -n N python -m zerosim.mpi simulate [options]``: the run options plus MPI's."""
    parser = argparse.ArgumentParser(
        prog="mpiexec -n N python -m zerosim.mpi simulate",
        description="Run the reference engine under MPI; rank 0 prints the verdicts. "
        "(--config FILE instead of options: the run file zerosim simulate --write-config wrote.)",
    )
    add_run_arguments(parser)
    parser.set_defaults(world_size=None)  # default: the number of ranks mpiexec started
    mpi = parser.add_argument_group("MPI")
    mpi.add_argument("--timeout-mode", choices=BACKEND_OPTIONS["mpi"]["timeout_mode"],
                     default=os.environ.get("ZEROSIM_MPI_TIMEOUT_MODE", "abort"),
                     help="abort: blocking collectives + watchdog that aborts the job (fast, default); "
                          "raise: polled nonblocking collectives that raise CollectiveTimeout")
    mpi.add_argument("--save-observations", type=Path, default=None, metavar="PATH",
                     help="rank 0 writes every rank's observations to PATH as plain data "
                          "(to compare backends)")
    return parser


def mpi_rank_run(args: argparse.Namespace, world_size: int) -> RankRun:
    """The run the MPI rank options describe; ``--world-size`` defaults to the ranks mpiexec started."""
    if args.world_size is None:
        args.world_size = world_size
    return RankRun(config_from_args(args), "mpi", bool(args.json), _path(args.save_observations),
                   {"timeout_mode": args.timeout_mode})


def add_torch_arguments(p: argparse.ArgumentParser) -> None:
    """The torch-only options (shared by ``simulate`` and ``equivalence``)."""
    choices = BACKEND_OPTIONS["torch"]
    g = p.add_argument_group("torch.distributed")
    g.add_argument(
        "--device",
        default="auto",
        help="auto (cuda:<LOCAL_RANK> if CUDA is available, else cpu), cpu, cuda, cuda:N",
    )
    g.add_argument("--dist-backend", default="auto", choices=choices["dist_backend"],
                   help="auto: nccl for CUDA, gloo for the CPU")
    g.add_argument("--xp", default="torch", choices=XP_NAMES,
                   help="the engine's arrays: torch tensors on the device (default) or host numpy")
    g.add_argument("--reduce-scatter", default="auto", choices=choices["reduce_scatter"],
                   help="auto: one reduce per chunk on gloo, the backend's own on NCCL (all-reduce + slice "
                        "where it has none)")
    g.add_argument("--all-gather", default="auto", choices=choices["all_gather"],
                   help="auto: one broadcast per chunk on gloo, the backend's own on NCCL")


def torch_options(args: argparse.Namespace) -> dict[str, str]:
    """The torch rank settings the options name (:data:`zerosim.engine.run_file.BACKEND_OPTIONS`)."""
    return {"device": args.device, "dist_backend": args.dist_backend, "reduce_scatter": args.reduce_scatter,
            "all_gather": args.all_gather}


def torch_simulate_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerogpu simulate [options]``: the run options plus torch's."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerogpu simulate",
        description="Run the reference engine under torchrun; rank 0 prints the verdicts. "
        "(--config FILE instead of options: the run file zerosim simulate --write-config wrote.)",
    )
    add_run_arguments(p)
    p.set_defaults(world_size=None, backend=None)  # world size: the number of ranks torchrun started
    add_torch_arguments(p)
    p.add_argument("--save-observations", type=Path, default=None, metavar="PATH",
                   help="rank 0 writes every rank's observations to PATH as plain data (to compare backends)")
    return p


def torch_rank_run(args: argparse.Namespace) -> RankRun:
    """The run the torchrun rank options describe; ``--world-size`` defaults to the ranks torchrun started
    (outside torchrun, or a different value: ConfigError)."""
    from zerogpu.program import require_launcher

    if args.backend not in (None, "torch"):
        raise ConfigError("backend", args.backend, "under torchrun the backend is torch; drop --backend")
    args.world_size = require_launcher(args.world_size)
    cfg = config_from_args(args).replace(xp=args.xp)
    return RankRun(cfg, "torch", bool(args.json), _path(getattr(args, "save_observations", None)),
                   torch_options(args))


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)


def equivalence_parser() -> argparse.ArgumentParser:
    """``torchrun --nproc-per-node N -m zerogpu equivalence [options]``: the run and torch options, plus
    the strategies to run and where rank 0 writes the JSON document."""
    p = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m zerogpu equivalence",
        description="Every strategy under torchrun: contract verdicts, error vs ground "
        "truth, agreement with the in-process simulator.",
    )
    add_run_arguments(p)
    p.set_defaults(world_size=None, backend=None, steps=2, micro_batches=2, observe="full")
    p.add_argument("--strategies", default="all", metavar="LIST",
                   help="comma-separated strategies, or 'all' (default)")
    add_torch_arguments(p)
    p.add_argument(
        "--out", type=Path, default=None, metavar="FILE", help="rank 0 writes the JSON document here"
    )
    return p
