"""``zerosim report``: PNG figures, their JSON and an index.md, model vs measured, under reports/.

With no arguments: the ZeRO paper's 7.5B at N_d = 64 (modelled) and the simulator's ``tiny`` model
at world sizes 1, 2, 4, 8 (measured; MPI and torch.distributed at 2 ranks when they work) into
``reports/report-YYYYmmdd-HHMMSS/``. Takes well under a minute on two cores.
"""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from ..cost.shard_sizes import parse_param_count
from ..errors import ConfigError
from ..files.outputs import require_output_dir
from ..report.config import check_measured_world_sizes
from ..values.presets import PRESETS, require_simulator_preset, simulator_presets
from .memory import positive_int


def register(sub) -> None:
    p = sub.add_parser("report", help="figures + JSON + index.md: memory and traffic, model vs measured",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="output folder (default reports/report-<timestamp>)")
    p.add_argument("--model", default="tiny",
                   help=f"the simulator preset measured (default tiny): {', '.join(simulator_presets())}")
    p.add_argument(
        "--world-sizes", default="1,2,4,8", help="measured world sizes, comma-separated (default 1,2,4,8)"
    )
    p.add_argument(
        "--ranks-per-node", default="2", help="ranks per node of the measured runs (hybrid group size)"
    )
    p.add_argument("--steps", default="3", help="optimizer steps per measured run (default 3)")
    p.add_argument(
        "--precision", default="fp32", help="engine precision of the measured runs: fp32, bf16, fp16"
    )
    p.add_argument("--optimizer", default="adamw", help="engine optimizer: adamw, adam, sgd")
    p.add_argument("--partitioner", default="fsdp", help="engine partitioner (default fsdp)")
    p.add_argument("--large-params", default="7.5e9", help="parameters of the modelled model (default 7.5e9)")
    p.add_argument(
        "--large-model", default="gpt-7.5b", help="preset for the DeepSpeed comparison (default gpt-7.5b)"
    )
    p.add_argument("--large-world-size", default="64", help="N_d of the modelled figures (default 64)")
    p.add_argument(
        "--large-ranks-per-node", default="8", help="ranks per node of the modelled figures (default 8)"
    )
    p.add_argument("--no-mpi", action="store_true", help="skip the mpiexec measurements")
    p.add_argument(
        "--no-torch", action="store_true", help="skip the torchrun (torch.distributed, gloo) measurements"
    )
    p.add_argument("--no-deepspeed", action="store_true", help="do not call the real DeepSpeed estimator")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _world_sizes(text: str) -> tuple[int, ...]:
    items = [t for t in str(text).split(",") if t.strip()]
    if not items:
        raise ConfigError("world-sizes", text, "must list at least one positive integer")
    sizes = tuple(sorted({positive_int("world-sizes", t) for t in items}))
    check_measured_world_sizes(sizes, "world-sizes")
    return sizes


def config_from_args(args):
    from ..engine.config import RunConfig
    from ..report.config import ReportConfig

    if args.model not in PRESETS:
        raise ConfigError("model", args.model, f"unknown preset; known: {', '.join(PRESETS)}")
    require_simulator_preset(args.model)  # the measured runs simulate it: a block model only
    if args.large_model not in PRESETS:
        raise ConfigError("large-model", args.large_model, f"unknown preset; known: {', '.join(PRESETS)}")
    world_sizes = _world_sizes(args.world_sizes)
    rpn = positive_int("ranks-per-node", args.ranks_per_node)
    uneven = [w for w in world_sizes if w > rpn and w % rpn]
    if uneven:  # a world size up to rpn is one node; above it, nodes must be whole
        raise ConfigError("ranks-per-node", rpn, f"must divide every world size above it (not {uneven[0]})")
    large_ws = positive_int("large-world-size", args.large_world_size)
    large_rpn = positive_int("large-ranks-per-node", args.large_ranks_per_node)
    if large_ws % large_rpn:
        raise ConfigError("large-ranks-per-node", large_rpn, f"must divide large-world-size={large_ws}")
    offload_ws = next((w for w in world_sizes if w >= 4), max(world_sizes))
    cfg = ReportConfig(
        large_params=parse_param_count(args.large_params, "large-params"),
        large_model=args.large_model,
        large_world_size=large_ws,
        large_ranks_per_node=large_rpn,
        sim_model=args.model,
        world_sizes=world_sizes,
        ranks_per_node=rpn,
        steps=positive_int("steps", args.steps),
        precision=args.precision,
        optimizer=args.optimizer,
        partitioner=args.partitioner,
        offload_world_size=offload_ws,
        mpi=not args.no_mpi,
        torch=not args.no_torch,
        deepspeed=not args.no_deepspeed,
    )
    # validate the engine options once, before anything runs (names the bad field)
    RunConfig(
        model=cfg.sim_model,
        world_size=max(world_sizes),
        strategy="full_shard",
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        partitioner=cfg.partitioner,
        steps=cfg.steps,
    ).validate()
    return cfg


def run(args) -> int:
    from ..report.build import build_report

    cfg = config_from_args(args)
    out = (
        Path(args.out)
        if args.out
        else Path("reports") / f"report-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    )
    require_output_dir(out)
    result = build_report(out, cfg, progress=not args.quiet)
    print_contract_summary(result.contracts)
    print(f"wrote {out / 'index.md'} ({len(result.figures)} figures) in {result.timings['total_s']:.1f} s")
    for note in result.notes:
        print(f"note: {note}")
    return 0 if result.passed else 1


def print_contract_summary(rows: list[dict]) -> None:
    """One line per backend: how many measured runs held every step contract; each failure on its own line."""
    by_backend: dict[str, list[dict]] = {}
    for r in rows:
        by_backend.setdefault(r["backend"], []).append(r)
    for backend, group in by_backend.items():
        ok = sum(r["passed"] for r in group)
        sizes = sorted({r["world_size"] for r in group})
        print(f"{backend}: C-ZERO-002..005 hold on {ok}/{len(group)} runs "
              f"(world sizes {', '.join(map(str, sizes))}; {len({r['strategy'] for r in group})} strategies)")
        for r in group:
            for c, v in r["verdicts"].items():
                if not v["passed"]:
                    print(f"  FAIL {c} {backend} world {r['world_size']} {r['strategy']}: {v['first']}")
