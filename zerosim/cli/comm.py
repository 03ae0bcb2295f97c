"""``zerosim comm``: per-rank communication per optimizer step, by collective and by link class.

Built on the closed-form ring model :func:`zerosim.cost.comm_model.comm_per_step` (C-ZERO-005's
expected value: the reference engine's schedule, ring attribution, padding counted).

Examples::

    zerosim comm --params 7.5e9 --world-size 64 --strategy all
    zerosim comm --model gpt2-small --world-size 16 --ranks-per-node 4 --strategy all --json
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from typing import Any

from ..cost.comm_model import CommEstimate, comm_per_step
from ..cost.memory_settings import PRECISIONS, MemorySettings
from ..cost.units import UNITS, format_value, parse_unit
from .memory import (
    add_model_args,
    add_zero1_reduce_arg,
    positive_int,
    resolve_model,
    resolve_strategies,
    resolve_topology,
)

#: above this many ranks the intra/inter split is rank 0's (the per-rank mean needs O(ranks) work)
MEAN_LINKS_MAX_WORLD = 4096


def register(sub) -> None:
    p = sub.add_parser("comm", help="per-rank communication volume per step (closed-form ring model)",
                       description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--precision", default="mixed",
                   help=f"bytes of the gathered params and reduced grads: {', '.join(PRECISIONS)} "
                        "(default mixed: 2 and 2; the engine's bf16 reduces grads in fp32)")
    p.add_argument(
        "--micro-batches", default="1", help="micro-batches per step (ZeRO-2/3 reduce per micro-batch)"
    )
    add_zero1_reduce_arg(p)
    p.add_argument("--unit", default="GB", help=f"table unit: {', '.join(UNITS)} (default GB = 10^9 bytes)")
    p.set_defaults(func=run)


def link_split(est: CommEstimate) -> dict[str, Any]:
    """Bytes sent per rank intra- and inter-node: the mean over ranks (rank 0's above 4096 ranks)."""
    if est.world_size <= MEAN_LINKS_MAX_WORLD:
        tot = est.link_totals()
        return {"basis": "mean over ranks",
                **{c: float(Fraction(tot[c]["sent"]) / est.world_size) for c in ("intra", "inter")}}
    r0 = est.per_rank_links(0)
    return {"basis": "rank 0", **{c: float(r0[c]["sent"]) for c in ("intra", "inter")}}


def build_estimates(args) -> list[tuple[CommEstimate, dict[str, Any]]]:
    model = resolve_model(args)
    topology = resolve_topology(args)
    micro = positive_int("micro-batches", args.micro_batches)
    spec = MemorySettings(precision=args.precision).spec
    partitioner = args.partitioner or ("fsdp" if not isinstance(model, int) else None)
    out = []
    for strat in resolve_strategies(args, topology):
        est = comm_per_step(model, strat, topology, partitioner, micro, spec.param_bytes, spec.grad_bytes,
                            getattr(args, "zero1_reduce", "all_reduce"))
        out.append((est, link_split(est)))
    return out


def render_table(rows: list[tuple[CommEstimate, dict[str, Any]]], unit: str) -> str:
    from rich.table import Table

    from ..files.text_tables import table_text

    first = rows[0][0]
    table = Table(title=(f"Per-rank traffic per step, {first.numel:,} params, world {first.world_size} "
                         f"({first.ranks_per_node} per node), {first.micro_batches} micro-batch(es), "
                         f"{first.param_bytes} B params / {first.grad_bytes} B grads; unit {unit} = "
                         f"{UNITS[unit]:,} bytes"), title_justify="left")
    table.add_column("strategy")
    for col in ("sent", "intra-node", "inter-node"):
        table.add_column(f"{col} [{unit}]", justify="right")
    table.add_column("elements / Psi", justify="right")
    table.add_column("paper elements / Psi", justify="right")
    table.add_column("collectives (calls x kind @ group size)")
    for est, links in rows:
        colls = ", ".join(f"{i.calls}x {i.collective}@{i.group_size}" for i in est.items) or "none"
        name = f"{est.strategy} ({est.variant})" if est.variant else est.strategy
        table.add_row(name, format_value(float(est.bytes_sent), unit), format_value(links["intra"], unit),
                      format_value(links["inter"], unit), f"{float(est.elements_sent) / est.numel:.4g}",
                      f"{float(est.paper_elements()) / est.numel:.4g}", colls)
    text = table_text(table, width=220)
    notes = sorted({n for est, _ in rows for n in est.notes})
    basis = rows[0][1]["basis"]
    return text + f"intra/inter: bytes each rank sends over ring edges inside / across nodes ({basis})\n" + \
        "".join(f"note: {n}\n" for n in notes)


def run(args) -> int:
    unit = parse_unit(args.unit)
    rows = build_estimates(args)
    if args.json:
        first = rows[0][0]
        data = {
            "numel": first.numel,
            "world_size": first.world_size,
            "ranks_per_node": first.ranks_per_node,
            "micro_batches": first.micro_batches,
            "units": "bytes (elements where named)",
            "strategies": {
                est.strategy: {
                    **est.to_json(with_links=False),
                    "links_mean_sent": links,
                    "collectives_by_link": est.collective_links(MEAN_LINKS_MAX_WORLD),
                }
                for est, links in rows
            },
        }
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_table(rows, unit))
    return 0
