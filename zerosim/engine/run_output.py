"""How a finished run is printed: the verdict tables (or JSON) and the exit status they map to.

Shared by ``zerosim simulate`` and the rank-0 side of the MPI and torch backends, so a run reads the
same whichever backend produced it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from ..errors import EXIT_CONTRACT_FAILED, EXIT_OK, EXIT_RUN_FAILED
from .run_result import RunResult


def _titles() -> dict[str, str]:
    try:
        from ..checks.contracts import load_contracts

        return {k: v.title for k, v in load_contracts().items()}
    except Exception:  # noqa: BLE001 - titles are decoration; a missing contracts/ dir must not break a run
        return {}


def _summary(contract: str, v: Any) -> str:
    d = v.details
    if d.get("skipped"):
        return str(d["skipped"])
    if contract == "C-ZERO-001":
        return (f"shard group of {d.get('world_size', '?')}: every element owned once, spread "
                f"{d.get('spread', '?')} <= {d.get('balance_bound', '?')}")
    if contract == "C-ZERO-002":
        gt = d.get("ground_truth", {})
        errs = gt.get("max_abs_error", {})
        worst = max(errs.values(), default=0.0)
        bit = "bitwise equal to the same-order reference; " if d.get("bitwise_required") else ""
        if "max_error_over_bound" in gt:
            ratio = max(gt["max_error_over_bound"].values(), default=0.0)
            within = f"at most {ratio:.2g} x its derived rounding bound"
        else:
            within = f"tolerance {(gt.get('tolerance') or {}).get('atol_scale', '?')} x scale"
        if v.diverged_at is None:
            return f"{bit}max |err| vs ground truth {worst:.2g} ({within})"
        compared = f"; before it max |err| {worst:.2g} ({within})" if v.diverged_at > 0 else ""
        return f"{bit}ground truth non-finite from step {v.diverged_at}{compared}"
    if contract == "C-ZERO-003":
        return (f"{d.get('ranks', '?')} ranks x {d.get('steps', '?')} steps bitwise identical to each other "
                "and to the master")
    if contract == "C-ZERO-004":
        peaks = d.get("peaks", {})
        mx = max((max(p) for p in peaks.values() if p), default=0)
        return f"holdings == plan; peak live params {mx / 1e6:.3g} MB"
    if contract == "C-ZERO-005":
        return (
            f"{d.get('model_bytes_sent_per_rank', 0) / 1e6:.4g} MB sent per rank per step "
            f"(paper: {d.get('paper_elements_per_rank', 0):,.0f} elements, padding "
            f"{d.get('padding_elements', 0)})"
        )
    return ""


def render(result: RunResult, as_json: bool) -> int:
    """Print the verdicts (table or JSON); return the exit status (0 pass, 1 a contract failed, 3 no
    contract failed but the training diverged: a reference went non-finite and was compared up to there)."""
    outcome = result.outcome
    code = {"pass": EXIT_OK, "fail": EXIT_CONTRACT_FAILED, "diverged": EXIT_RUN_FAILED}[outcome]
    if as_json:
        try:
            json.dump(result.to_json(), sys.stdout, indent=2)
            print()
        except BrokenPipeError:  # `zerosim simulate --json | head`: the reader left; keep the exit status
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - interpreter shutdown flushes stdout again
        return code
    from rich.console import Console
    from rich.table import Table

    from ..files.text_tables import print_table

    console = Console()
    c = result.config
    console.print(
        f"[bold]zerosim simulate[/]: {c['strategy']} on {c['world_size']} ranks "
        f"(shard group {c['shard_group_size']}, {c['replicas']} replica(s)), model "
        f"{c['model'].get('vocab_size')}"
        f"x{c['model'].get('d_model')} x {c['model'].get('n_layer')} layers = {c['num_params']:,} params, "
        f"partitioner {c['partitioner']}, {c['optimizer']['name']}, {c['precision']}, "
        f"{c['steps']} step(s) x {c['micro_batches']} micro-batch(es)"
    )
    steps = Table(title="steps")
    for col in ("step", "loss", "ground truth loss", "grad norm", "clip", "MB sent / rank", "wall (s)"):
        steps.add_column(col, justify="right")
    for m in result.steps:
        steps.add_row(str(m["step"]), f"{m['loss']:.6f}", f"{m.get('reference_loss', float('nan')):.6f}",
                      f"{m['grad_norm']:.4g}", f"{m['clip_coef']:.4g}", f"{m['bytes_sent_rank0'] / 1e6:.4g}",
                      f"{m['wall_s']:.3f}")
    print_table(steps, console)
    titles = _titles()
    table = Table(title="contracts")
    for col in ("contract", "title", "verdict", "checked", "summary"):
        table.add_column(col)
    for cid, v in result.verdicts.items():
        skipped = bool(v.details.get("skipped"))
        verdict = "[yellow]SKIP[/]" if skipped else {
            "pass": "[green]PASS[/]", "fail": "[red]FAIL[/]", "diverged": "[yellow]DIVERGED[/]"}[v.outcome]
        summary = _summary(cid, v) if v.passed else f"{len(v.violations)} violation(s)"
        table.add_row(cid, titles.get(cid, ""), verdict, str(v.checked), summary)
    print_table(table, console)
    shown = 0
    for v in result.verdicts.values():
        for viol in v.violations[:4]:
            console.print(str(viol), style="red", markup=False, highlight=False, soft_wrap=True)
            shown += 1
    if shown:
        console.print("(more detail: --json)")
    for cid, v in result.verdicts.items():
        if v.diverged_at is not None:
            console.print(f"{cid}: the training diverged: the reference is not finite (loss or state) "
                          f"from step {v.diverged_at} on; the steps before it were compared", style="yellow",
                          markup=False, highlight=False, soft_wrap=True)
    return code
