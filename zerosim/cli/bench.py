"""``zerosim bench <what>``: benchmarks that print ratios measured side by side and write JSON into a new
reports/bench-<what>-<timestamp>/ folder (or ``--out``).

Every benchmark's options are declared here (``register_<what>``); the work is
``zerosim.bench.<what>.run(args)``, a function of the parsed values.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..bench import check as bench_check
from ..bench import host_adam as bench_host_adam
from ..bench import monitor as bench_monitor
from ..bench import mpi as bench_mpi
from ..bench import offload as bench_offload
from ..bench import peers as bench_peers
from ..bench import peers_report
from ..bench import scale as bench_scale
from ..bench import sim as bench_sim
from ..comm.sim import SCHEDULES

BENCH_MODULES = ("sim", "mpi", "check", "peers", "scale", "offload", "host_adam", "monitor")


def register(sub: Any) -> None:
    p = sub.add_parser("bench",
                       help="benchmarks (ratios measured side by side, JSON into a new reports/ folder)")
    inner = p.add_subparsers(dest="bench", metavar="BENCH")
    for name in BENCH_MODULES:
        globals()[f"register_{name}"](inner)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def register_sim(sub: Any) -> None:
    """``zerosim bench sim``: its options; the work is :func:`zerosim.bench.sim.run`."""
    p = sub.add_parser(
        "sim", help="simulated ZeRO-3 step vs one unsharded numpy step; peak memory vs per-rank state"
    )
    p.add_argument("--model", default="sim-10m", help="model preset (default sim-10m, ~13M parameters)")
    p.add_argument("--world-sizes", default="8,32", help="comma-separated rank counts (default 8,32)")
    p.add_argument("--strategy", default="full_shard", help="strategy (default full_shard = ZeRO-3)")
    p.add_argument("--partitioner", default="fsdp", help="partitioner (default fsdp)")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument(
        "--repeats", type=int, default=3, help="timed steps of each side after a warm-up (default 3)"
    )
    p.add_argument("--schedule", default="serial", choices=SCHEDULES)
    p.add_argument("--out", default=None,
                   help=f"JSON report (default {bench_sim.DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print the JSON report instead of a table")
    p.set_defaults(func=bench_sim.run)


def register_mpi(sub: Any) -> None:
    """``zerosim bench mpi``: its options; the work is :func:`zerosim.bench.mpi.run`."""
    p = sub.add_parser("mpi", help="MPI communicator vs raw mpi4py collectives (launches mpiexec)",
                       description=bench_mpi.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--ranks", type=int, nargs="+", default=[2, 4], help="world sizes to launch (default: 2 4)"
    )
    p.add_argument("--min-bytes", type=int, default=1024, help="smallest buffer (default 1 KiB)")
    p.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024, help="largest buffer (default 64 MiB)")
    p.add_argument(
        "--repeats", type=int, default=7, help="measurements per variant (median taken; default 7)"
    )
    p.add_argument(
        "--target-ms", type=float, default=20.0, help="time filled by one measurement (default 20 ms)"
    )
    p.add_argument(
        "--launch-timeout", type=float, default=900.0, help="wall-clock limit per mpiexec launch (s)"
    )
    p.add_argument("--out", type=Path, default=None,
                   help=f"JSON report (default {bench_mpi.DEFAULT_OUT})")
    p.set_defaults(func=bench_mpi.run)


def register_check(sub: Any) -> None:
    """``zerosim bench check``: its options; the work is :func:`zerosim.bench.check.run`."""
    p = sub.add_parser(
        "check", help="C-ZERO-001 interval check at 10^12 x 1024 vs a flag-per-parameter checker"
    )
    p.add_argument("--total", default="10**12", help="parameters in the big plan (default 10**12)")
    p.add_argument("--world-size", "--world", dest="world_size",
                   type=int, default=1024, help="ranks in the big plan (default 1024)")
    p.add_argument("--repeats", type=int, default=50, help="timed repetitions of the big check (default 50)")
    p.add_argument("--flag-sizes", default="10**5,10**6,10**7,10**8",
                   help="totals at which both checkers run side by side (default 10**5..10**8)")
    p.add_argument("--out", default=None,
                   help=f"JSON report path (default {bench_check.DEFAULT_OUT})")
    p.set_defaults(func=bench_check.run)


def add_peers_arguments(p: Any) -> None:
    """The options of one peers benchmark, declared once: ``zerosim bench peers`` and its ranks started
    by hand (``torchrun ... -m zerosim.bench.peers_rank``,
    :func:`zerosim.cli.rank_commands.peers_rank_parser`) both take them. Values stay text; each side
    converts them with :mod:`zerosim.bench.peers_run`'s parsers, so a bad one is one line naming the
    field."""
    p.add_argument("--models", default=",".join(bench_peers.DEFAULT_MODELS),
                   help=f"verify model presets (default {','.join(bench_peers.DEFAULT_MODELS)})")
    p.add_argument("--adapters", default=None,
                   help="comma-separated built-in adapters or MODULE:FACTORY (default: every installed one)")
    p.add_argument("--steps", default=str(bench_peers.DEFAULT_STEPS),
                   help=f"timed steps per adapter (default {bench_peers.DEFAULT_STEPS})")
    p.add_argument("--warmup", default=str(bench_peers.DEFAULT_WARMUP),
                   help=f"untimed steps first (default {bench_peers.DEFAULT_WARMUP})")
    p.add_argument("--rounds", default=str(bench_peers.DEFAULT_ROUNDS),
                   help="times every adapter is built and timed, the order reversed each round "
                   f"(default {bench_peers.DEFAULT_ROUNDS})")
    p.add_argument("--min-time", default=str(bench_peers.DEFAULT_MIN_TIME_S),
                   help="per adapter and round, time more steps until they add up to about this many "
                   f"seconds (at most {bench_peers.MAX_TIMED_STEPS}; 0: exactly --steps; "
                   f"default {bench_peers.DEFAULT_MIN_TIME_S:g})")
    p.add_argument("--dtype", default="float32", help="float32 / fp32 (default) or float64 / fp64")
    p.add_argument("--device", default="cpu", help="cpu (gloo, default) or cuda (NCCL, one rank per GPU)")
    p.add_argument("--optimizer", default="adamw", help="adamw (default) or sgd (momentum 0.9)")
    p.add_argument("--timeout", default=str(bench_peers.DEFAULT_TIMEOUT_S),
                   help="seconds a trainer construction, step or collective may take "
                   f"(default {bench_peers.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--out", default=None,
                   help=f"directory for {peers_report.JSON_NAME} and {peers_report.MD_NAME} "
                   f"(default {bench_peers.DEFAULT_OUT})")


def register_peers(sub: Any) -> None:
    """``zerosim bench peers``: its options; the work is :func:`zerosim.bench.peers.run`."""
    p = sub.add_parser(
        "peers",
        help="one optimizer step under every installed adapter (ddp, torch-zero, fsdp2*, deepspeed-*, "
        "zerogpu-*), ratios per ZeRO stage (launches torchrun)",
        description=bench_peers.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_peers_arguments(p)
    p.add_argument("--world", "--world-size", dest="world", default=None,
                   help="ranks (default 2 on the CPU, one per GPU with --device cuda)")
    p.set_defaults(func=bench_peers.run)


def register_scale(sub: Any) -> None:
    """``zerosim bench scale``: its options; the work is :func:`zerosim.bench.scale.run`."""
    p = sub.add_parser("scale", help="time and peak memory of simulate, plan and C-ZERO-001 vs ranks; "
                                     "fitted growth exponents")
    p.add_argument("--sim-world-sizes", default=bench_scale.DEFAULT_SIM_WORLD_SIZES,
                   help=f"ranks of the simulate series (default {bench_scale.DEFAULT_SIM_WORLD_SIZES})")
    p.add_argument("--plan-exponents", default=bench_scale.DEFAULT_PLAN_EXPONENTS,
                   help="k of the plan and check series' 2^k ranks, with 10^(12 + 0.3 (k - 10)) parameters "
                        f"(default {bench_scale.DEFAULT_PLAN_EXPONENTS}: 10^12 x 2^10 .. 10^15 x 2^20)")
    p.add_argument("--series", default=",".join(bench_scale.SERIES),
                   help=f"which series (default {','.join(bench_scale.SERIES)})")
    p.add_argument("--timeout", type=int, default=600,
                   help="seconds per point before it is stopped (default 600)")
    p.add_argument("--source", default=None, metavar="DIR",
                   help="run the points against the zerosim package in DIR (e.g. a worktree of an older "
                        "commit)")
    p.add_argument("--label", default=None, help="name of this run in the report (default: after, or before "
                                                 "with --source)")
    p.add_argument("--before", default=None, metavar="FILE",
                   help="an earlier bench_scale JSON whose series are shown beside this run's")
    p.add_argument("--out", default=None,
                   help=f"JSON report (default {bench_scale.DEFAULT_OUT}); the PNG beside it")
    p.set_defaults(func=bench_scale.run)


def register_offload(sub: Any) -> None:
    """``zerosim bench offload``: its options; the work is :func:`zerosim.bench.offload.run`."""
    p = sub.add_parser("offload", help="ZeRO-3 with and without CPU offload: step time, device peak, budget")
    p.add_argument("--model", default="gpt", help="a zerosim verify model preset (default gpt)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per trainer (default 6)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--budget-units", type=int, default=2,
                   help="device budget = the shards of this many largest units (default 2)")
    p.add_argument("--prefetch", type=int, default=1, help="offload prefetch depth (default 1)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--out", default=None,
                   help=f"JSON report (default {bench_offload.DEFAULT_OUT})")
    p.set_defaults(func=bench_offload.run)


def register_host_adam(sub: Any) -> None:
    """``zerosim bench host-adam``: its options; the work is :func:`zerosim.bench.host_adam.run`."""
    p = sub.add_parser("host-adam", help="the offload host tier's AdamW kernels on one flat shard against "
                                         "torch.optim.AdamW (for-loop, foreach) and zerosim's reference",
                       description=bench_host_adam.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=bench_host_adam.DEFAULT_ELEMENTS,
                   help=f"float32 elements of the shard (default {bench_host_adam.DEFAULT_ELEMENTS:,}: "
                        "gpt-50m's parameters)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, every kernel once each (default 7)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's own)")
    p.add_argument("--out", default=None, help=f"JSON report (default {bench_host_adam.DEFAULT_OUT})")
    p.set_defaults(func=bench_host_adam.run)


def register_monitor(sub: Any) -> None:
    """``zerosim bench monitor``: its options; the work is :func:`zerosim.bench.monitor.run`."""
    p = sub.add_parser("monitor", help="step time with and without zerosim.monitor (every=1, every=100, "
                                       "with and without the step checks), per adapter, and the digest's "
                                       "throughput (launches torchrun)",
                       description=bench_monitor.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", default=bench_monitor.DEFAULT_ADAPTERS,
                   help="comma-separated: ddp, zero-redundancy, fsdp2, zerogpu-zero3, deepspeed-1, "
                        "deepspeed-2, deepspeed-3 (default all; the deepspeed ones skipped, with the reason, "
                        "where DeepSpeed is not installed; '' times no training)")
    p.add_argument("--world", "--world-size", dest="world", default="2", help="ranks (default 2)")
    p.add_argument("--variants", default=",".join(v for v in bench_monitor.VARIANTS if v != "off"),
                   help="comma-separated monitored variants, each timed between runs without the monitor: "
                        "every=100, every=1 (without the step checks), every=100+step-checks, "
                        "every=1+step-checks (grad_accounting, update and replay at every check); "
                        "default all")
    p.add_argument("--steps", default="120",
                   help="timed steps per run (default 120: every=100 checks at 0 and 100)")
    p.add_argument("--warmup", default="5", help="untimed steps first (default 5)")
    p.add_argument("--rounds", default="2", help="rounds of every run, order alternating (default 2)")
    p.add_argument("--width", default=str(bench_monitor.DEFAULT_WIDTH),
                   help=f"hidden width of the model (default {bench_monitor.DEFAULT_WIDTH})")
    p.add_argument("--depth", default=str(bench_monitor.DEFAULT_DEPTH),
                   help=f"hidden layers of the model (default {bench_monitor.DEFAULT_DEPTH})")
    p.add_argument("--batch", default=str(bench_monitor.DEFAULT_BATCH),
                   help=f"rows per rank and step (default {bench_monitor.DEFAULT_BATCH}: a step of tens of "
                        "ms on an idle core; a check's cost is mostly fixed, so tiny steps overstate it)")
    p.add_argument("--digest-mb", default="64",
                   help="MB digested and copied for the throughput (default 64; 0 skips it)")
    p.add_argument("--device", default="cpu",
                   help="cpu (gloo, default) or cuda (one GPU per rank over NCCL; ranks beyond the GPUs "
                        "share them over gloo); the digest is timed there too")
    p.add_argument("--layout-world", default="1024",
                   help="ranks of the C-ZERO-001 layout check timed on a Llama-like 70B model "
                        "(default 1024; 0 skips it)")
    p.add_argument("--timeout", default="600", help="seconds the launch may take (default 600)")
    p.add_argument("--trace", action="store_true",
                   help="monitored runs write their observation files, each judged again offline as "
                        "'zerosim check trace' judges it, beside the live verdict (slows the checks)")
    p.add_argument("--out", default=None, help=f"directory for {bench_monitor.JSON_NAME} "
                   f"(default {bench_monitor.DEFAULT_OUT})")
    p.set_defaults(func=bench_monitor.run)
