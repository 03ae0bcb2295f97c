"""The per-rank table of a plan (``zerosim plan``): what every rank holds of params, grads and optimizer
state, and its bytes, as a rich table or as JSON, with the plan's C-ZERO-001 verdict.

A thousand ranks stay readable: the middle ranks are elided and min / max rows summarise them;
every rank's numbers are arrays over the world (:class:`RankColumns`), never one Python object per rank.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..checks.partition import CONTRACT
from ..cost.units import format_bytes
from ..values.plan import STATE_KINDS, StatePlan, bytes_in

ADAM_BYTES = 8  # m + v in fp32 per element: OptimizerShard.shard_memory_bytes's accounting
DEFAULT_MAX_ROWS = 16


class RankColumns:
    """Every rank's numbers as arrays over the world (no per-rank Python objects).

    A plan built by :func:`zerosim.values.plan.build_plan` holds one ShardPlan: local rank ``r % k``'s
    numbers are computed once per local rank and spread to every shard group; any other StatePlan is
    read rank by rank.
    """

    def __init__(self, plan: StatePlan):
        from ..values.plan import RankStates, shard_columns

        self.plan = plan
        topo, layout = plan.topology, plan.layout
        ws = topo.world_size
        self.rank = np.arange(ws, dtype=np.int64)
        sp = plan.shard_plan
        total, total_bytes = layout.total_numel, layout.total_bytes
        flags = {"params": plan.strategy.shards_params, "grads": plan.strategy.shards_grads,
                 "optimizer": plan.strategy.shards_optimizer}
        self.cols: dict[str, dict[str, np.ndarray]] = {}
        if isinstance(plan.ranks, RankStates) and plan.ranks.derived(sp):
            k = sp.world_size
            self.group, self.local = self.rank // k, self.rank % k
            local = shard_columns(layout, sp)
            for kind in STATE_KINDS:
                if flags[kind]:
                    self.cols[kind] = {"numel": local.numel[self.local], "padding": local.padding[self.local],
                                       "bytes": local.nbytes[self.local],
                                       "num_intervals": local.num_intervals[self.local]}
                else:
                    self.cols[kind] = {"numel": np.full(ws, total, dtype=np.int64),
                                       "padding": np.zeros(ws, dtype=np.int64),
                                       "bytes": np.full(ws, total_bytes, dtype=np.int64),
                                       "num_intervals": np.full(ws, 1 if total else 0, dtype=np.int64)}
        else:
            states = list(plan.ranks)
            self.group = np.array([r.shard_group for r in states], dtype=np.int64)
            self.local = np.array([r.local_rank for r in states], dtype=np.int64)
            for kind in STATE_KINDS:
                held = [r.holding(kind) for r in states]
                self.cols[kind] = {"numel": np.array([h.numel for h in held], dtype=object),
                                   "padding": np.array([h.padding for h in held], dtype=object),
                                   "bytes": np.array([bytes_in(layout, h.intervals) for h in held],
                                                     dtype=object),
                                   "num_intervals": np.array([len(h.intervals) for h in held],
                                                             dtype=np.int64)}
        self.cols["optimizer"]["adam_state_bytes"] = self.cols["optimizer"]["numel"] * ADAM_BYTES
        meta = sp.meta
        self.blocks = (meta.get("block_owners") is not None
                       and plan.strategy.shard_group_size(ws) > 1)
        if self.blocks:
            counts = np.bincount(np.asarray(meta["block_owners"], dtype=np.int64), minlength=sp.world_size)
            self.block_cols = {"blocks": counts[self.local],
                               "block_fraction": np.asarray(meta["block_fraction"], dtype=float)[self.local],
                               "byte_fraction": np.asarray(meta["byte_fraction"], dtype=float)[self.local]}

    def __len__(self) -> int:
        return len(self.rank)

    def row(self, i: int) -> dict[str, Any]:
        """Rank ``i``'s row as in ``zerosim plan --json``."""
        rank = int(self.rank[i])
        row: dict[str, Any] = {"rank": rank, "node": self.plan.topology.node_of(rank),
                               "shard_group": int(self.group[i]), "local_rank": int(self.local[i])}
        for kind in STATE_KINDS:
            row[kind] = {name: int(col[i]) for name, col in self.cols[kind].items()}
        if self.blocks:
            row["blocks"] = int(self.block_cols["blocks"][i])
            row["block_fraction"] = float(self.block_cols["block_fraction"][i])
            row["byte_fraction"] = float(self.block_cols["byte_fraction"][i])
        return row

    def extreme(self, pick: Any, kind: str, name: str) -> Any:
        """min or max (``pick``) of one column over every rank."""
        col = self.cols[kind][name]
        return int(pick(col))

    def max_over_kinds(self, name: str) -> np.ndarray:
        return np.maximum.reduce([self.cols[k][name] for k in STATE_KINDS])


def _rank_rows(plan: StatePlan) -> list[dict[str, Any]]:
    """Every rank's row (``zerosim plan --json``)."""
    cols = RankColumns(plan)
    return [cols.row(i) for i in range(len(cols))]


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

    from ..files.text_tables import print_table

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
    rows = RankColumns(plan)
    blocks = rows.blocks
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
        table.add_row(*cells(rows.row(idx)))
    if elided:
        padding, intervals = rows.max_over_kinds("padding"), rows.max_over_kinds("num_intervals")
        for label, pick in (("min", np.min), ("max", np.max)):
            table.add_row(label, "", *[
                f"{rows.extreme(pick, k, 'numel'):,}" for k in STATE_KINDS],
                f"{pick(padding):,}",
                format_bytes(rows.extreme(pick, "params", "bytes"), binary=True, digits=4),
                format_bytes(rows.extreme(pick, "grads", "bytes"), binary=True, digits=4),
                format_bytes(rows.extreme(pick, "optimizer", "adam_state_bytes"), binary=True, digits=4),
                str(pick(intervals)),
                *([str(pick(rows.block_cols["blocks"])), f"{pick(rows.block_cols['block_fraction']):.3f}",
                   f"{pick(rows.block_cols['byte_fraction']):.3f}"] if blocks else []),
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
