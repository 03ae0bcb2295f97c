"""``zerosim memory``: per-rank model-state memory from the closed-form model (C-ZERO-004's expectation).

Examples::

    zerosim memory --params 7.5e9 --world-size 64 --strategy all          # the ZeRO paper's table
    zerosim memory --model gpt2-small --world-size 16 --ranks-per-node 8 --strategy hybrid_shard --json
    zerosim memory --params 1e12 --world-size 1024 --strategy all --offload optimizer --unit GiB
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..cost.memory_model import MemoryEstimate, all_strategies, memory_per_rank
from ..cost.memory_settings import OFFLOAD_CHOICES, OPTIMIZER_STATES, PRECISIONS, MemorySettings
from ..cost.shard_sizes import parse_param_count
from ..cost.units import UNITS, format_value, parse_unit
from ..errors import ConfigError, install_hint
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy, StrategyKind, Topology


# ---- shared argument handling (used by ``zerosim comm`` too) ---------------------------------
def positive_int(field: str, text: Any) -> int:
    """Parse a CLI value as a positive integer, or raise ConfigError naming the option."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(field, text, "must be a positive integer") from None
    if value <= 0:
        raise ConfigError(field, text, "must be a positive integer")
    return value


def non_negative_int(field: str, text: Any) -> int:
    """Parse a CLI value as an integer >= 0, or raise ConfigError naming the option."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise ConfigError(field, text, "must be a non-negative integer") from None
    if value < 0:
        raise ConfigError(field, text, "must be a non-negative integer")
    return value


def add_model_args(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--params", help="parameter count, e.g. 7.5e9 or 7.5B (no block structure)")
    src.add_argument("--model", help="a preset: tiny, sim-10m, gpt2-small, ..., gpt-7.5b, gpt3-175b")
    p.add_argument("--world-size", "--world", dest="world_size",
                   required=True, help="number of ranks (data-parallel degree N_d)")
    p.add_argument(
        "--ranks-per-node", default=None, help="ranks per node (hybrid group size; intra vs inter node)"
    )
    p.add_argument(
        "--strategy",
        default="all",
        help="no_shard|zero1|zero2|zero3|hybrid_shard[:k]|hybrid_shard_zero2[:k]|all (default all)",
    )
    p.add_argument(
        "--partitioner",
        default=None,
        help="padding rule: paper (default, ceil(P/N)), seed, deepspeed, deepspeed-zero3, fsdp, "
             "zero-redundancy, round-robin, contiguous",
    )
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")


def add_zero1_reduce_arg(p) -> None:
    """``--zero1-reduce``: ZeRO-1's gradient averaging (the engine's ``zero1_grad_reduce``)."""
    p.add_argument(
        "--zero1-reduce",
        default="all_reduce",
        metavar="{all_reduce,reduce_scatter}",
        help="ZeRO-1 gradient averaging: all_reduce (torch ZeroRedundancyOptimizer, default: "
        "3(N-1)/N Psi) or reduce_scatter (DeepSpeed stage 1, the paper's 2(N-1)/N Psi; holds the "
        "packed full gradient and the reduced chunk at once)",
    )


def resolve_model(args) -> ParamLayout | int:
    if args.model is not None:
        return ParamLayout.from_config(args.model)
    if args.params is None:
        raise ConfigError("params", None, "give --params N or --model PRESET")
    return parse_param_count(args.params, "params")


def resolve_topology(args) -> Topology:
    ws = positive_int("world-size", args.world_size)
    rpn = positive_int("ranks-per-node", args.ranks_per_node) if args.ranks_per_node is not None else None
    if rpn is not None and ws % rpn:
        raise ConfigError("ranks-per-node", rpn, f"must divide world-size={ws}")
    return Topology(ws, rpn)


def resolve_strategies(args, topology: Topology) -> list[ShardingStrategy]:
    if str(args.strategy).strip().lower() == "all":
        return all_strategies(topology)
    rpn = topology.rpn if args.ranks_per_node is not None else None
    return [ShardingStrategy.parse(args.strategy, rpn)]


# ---- the command ------------------------------------------------------------------------------
def register(sub) -> None:
    p = sub.add_parser("memory", help="per-rank memory of params, grads, optimizer state (closed-form model)",
                       description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument(
        "--precision",
        default="mixed",
        help=f"one of {', '.join(PRECISIONS)} (default mixed: K=12 with adamw)",
    )
    p.add_argument("--optimizer", default="adamw", help=f"one of {', '.join(OPTIMIZER_STATES)}")
    p.add_argument(
        "--offload", default="none", help=f"what lives in host memory: {', '.join(OFFLOAD_CHOICES)}"
    )
    p.add_argument(
        "--prefetch-depth", default="1", help="ZeRO-3 blocks gathered ahead of the current one (default 1)"
    )
    p.add_argument(
        "--largest-block", default=None, help="with --params: numel of the largest block (ZeRO-3 transient)"
    )
    add_zero1_reduce_arg(p)
    p.add_argument("--unit", default="GB", help=f"table unit: {', '.join(UNITS)} (default GB = 10^9 bytes)")
    p.add_argument(
        "--compare-deepspeed",
        action="store_true",
        help="also show DeepSpeed's estimate_zero2/3_model_states_mem_needs next to ours (needs --model)",
    )
    p.set_defaults(func=run)


def build_estimates(args) -> list[MemoryEstimate]:
    model = resolve_model(args)
    topology = resolve_topology(args)
    depth = non_negative_int("prefetch-depth", args.prefetch_depth)
    settings = MemorySettings(
        precision=args.precision,
        optimizer=args.optimizer,
        offload=args.offload,
        prefetch_depth=depth,
        zero1_grad_reduce=getattr(args, "zero1_reduce", "all_reduce"),
    )
    largest = None
    if args.largest_block is not None:
        largest = parse_param_count(args.largest_block, "largest-block")
        if isinstance(model, int) and largest > model:
            raise ConfigError("largest-block", args.largest_block,
                              f"a block cannot hold more than the model's {model:,} parameters")
    out = []
    for strat in resolve_strategies(args, topology):
        if "params" in settings.offloaded and not strat.shards_params:
            if str(args.strategy).lower() == "all":
                continue  # param offload applies to zero3 / hybrid_shard only; skip the others in "all"
        out.append(memory_per_rank(model, strat, topology, settings, args.partitioner, largest))
    return out


def estimates_json(estimates: list[MemoryEstimate]) -> dict[str, Any]:
    first = estimates[0]
    return {
        "model": first.model,
        "total_params": first.total_params,
        "world_size": first.topology.world_size,
        "ranks_per_node": first.topology.ranks_per_node,
        "settings": first.settings.to_json(),
        "units": "bytes",
        "strategies": {e.strategy.name: e.to_json() for e in estimates},
    }


def render_table(estimates: list[MemoryEstimate], unit: str) -> str:
    from rich.table import Table

    from ..files.text_tables import table_text

    unit = parse_unit(unit)
    first = estimates[0]
    s = first.settings
    model = f"{first.total_params:,} params" if first.model == f"{first.total_params} params" else \
        f"{first.model} ({first.total_params:,} params)"
    title = (
        f"Per-rank memory, {model}, world {first.topology.world_size}, "
        f"{s.precision} + {s.optimizer} (K={s.K}), offload {s.offload}; unit {unit} = {UNITS[unit]:,} bytes"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("strategy")
    for col in ("params", "grads", "optim states", "total device", "total host", "transient", "peak device"):
        table.add_column(f"{col} [{unit}]", justify="right")
    for e in estimates:
        c = e.per_rank
        known = e.transient_modelled
        name = e.strategy.name
        if e.strategy.kind is StrategyKind.SHARD_OPTIMIZER and s.zero1_grad_reduce != "all_reduce":
            name = f"{name} ({s.zero1_grad_reduce})"
        table.add_row(
            name,
            format_value(c.params.total, unit),
            format_value(c.grads.total, unit),
            format_value(c.optimizer_states.total, unit),
            format_value(c.total.device, unit),
            format_value(c.total.host, unit),
            format_value(c.transient_device, unit) if known else "n/a",
            format_value(c.peak_device, unit) if known else "n/a",
        )
    text = table_text(table, width=200)
    notes = sorted({n for e in estimates for n in e.notes})
    tail = "".join(f"note: {n}\n" for n in notes)
    return (
        text + "params/grads/optim states/total: persistent model states (ZeRO paper accounting, "
        "per-rank worst class); transient/peak: engine accounting (gathered blocks, unsharded grads)\n" + tail
    )


def run(args) -> int:
    unit = parse_unit(args.unit)
    if args.compare_deepspeed:
        return run_deepspeed_compare(args, unit)
    estimates = build_estimates(args)
    if not estimates:
        raise ConfigError(
            "offload", args.offload, "no strategy left: param offload needs zero3 or hybrid_shard"
        )
    if args.json:
        json.dump(estimates_json(estimates), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(estimates, unit))
    return 0


def render_deepspeed_table(report: dict[str, Any], unit: str) -> str:
    """DeepSpeed's estimate next to ours, one row per case (GPU per rank, CPU per node).

    The DeepSpeed columns come from the real estimator when it ran on every row, else from zerosim's
    restatement of its published formulas; the header says which (never an unlabelled mix).
    """
    from rich.table import Table

    from ..files.text_tables import table_text

    real = all(r["ds_real"] is not None for r in report["rows"])
    source = "real" if real else "formula restated by zerosim"
    ds = [r["ds_real"] if real else r["ds_formula"] for r in report["rows"]]
    table = Table(
        title=(
            f"DeepSpeed estimator ({source}) vs zerosim model, {report['model']} "
            f"({report['total_params']:,} params, largest layer {report['largest_layer_params']:,}), "
            f"{report['num_nodes']} nodes x {report['num_gpus_per_node']} GPUs; "
            f"unit {unit} = {UNITS[unit]:,} bytes"
        ),
        title_justify="left",
    )
    short = "DS real" if real else "DS formula"
    for col in ("case", f"{short} gpu", "ours gpu (paper K=12)", "ours gpu (fp32 grads)",
                "ours gpu peak (fp32 grads)", f"{short} cpu/node", "ours host/node"):
        table.add_column(
            col if col == "case" else f"{col} [{unit}]",
            justify="left" if col == "case" else "right",
            no_wrap=col == "case",
        )
    for r, d in zip(report["rows"], ds, strict=True):
        table.add_row(r["case"], format_value(d["gpu"], unit),
                      format_value(r["ours_mixed_k12"]["device_persistent"], unit),
                      format_value(r["ours_fp32_grads"]["device_persistent"], unit),
                      format_value(r["ours_fp32_grads"]["device_peak"], unit),
                      format_value(d["cpu_per_node"], unit),
                      format_value(r["ours_fp32_grads"]["host_per_node"], unit))
    text = table_text(table, width=240)
    lines = [f"deepspeed: {report['deepspeed']}"]
    if not real:
        lines.append("DS formula: zerosim's restatement of the arithmetic of DeepSpeed's "
                     "estimate_zero2/3_model_states_mem_needs, not DeepSpeed's own output")
    if any(r["ds_real"] is not None for r in report["rows"]):
        same = all(r["ds_real"] == r["ds_formula"] for r in report["rows"] if r["ds_real"] is not None)
        lines.append(f"real estimator == restated formula on every row: {same}")
    lines += [f"- {e}" for e in report["explanation"]]
    return text + "\n".join(lines) + "\n"


def run_deepspeed_compare(args, unit: str) -> int:
    from ..cost.deepspeed_compare import compare_with_deepspeed, deepspeed_available

    if args.model is None:
        raise ConfigError(
            "model", None, "--compare-deepspeed needs --model PRESET (DeepSpeed needs the largest layer)"
        )
    layout = ParamLayout.from_config(args.model)
    topology = resolve_topology(args)
    if not deepspeed_available():
        print("note: deepspeed is not installed; showing the restated formula only "
              f"({install_hint('deepspeed')} for the real estimator)", file=sys.stderr)
    depth = non_negative_int("prefetch-depth", args.prefetch_depth)
    report = compare_with_deepspeed(layout, topology.rpn, topology.num_nodes, depth)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_deepspeed_table(report, unit))
    return 0
