"""The mixed-precision columns of ``zerosim verify --all``: ``bf16 @ 4`` and ``fp16 @ 4``.

For each (precision, world) of :data:`PRECISION_CELLS` every adapter runs both optimizer phases at
``world`` ranks with ``--precision`` (a float32 model, the master dtype; ``optim["mixed_precision"]``
to the factory). A cell keeps the run's verdict, each contract's status, the worst error over its
bound of any contract (C-ZERO-002's normwise update error, C-ZERO-008's logged norm, ...), the wall
time, each phase's status (an adapter that cannot train in that precision reports the phase
unsupported, with the reason), the diagnosis, and the dtypes the traffic records give the gradient
reductions where the run kept them. A run that ends in an error is a cell ``"error"`` with its line.
"""

from __future__ import annotations

import time
from typing import Any

from zerosim.errors import ZeroSimError

PRECISION_CELLS = (("bf16", 4), ("fp16", 4))  # (precision, world) of the mixed-precision columns


def run_precision_cell(
    adapter: str,
    precision: str,
    world: int,
    *,
    steps: int,
    phases: int = 2,
    device: str = "cpu",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One mixed-precision cell: both phases of ``steps`` each at ``world`` ranks under ``precision``."""
    from . import verify

    cell: dict[str, Any] = {"adapter": adapter, "precision": precision, "world": world,
                            "steps": steps * phases}
    start = time.perf_counter()
    try:
        report = verify(adapter, world=world, steps=steps * phases, precision=precision, device=device,
                        timeout_s=timeout_s)
    except ZeroSimError as e:
        cell.update(verdict="error", error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - start)
        return cell
    cell["wall_s"] = time.perf_counter() - start
    ratios: dict[str, float] = {}
    for cid, outcome in report.contracts.items():
        ratio = outcome.details.get("error_over_tolerance")
        if isinstance(ratio, (int, float)):
            ratios[cid] = float(ratio)
    worst = max(ratios.items(), key=lambda item: item[1]) if ratios else None
    cell.update(
        verdict=report.verdict,
        contracts={cid: o.status for cid, o in report.contracts.items()},
        reasons={cid: o.reason for cid, o in report.contracts.items() if o.status != "pass"},
        error_over_tolerance=worst[1] if worst else None,
        worst_contract=worst[0] if worst else None,
        ratios=ratios,
        phases={p["name"]: p.get("reason") or p.get("status") for p in report.phases},
        diagnosis=[d.bug_class for d in report.diagnosis],
        findings=len(report.findings),
        reduce_dtypes=_reduce_dtypes(report),
    )
    return cell


def _reduce_dtypes(report: Any) -> list[str] | None:
    """The dtypes of the gradient reductions C-ZERO-005 saw, where its details keep them."""
    traffic = report.contracts.get("C-ZERO-005")
    details = traffic.details if traffic is not None else {}
    seen = details.get("reduce_dtypes")
    return sorted(str(d) for d in seen) if isinstance(seen, (list, tuple, set)) else None


def precision_label(cell: dict[str, Any]) -> str:
    """A cell as one short text: verdict, worst error / bound (and which contract), first skip."""
    if cell["verdict"] == "error":
        return "error"
    phases = cell.get("phases") or {}
    unsupported = [name for name, status in phases.items() if status not in ("ran", None)]
    if phases and len(unsupported) == len(phases):  # nothing ran: no verdict to give
        return f"unsupported: {', '.join(unsupported)}"
    text = cell["verdict"]
    if cell.get("error_over_tolerance") is not None:
        text += f" {cell['error_over_tolerance']:.1e} ({cell['worst_contract']})"
    if cell.get("findings"):
        text += f" ({cell['findings']} finding{'s' if cell['findings'] != 1 else ''})"
    if unsupported:
        text += f"; unsupported: {', '.join(unsupported)}"
    return text


def render_precision_markdown(matrix: dict[str, Any]) -> list[str]:
    """The mixed-precision columns: one row per adapter, one column per (precision, world), then the
    reasons of every failure and every unsupported phase."""
    cells = matrix.get("precision_cells") or []
    if not cells:
        return []
    pairs = [tuple(p) for p in matrix["precision_pairs"]]
    by = {(c["adapter"], c["precision"], c["world"]): c for c in cells}
    lines = ["", "## Mixed precision (`--precision`): float32 masters, reduce dtype float32", "",
             "Cell: the run's verdict, the worst error over its bound of any contract (and which), "
             "and the phases the adapter reports unsupported.", "",
             "| adapter | " + " | ".join(f"{p} @ {n}" for p, n in pairs) + " | wall s |",
             "|---|" + "---|" * (len(pairs) + 1)]
    for name in matrix["adapters"]:
        row = [precision_label(by[(name, p, n)]) if (name, p, n) in by else "-" for p, n in pairs]
        walls = [f"{by[(name, p, n)]['wall_s']:.1f}" for p, n in pairs if (name, p, n) in by]
        lines.append(f"| {name} | " + " | ".join(row) + f" | {' / '.join(walls) or '-'} |")
    notes = []
    for c in cells:
        where = f"{c['adapter']} {c['precision']} @ {c['world']}"
        if c["verdict"] == "error":
            notes.append(f"- {where}: {c['error']}")
            continue
        notes += [f"- {where}: {cid} fail: {why}" for cid, why in (c.get("reasons") or {}).items()
                  if c["contracts"].get(cid) == "fail"]
        notes += [f"- {where}: {phase} phase: {status}" for phase, status in (c.get("phases") or {}).items()
                  if status not in ("ran", None)]
    return lines + (["", "### Mixed-precision findings", "", *notes] if notes else [])


def progress_line(cell: dict[str, Any]) -> str:
    """What ``--all`` prints for one mixed-precision cell."""
    return f"{cell['precision']} @ {cell['world']}: {precision_label(cell)}"
