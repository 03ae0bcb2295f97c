"""``zerosim plan``: what every rank holds of params, grads and optimizer state, and its bytes.

A rich table for a person (1024 ranks stay readable: the middle ranks are elided and min / max rows
summarise them) or JSON for tools. The plan is checked against C-ZERO-001 (every shard group,
every kind of state, replicas identical) before it is shown; a violation makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from ..checks.partition import CONTRACT, check_state_plan
from ..cost.units import format_bytes
from ..dtypes import canonical_dtype, itemsize
from ..layout import ParamLayout
from ..partition import PARTITIONERS
from ..plan import STATE_KINDS, StatePlan, build_plan, bytes_in
from ..presets import PRESETS
from ..strategy import ShardingStrategy, Topology
from ._args import pipe_safe

ADAM_BYTES = 8  # m + v in fp32 per element: OptimizerShard.shard_memory_bytes's accounting
DEFAULT_MAX_ROWS = 16


def register(sub: Any) -> None:
    p = sub.add_parser(
        "plan", help="per-rank table: params / grads / optimizer state each rank owns, and bytes",
        description="What every rank owns of params, grads and optimizer state for a model, strategy, "
                    "partitioner and topology, checked against C-ZERO-001.")
    p.add_argument("--model", default="gpt2-small", metavar="PRESET",
                   help=f"built-in model (default gpt2-small): {', '.join(PRESETS)}")
    p.add_argument("--world-size", type=int, default=8, metavar="N", help="number of ranks (default 8)")
    p.add_argument("--strategy", default="full_shard", metavar="S",
                   help="no_shard|zero1|zero2|zero3|full_shard|shard_grad_op|hybrid_shard[:K]|"
                        "hybrid_shard_zero2[:K] (default full_shard)")
    p.add_argument("--partitioner", default="seed", metavar="P",
                   help=f"default seed: {', '.join(sorted(PARTITIONERS))}")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                   help="ranks per node (default: all ranks on one node); the hybrid shard group size")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: the preset's, float32)")
    p.add_argument("--json", action="store_true", help="machine-readable plan on stdout")
    p.add_argument("--all-ranks", action="store_true", help="show every rank, even for large worlds")
    p.add_argument(
        "--intervals", action="store_true", help="with --json: include each shard's flat intervals"
    )
    p.set_defaults(func=run)


@pipe_safe
def run(args: argparse.Namespace) -> int:
    layout = ParamLayout.from_config(args.model)
    if args.dtype:
        layout = layout.with_dtype(canonical_dtype(args.dtype, "dtype"))
    topology = Topology(args.world_size, args.ranks_per_node)
    strategy = ShardingStrategy.parse(args.strategy, ranks_per_node=args.ranks_per_node)
    strategy.shard_group_size(topology.world_size)  # validates a hybrid size against the world size
    plan = build_plan(layout, strategy, args.partitioner, topology)
    t0 = time.perf_counter()
    verdict = check_state_plan(plan)
    check_ms = (time.perf_counter() - t0) * 1e3
    if args.json:
        json.dump(plan_json(plan, verdict, check_ms, args.intervals), sys.stdout, indent=2)
        print()
    else:
        render(plan, verdict, check_ms, max_rows=None if args.all_ranks else DEFAULT_MAX_ROWS)
    return 0 if verdict.passed else 1


def _rank_rows(plan: StatePlan) -> list[dict[str, Any]]:
    """Per-rank numbers; counted once per distinct shard (replicas and state kinds share them)."""
    cache: dict[int, tuple[int, int]] = {}
    dtypes = plan.layout.bytes_by_dtype()
    single_itemsize = itemsize(next(iter(dtypes))) if len(dtypes) == 1 else None

    def numel_and_bytes(intervals: tuple) -> tuple[int, int]:
        key = id(intervals)  # the plan keeps every intervals tuple alive, so ids stay unique
        if key not in cache:
            n = sum(e - s for s, e in intervals)
            cache[key] = (n, n * single_itemsize if single_itemsize else bytes_in(plan.layout, intervals))
        return cache[key]

    meta = plan.shard_plan.meta
    owners = meta.get("block_owners")
    rows = []
    for r in plan.ranks:
        row: dict[str, Any] = {
            "rank": r.rank,
            "node": plan.topology.node_of(r.rank),
            "shard_group": r.shard_group,
            "local_rank": r.local_rank,
        }
        for kind in STATE_KINDS:
            s = r.holding(kind)
            numel, nbytes = numel_and_bytes(s.intervals)
            row[kind] = {
                "numel": numel,
                "padding": s.padding,
                "bytes": nbytes,
                "num_intervals": len(s.intervals),
            }
        row["optimizer"]["adam_state_bytes"] = row["optimizer"]["numel"] * ADAM_BYTES
        if owners is not None and plan.strategy.shard_group_size(plan.topology.world_size) > 1:
            row["blocks"] = sum(1 for o in owners if o == r.local_rank)
            row["block_fraction"] = meta["block_fraction"][r.local_rank]
            row["byte_fraction"] = meta["byte_fraction"][r.local_rank]
        rows.append(row)
    return rows


def plan_json(plan: StatePlan, verdict: Any, check_ms: float, with_intervals: bool = False) -> dict[str, Any]:
    sp = plan.shard_plan
    out = {
        "model": plan.layout.name, "total_numel": plan.layout.total_numel,
        "bytes_by_dtype": plan.layout.bytes_by_dtype(), "num_tensors": len(plan.layout.tensors),
        "num_blocks": plan.layout.num_transformer_blocks, "tied": dict(plan.layout.aliases),
        "strategy": plan.strategy.name, "zero_stage": plan.strategy.zero_stage,
        "partitioner": sp.partitioner, "partitioner_notes": sp.notes, "balance_bound": sp.balance_bound,
        "world_size": plan.topology.world_size, "ranks_per_node": plan.topology.ranks_per_node,
        "shard_group_size": sp.world_size, "num_shard_groups": plan.topology.world_size // sp.world_size,
        "sharded": {"params": plan.strategy.shards_params, "grads": plan.strategy.shards_grads,
                    "optimizer": plan.strategy.shards_optimizer},
        "ranks": _rank_rows(plan),
        "check": {**verdict.to_json(), "elapsed_ms": check_ms},
        "units": {"bytes": "at each tensor's dtype", "adam_state_bytes": "m + v in fp32 (8 bytes/element)"},
    }
    if with_intervals:
        out["shard_plan"] = sp.to_json()
    return out


def _visible(n: int, max_rows: int | None) -> tuple[list[int], int]:
    """Row indices to show and how many are elided from the middle."""
    if max_rows is None or n <= max_rows:
        return list(range(n)), 0
    half = max_rows // 2
    return list(range(half)) + list(range(n - half, n)), n - 2 * half


def render(plan: StatePlan, verdict: Any, check_ms: float, max_rows: int | None = DEFAULT_MAX_ROWS,
           console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..text_tables import print_table

    if console is None:
        console = Console(width=None if sys.stdout.isatty() else 220, highlight=False)
    layout, strat, topo, sp = plan.layout, plan.strategy, plan.topology, plan.shard_plan
    k = sp.world_size
    dtypes = ", ".join(
        f"{format_bytes(b, binary=True, digits=4)} {d}" for d, b in layout.bytes_by_dtype().items()
    )
    console.print(f"[bold]{layout.name}[/]: {layout.total_numel:,} parameters ({dtypes}), "
                  f"{len(layout.tensors)} tensors, {layout.num_transformer_blocks} blocks"
                  + (f", tied: {', '.join(layout.aliases)}" if layout.aliases else ""))
    sharded = [
        kind
        for kind in STATE_KINDS
        if {"params": strat.shards_params, "grads": strat.shards_grads, "optimizer": strat.shards_optimizer}[
            kind
        ]
    ]
    what = (
        ", ".join(sharded) + f" sharded over groups of {k}"
        if sharded
        else "nothing sharded (every rank holds all)"
    )
    console.print(
        f"strategy [bold]{strat.name}[/] (ZeRO-{strat.zero_stage}): {what}; partitioner "
        f"[bold]{sp.partitioner}[/] ({sp.notes}); {topo.world_size} ranks = {topo.num_nodes} node(s) "
        f"x {topo.rpn}"
    )
    rows = _rank_rows(plan)
    blocks = "blocks" in rows[0]
    table = Table(show_edge=False, pad_edge=False, header_style="bold")
    for col in ("rank", "group:local", "params", "grads", "optimizer", "padding", "param bytes", "grad bytes",
                "Adam m+v fp32", "intervals"):
        table.add_column(col, justify="right", no_wrap=True)
    if blocks:
        for col in ("blocks", "frac (blocks)", "frac (bytes)"):
            table.add_column(col, justify="right", no_wrap=True)

    def cells(row: dict[str, Any]) -> list[str]:
        out = [
            str(row["rank"]),
            f"{row['shard_group']}:{row['local_rank']}",
            f"{row['params']['numel']:,}",
            f"{row['grads']['numel']:,}",
            f"{row['optimizer']['numel']:,}",
            f"{max(row[k]['padding'] for k in STATE_KINDS):,}",
            format_bytes(row["params"]["bytes"], binary=True, digits=4),
            format_bytes(row["grads"]["bytes"], binary=True, digits=4),
            format_bytes(row["optimizer"]["adam_state_bytes"], binary=True, digits=4),
            str(max(row[k]["num_intervals"] for k in STATE_KINDS)),
        ]
        if blocks:
            out += [str(row["blocks"]), f"{row['block_fraction']:.3f}", f"{row['byte_fraction']:.3f}"]
        return out

    shown, elided = _visible(len(rows), max_rows)
    for i, idx in enumerate(shown):
        if elided and i == len(shown) // 2:
            table.add_row("...", f"+{elided} ranks", *["..."] * (len(table.columns) - 2), style="dim")
        table.add_row(*cells(rows[idx]))
    if elided:
        for label, pick in (("min", min), ("max", max)):
            table.add_row(label, "", *[
                f"{pick(r[k]['numel'] for r in rows):,}" for k in STATE_KINDS],
                f"{pick(max(r[k]['padding'] for k in STATE_KINDS) for r in rows):,}",
                format_bytes(pick(r['params']['bytes'] for r in rows), binary=True, digits=4),
                format_bytes(pick(r['grads']['bytes'] for r in rows), binary=True, digits=4),
                format_bytes(pick(r['optimizer']['adam_state_bytes'] for r in rows), binary=True, digits=4),
                str(pick(max(r[k]['num_intervals'] for k in STATE_KINDS) for r in rows)),
                *([str(pick(r["blocks"] for r in rows)), f"{pick(r['block_fraction'] for r in rows):.3f}",
                   f"{pick(r['byte_fraction'] for r in rows):.3f}"] if blocks else []),
                style="italic", end_section=False)
    print_table(table, console)
    if elided:
        console.print(f"[dim]{elided} of {len(rows)} ranks elided from the middle; min / max rows cover all "
                      f"ranks (--all-ranks shows every rank, --json gives them all).[/]")
    if blocks:
        console.print(
            "[dim]frac (blocks) is the seed's memory_fraction_for_rank (blocks owned / blocks); "
            "frac (bytes) weighs them by bytes and counts the embedding, final norm and lm head.[/]"
        )
    if verdict.passed:
        console.print(f"{CONTRACT} holds: {', '.join(STATE_KINDS)} in every shard group, replicas identical "
                      f"({verdict.checked} shards checked in {check_ms:.1f} ms)")
    else:
        console.print(f"[bold red]{CONTRACT} violated[/] ({len(verdict.violations)} violations):")
        for v in verdict.violations[:20]:
            console.print(f"  {v}", markup=False)
