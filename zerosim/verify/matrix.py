"""``zerosim verify --all``: the peers' verdict matrix (adapter x optimizer x world size).

Every installed built-in adapter (:func:`zerosim.verify.adapters.installed_adapters`) runs through
:func:`zerosim.verify.verify` once per optimizer phase ("sgd", "adamw") and world size (2, 4), each
cell its own launch with the phase's default length, so a cell's maximum error over its tolerance
belongs to that optimizer alone. Written into ``--out DIR`` or a new
``reports/verify-matrix-<timestamp>/``: ``verify-matrix.json`` (every cell:
verdict, each contract's status, max error, tolerance, first failing step and contract, wall time),
``verify-matrix.md`` (the same as tables) and ``verify-matrix.png`` (a heat map of
log10(max error / tolerance), each cell labelled with its verdict and first failing step).

The resume column: for each pair (N, M) of :data:`RESUME_PAIRS` (2 -> 3, 4 -> 2), every adapter runs
both phases at N ranks, each phase interrupted after step :data:`RESUME_AT` and resumed from its own
checkpoint on M fresh ranks (``verify(..., resume_at=, resume_world=)``); the cell shows the run's
verdict and C-ZERO-007. ``--resume-matrix`` runs this column alone: ``verify-resume-matrix.json``
and ``.md`` in ``--out DIR`` or a new ``reports/verify-resume-matrix-<timestamp>/``.

The mesh column: every hybrid adapter (:data:`zerosim.verify.adapters.HYBRID_ADAPTERS`) once more at
world 4 on the degenerate mesh (4, 1) (``--mesh 4x1``: four replicas of one unsharded rank, where
the replicate all-reduce is the only reduction; pytorch #154888 dropped it there), per optimizer.

The accumulation column: for each (K, N) of :data:`ACCUM_CELLS` (3 micro-batches at world 4), every
adapter runs both phases at N ranks with ``--grad-accum K``; the cell shows the run's verdict, the
worst C-ZERO-002 error over its bound and the worst logged-norm error over its bound (C-ZERO-008).

The mixed-precision columns (``bf16 @ 4``, ``fp16 @ 4``): :mod:`zerosim.verify.matrix_precision`.

A cell counts its findings (traffic or memory off the declared strategy's model in a run whose values
are right; the cell passes and says how many). A cell whose run ends with an error (a rank failed, the
peer rejected the configuration) is kept as ``"error"`` with its one-line message: a peer that fails
is reported, never dropped.

Why one module of this length: the cells, their order, the resume column and the three renderings
(markdown, JSON, heat map) describe one table; each rendering reads the same cell values.
"""

from __future__ import annotations

import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerosim.errors import ConfigError, ZeroSimError
from zerosim.outputs import save_figure, write_text

from .adapters import ADAPTERS, HYBRID_ADAPTERS, installed_adapters
from .matrix_precision import PRECISION_CELLS, progress_line, render_precision_markdown, run_precision_cell
from .outcome import VerifyReport

OPTIMIZER_PHASES = ("sgd", "adamw")
WORLDS = (2, 4)
PHASE_STEPS = 4  # each phase's length in the default two-phase suite (8 steps)
RESUME_PAIRS = ((2, 3), (4, 2))  # (world saved at, world resumed at) of the resume column
RESUME_AT = 2  # each phase resumes after this many of its steps
MESH_WORLDS = (4,)  # the mesh column: hybrid adapters on the (world, 1) mesh at these world sizes
ACCUM_CELLS = ((3, 4),)  # (micro-batches per step, world) of the accumulation column


def run_cell(
    adapter: str,
    optimizer: str,
    world: int,
    *,
    steps: int = PHASE_STEPS,
    dtype: str = "float64",
    device: str = "cpu",
    timeout_s: float | None = None,
    mesh: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One matrix cell: verify ``adapter`` with one optimizer phase at ``world`` ranks (on ``mesh``)."""
    cell: dict[str, Any] = {"adapter": adapter, "optimizer": optimizer, "world": world, "steps": steps}
    options: dict[str, Any] = {}
    if mesh is not None:
        cell["mesh"] = list(mesh)
        options["mesh"] = mesh
    report = _timed_verify(cell, adapter, world=world, steps=steps, dtype=dtype, device=device,
                           optimizers=(optimizer,), timeout_s=timeout_s, **options)
    if report is None:
        return cell
    eq = report.contracts.get("C-ZERO-002")
    details = eq.details if eq is not None else {}
    failing = _failing_steps(report)
    phase = next((p for p in report.phases if p.get("name") == optimizer), {})
    cell.update(
        verdict=report.verdict,
        contracts={cid: o.status for cid, o in report.contracts.items()},
        reasons={cid: o.reason for cid, o in report.contracts.items() if o.status != "pass"},
        max_error=details.get("max_error"),
        tolerance=details.get("tolerance"),
        error_over_tolerance=details.get("error_over_tolerance"),
        first_failing_step=failing[0] if failing else None,
        first_failing_contract=failing[1] if failing else None,
        diagnosis=[d.bug_class for d in report.diagnosis],
        arithmetic=phase.get("arithmetic"),
        master_dtype=phase.get("master_dtype"),
        clip_binds_at=phase.get("clip_binds_at"),
        findings=len(report.findings),
    )
    return cell


def run_resume_cell(
    adapter: str,
    world: int,
    resume_world: int,
    *,
    at: int = RESUME_AT,
    steps: int = PHASE_STEPS,
    dtype: str = "float64",
    device: str = "cpu",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One resume cell: both phases of ``steps`` each at ``world`` ranks, each interrupted after its
    ``at``-th step and resumed on ``resume_world`` fresh ranks (C-ZERO-007 and the others)."""
    cell: dict[str, Any] = {
        "adapter": adapter,
        "world": world,
        "resume_world": resume_world,
        "resume_at": at,
        "steps": steps * len(OPTIMIZER_PHASES),
    }
    report = _timed_verify(cell, adapter, world=world, steps=steps * len(OPTIMIZER_PHASES), dtype=dtype,
                           device=device, timeout_s=timeout_s, resume_at=at, resume_world=resume_world)
    if report is None:
        return cell
    resumed = report.contracts.get("C-ZERO-007")
    details = resumed.details if resumed is not None else {}
    failing = _failing_steps(report)
    cell.update(
        verdict=report.verdict,
        contracts={cid: o.status for cid, o in report.contracts.items()},
        reasons={cid: o.reason for cid, o in report.contracts.items() if o.status != "pass"},
        resumed=resumed.status if resumed is not None else "skipped",
        error_over_tolerance=details.get("error_over_tolerance"),
        round_trip_violations=details.get("round_trip_violations"),
        first_failing_step=failing[0] if failing else None,
        first_failing_contract=failing[1] if failing else None,
        phases={p["name"]: p.get("reason") or p.get("status") for p in report.phases},
        findings=len(report.findings),
    )
    return cell


def run_accum_cell(
    adapter: str,
    grad_accum: int,
    world: int,
    *,
    steps: int = PHASE_STEPS,
    dtype: str = "float64",
    device: str = "cpu",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One accumulation cell: both phases of ``steps`` each at ``world`` ranks, ``grad_accum``
    micro-batches per optimizer step (``step_accumulated``)."""
    cell: dict[str, Any] = {"adapter": adapter, "world": world, "grad_accum": grad_accum,
                            "steps": steps * len(OPTIMIZER_PHASES)}
    report = _timed_verify(cell, adapter, world=world, steps=steps * len(OPTIMIZER_PHASES), dtype=dtype,
                           device=device, timeout_s=timeout_s, grad_accum=grad_accum)
    if report is None:
        return cell
    eq = report.contracts.get("C-ZERO-002")
    logged = report.contracts.get("C-ZERO-008")
    failing = _failing_steps(report)
    cell.update(
        verdict=report.verdict,
        contracts={cid: o.status for cid, o in report.contracts.items()},
        reasons={cid: o.reason for cid, o in report.contracts.items() if o.status != "pass"},
        error_over_tolerance=(eq.details if eq is not None else {}).get("error_over_tolerance"),
        logged_norm_over_tolerance=(logged.details if logged is not None else {}).get("error_over_tolerance"),
        first_failing_step=failing[0] if failing else None,
        first_failing_contract=failing[1] if failing else None,
        diagnosis=[d.bug_class for d in report.diagnosis],
        findings=len(report.findings),
    )
    return cell


def render_accum_markdown(matrix: dict[str, Any]) -> list[str]:
    """The accumulation column: one row per adapter, one column per (K, world)."""
    cells = matrix.get("accum_cells") or []
    if not cells:
        return []
    pairs = [tuple(p) for p in matrix["accum_pairs"]]
    by = {(c["adapter"], c["grad_accum"], c["world"]): c for c in cells}
    lines = ["", "## Gradient accumulation: K micro-batches per optimizer step (`--grad-accum K`)", "",
             "Cell: the run's verdict, C-ZERO-002's and C-ZERO-008's (logged norm) max error / tolerance, "
             "and the first failing step and contract.", "",
             "| adapter | " + " | ".join(f"accum {k} @ {n}" for k, n in pairs) + " |",
             "|---|" + "---|" * len(pairs)]
    for name in matrix["adapters"]:
        row = [_accum_label(by[(name, k, n)]) if (name, k, n) in by else "-" for k, n in pairs]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    notes = [f"- {c['adapter']} accum {c['grad_accum']} @ {c['world']}: {cid} fail: {why}"
             for c in cells for cid, why in (c.get("reasons") or {}).items()
             if c["contracts"].get(cid) == "fail"]
    notes += [f"- {c['adapter']} accum {c['grad_accum']} @ {c['world']}: {c['error']}"
              for c in cells if c["verdict"] == "error"]
    return lines + (["", "### Accumulation findings", "", *notes] if notes else [])


def _accum_label(cell: dict[str, Any]) -> str:
    if cell["verdict"] == "error":
        return "error"
    figures = [f"{x:.1e}" if isinstance(x, (int, float)) else "-"
               for x in (cell.get("error_over_tolerance"), cell.get("logged_norm_over_tolerance"))]
    text = f"{cell['verdict']} {figures[0]} / norm {figures[1]}{_findings_text(cell)}"
    if cell.get("first_failing_step") is not None:
        text += f" (step {cell['first_failing_step']}, {cell['first_failing_contract']})"
    return text


def run_matrix(
    adapters: Sequence[str] | None = None,
    optimizers: Sequence[str] = OPTIMIZER_PHASES,
    worlds: Sequence[int] = WORLDS,
    *,
    steps: int = PHASE_STEPS,
    dtype: str = "float64",
    device: str = "cpu",
    timeout_s: float | None = None,
    progress: Any = None,
    resume_pairs: Sequence[tuple[int, int]] = (),
    mesh_worlds: Sequence[int] = (),
    accum_pairs: Sequence[tuple[int, int]] = (),
    precision_pairs: Sequence[tuple[str, int]] = (),
) -> dict[str, Any]:
    """Every cell of the matrix (see the module docstring), the mesh column (hybrid adapters on the
    (world, 1) mesh for each world in ``mesh_worlds``), then the resume column for each pair in
    ``resume_pairs``, the accumulation and the mixed-precision columns; ``progress(cell)`` is called
    after each."""
    names = list(adapters) if adapters is not None else installed_adapters()
    for name in names:
        if name not in ADAPTERS:
            raise ConfigError("adapter", name, f"not a built-in adapter; known: {', '.join(ADAPTERS)}")
    cells = []
    resume_cells = []
    mesh_cells = []
    accum_cells = []
    precision_cells = []
    for name in names:
        for world in worlds:
            for optimizer in optimizers:
                cell = run_cell(
                    name, optimizer, world, steps=steps, dtype=dtype, device=device, timeout_s=timeout_s
                )
                cells.append(cell)
                if progress is not None:
                    progress(cell)
        for world in mesh_worlds if name in HYBRID_ADAPTERS else ():
            for optimizer in optimizers:
                cell = run_cell(name, optimizer, world, steps=steps, dtype=dtype, device=device,
                                timeout_s=timeout_s, mesh=(world, 1))
                mesh_cells.append(cell)
                if progress is not None:
                    progress(cell)
        for n, m in resume_pairs:
            cell = run_resume_cell(name, n, m, steps=steps, dtype=dtype, device=device, timeout_s=timeout_s)
            resume_cells.append(cell)
            if progress is not None:
                progress(cell)
        for k, n in accum_pairs:
            cell = run_accum_cell(name, k, n, steps=steps, dtype=dtype, device=device, timeout_s=timeout_s)
            accum_cells.append(cell)
            if progress is not None:
                progress(cell)
        for precision, n in precision_pairs:
            cell = run_precision_cell(name, precision, n, steps=steps, device=device, timeout_s=timeout_s)
            precision_cells.append(cell)
            if progress is not None:
                progress(cell)
    return {
        "generated_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "environment": _environment(),
        "dtype": dtype,
        "device": device,
        "steps_per_cell": steps,
        "adapters": names,
        "not_installed": [n for n in ADAPTERS if n not in names and n not in installed_adapters()],
        "optimizers": list(optimizers),
        "worlds": list(worlds),
        "cells": cells,
        "resume_pairs": [list(p) for p in resume_pairs],
        "resume_at": RESUME_AT,
        "resume_cells": resume_cells,
        "mesh_worlds": list(mesh_worlds),
        "mesh_cells": mesh_cells,
        "accum_pairs": [list(p) for p in accum_pairs],
        "accum_cells": accum_cells,
        "precision_pairs": [list(p) for p in precision_pairs],
        "precision_cells": precision_cells,
    }


def _environment() -> dict[str, Any]:
    import importlib.metadata as md

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": _cpu_model() or platform.processor(),
    }
    for package in ("torch", "deepspeed"):
        try:
            env[package] = md.version(package)
        except md.PackageNotFoundError:
            env[package] = None
    env["deepspeed_fp16"] = None
    if env["deepspeed"] is not None:
        from .adapters.deepspeed_zero import deepspeed_fp16_supported

        env["deepspeed_fp16"] = deepspeed_fp16_supported()
    return env


def _cpu_model() -> str:
    """The processor's model name as the kernel reports it (``/proc/cpuinfo``), or ""."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _processor_line(env: dict[str, Any]) -> str:
    """Which processor the matrix ran on, and what DeepSpeed's fp16 answer there changes."""
    where = f"Processor: {env.get('processor') or 'unknown'}."
    answer = env.get("deepspeed_fp16")
    if answer is None:
        return where
    said = "supported" if answer else "not supported"
    other = ("DeepSpeed's fp16 cells would read unsupported" if answer
             else "DeepSpeed's fp16 cells would run and be judged")
    return (f"{where} DeepSpeed's accelerator reported float16 {said}; on a processor that answers "
            f"the other way (AVX512-FP16 decides on a CPU) {other}; every other cell is the same, "
            "ZeRO-3 in float64 included (it partitions a float64 model as float32 either way).")


# ---- output ------------------------------------------------------------------------------------------


def _label(cell: dict[str, Any]) -> str:
    if cell["verdict"] == "error":
        return "error"
    ratio = cell.get("error_over_tolerance")
    text = cell["verdict"]
    if ratio is not None:
        text += f" {ratio:.1e}"
    text += _findings_text(cell)
    if cell.get("first_failing_step"):
        text += f" (step {cell['first_failing_step']}, {cell['first_failing_contract']})"
    return text


def _findings_text(cell: dict[str, Any]) -> str:
    """The suffix " (N findings)" of a cell whose run had findings (values right, traffic or memory off
    the model's), else nothing."""
    n = cell.get("findings")
    return f" ({n} finding{'s' if n != 1 else ''})" if n else ""


def _resume_label(cell: dict[str, Any]) -> str:
    if cell["verdict"] == "error":
        return "error"
    text = f"{cell['verdict']} (C-ZERO-007 {cell['resumed']}"
    if cell.get("error_over_tolerance") is not None:
        text += f" {cell['error_over_tolerance']:.1e}"
    text += ")" + _findings_text(cell)
    if cell.get("first_failing_step"):
        text += f" step {cell['first_failing_step']}, {cell['first_failing_contract']}"
    not_resumed = [name for name, status in (cell.get("phases") or {}).items() if status != "ran"]
    if not_resumed:
        text += f"; not resumed: {', '.join(not_resumed)}"
    return text


def render_resume_markdown(matrix: dict[str, Any]) -> list[str]:
    """The resume column: one row per adapter, one column per (saved world -> resumed world)."""
    cells = matrix.get("resume_cells") or []
    if not cells:
        return []
    pairs = [tuple(p) for p in matrix["resume_pairs"]]
    by = {(c["adapter"], c["world"], c["resume_world"]): c for c in cells}
    lines = [
        "",
        f"## Resume (C-ZERO-007): each phase saved after its step {matrix.get('resume_at', RESUME_AT)}, "
        "loaded on fresh ranks",
        "",
        "Cell: the run's verdict (every contract), C-ZERO-007's status and its max error / tolerance over "
        "the continued steps (the round trip right after loading is judged bitwise), and the first "
        "failing step and contract.",
        "",
        "| adapter | " + " | ".join(f"{n} -> {m}" for n, m in pairs) + " |",
        "|---|" + "---|" * len(pairs),
    ]
    for name in matrix["adapters"]:
        row = [_resume_label(by[(name, n, m)]) if (name, n, m) in by else "-" for n, m in pairs]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    notes = []
    for c in cells:
        where = f"{c['adapter']} {c['world']} -> {c['resume_world']}"
        if c["verdict"] == "error":
            notes.append(f"- {where}: {c['error']}")
            continue
        for cid, why in c.get("reasons", {}).items():
            if c["contracts"].get(cid) == "fail" or cid == "C-ZERO-007":
                notes.append(f"- {where}: {cid} {c['contracts'].get(cid)}: {why}")
        for phase, status in (c.get("phases") or {}).items():
            if status not in ("ran", None):
                notes.append(f"- {where}: {phase} phase: {status}")
    if notes:
        lines += ["", "### Resume findings", "", *notes]
    return lines


def render_markdown(matrix: dict[str, Any]) -> str:
    if not matrix["cells"]:
        env = matrix["environment"]
        precision_only = bool(matrix.get("precision_cells")) and not matrix.get("resume_cells")
        kind = "mixed-precision" if precision_only else "resume"
        # a mixed-precision matrix runs in the precisions of its columns, not in the matrix's dtype
        dtypes = (" / ".join(sorted({str(p[0]) for p in matrix.get("precision_pairs") or []}))
                  if precision_only else matrix["dtype"])
        head = [
            f"# Peers' {kind} matrix ({dtypes}, {matrix['device']}, "
            f"{matrix['steps_per_cell']} steps per phase)",
            "",
            f"Generated {matrix['generated_utc']} with torch {env.get('torch')}, deepspeed "
            f"{env.get('deepspeed')}, Python {env.get('python')} on {env.get('machine')}.",
            "",
            _processor_line(env),
        ]
        tail = []
        if matrix.get("not_installed"):
            tail = ["", f"Not installed here (not run): {', '.join(matrix['not_installed'])}."]
        return "\n".join(head + render_resume_markdown(matrix) + render_accum_markdown(matrix)
                         + render_precision_markdown(matrix) + tail) + "\n"
    cells = {(c["adapter"], c["optimizer"], c["world"]): c for c in matrix["cells"]}
    cols = [(o, w) for w in matrix["worlds"] for o in matrix["optimizers"]]
    mesh_cells = {(c["adapter"], c["optimizer"], c["world"]): c for c in matrix.get("mesh_cells", [])}
    mesh_cols = [(o, w) for w in matrix.get("mesh_worlds", []) for o in matrix["optimizers"]]
    env = matrix["environment"]
    lines = [
        f"# Peers' verdict matrix ({matrix['dtype']}, {matrix['device']}, {matrix['steps_per_cell']} steps "
        f"per cell)",
        "",
        f"Generated {matrix['generated_utc']} with torch {env.get('torch')}, "
        f"deepspeed {env.get('deepspeed')}, "
        f"Python {env.get('python')} on {env.get('machine')}. Cell: verdict, max error / tolerance of "
        "C-ZERO-002 (below 1 passes), and the first failing step and contract.",
        "",
        _processor_line(env),
        "",
        "| adapter | " + " | ".join([*(f"{o} @ {w}" for o, w in cols),
                                       *(f"{o} @ {w}, mesh {w}x1" for o, w in mesh_cols)]) + " |",
        "|---|" + "---|" * (len(cols) + len(mesh_cols)),
    ]
    for name in matrix["adapters"]:
        row = [_label(cells[(name, o, w)]) if (name, o, w) in cells else "-" for o, w in cols]
        row += [_label(mesh_cells[(name, o, w)]) if (name, o, w) in mesh_cells else "-" for o, w in mesh_cols]
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += [
        "",
        "## Contracts per cell",
        "",
        "| adapter | optimizer | world | 001 | 002 | 003 | 004 | 005 | max error | tolerance | arithmetic "
        "| wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in [*matrix["cells"], *matrix.get("mesh_cells", [])]:
        st = c.get("contracts", {})
        short = [
            st.get(f"C-ZERO-00{i}", c["verdict"] if c["verdict"] == "error" else "-") for i in range(1, 6)
        ]
        err = f"{c['max_error']:.2e}" if c.get("max_error") is not None else "-"
        tol = f"{c['tolerance']:.2e}" if c.get("tolerance") is not None else "-"
        world = f"{c['world']} (mesh {c['mesh'][0]}x{c['mesh'][1]})" if c.get("mesh") else c["world"]
        lines.append(
            f"| {c['adapter']} | {c['optimizer']} | {world} | "
            + " | ".join(short)
            + f" | {err} | {tol} | {c.get('arithmetic') or '-'} | {c['wall_s']:.1f} |"
        )
    every = [*matrix["cells"], *matrix.get("mesh_cells", [])]
    notes = [c for c in every if c["verdict"] in ("fail", "error")]
    if notes:
        lines += ["", "## Failures and errors", ""]
        for c in notes:
            why = c.get("error") or "; ".join(
                f"{k}: {v}" for k, v in c.get("reasons", {}).items() if c["contracts"].get(k) == "fail"
            )
            lines.append(f"- {c['adapter']} {c['optimizer']} world {c['world']}: {why}")
    skipped = sorted(
        {
            f"{k}: {v}"
            for c in matrix["cells"]
            for k, v in c.get("reasons", {}).items()
            if c.get("contracts", {}).get(k) == "skipped"
        }
    )
    if skipped:
        lines += ["", "## Skipped contracts", ""] + [f"- {s}" for s in skipped]
    lines += render_resume_markdown(matrix)
    lines += render_accum_markdown(matrix)
    lines += render_precision_markdown(matrix)
    if matrix.get("not_installed"):
        lines += ["", f"Not installed here (not run): {', '.join(matrix['not_installed'])}."]
    return "\n".join(lines) + "\n"


def render_heatmap(matrix: dict[str, Any], path: Path) -> None:
    """log10(max error / tolerance) of C-ZERO-002 per cell (green far below the bound, red at or above
    it), grey for a run that ended in an error; a red frame marks a cell whose verdict is "fail" (any
    contract, e.g. C-ZERO-005 with C-ZERO-002 well within its bound)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.patches import Rectangle

    cols = [(o, w) for w in matrix["worlds"] for o in matrix["optimizers"]]
    rows = matrix["adapters"]
    cells = {(c["adapter"], c["optimizer"], c["world"]): c for c in matrix["cells"]}
    values = np.full((len(rows), len(cols)), np.nan)
    for i, name in enumerate(rows):
        for j, (o, w) in enumerate(cols):
            ratio = cells.get((name, o, w), {}).get("error_over_tolerance")
            if ratio is not None and ratio > 0:
                values[i, j] = math.log10(ratio)
    fig, ax = plt.subplots(figsize=(2.2 + 1.9 * len(cols), 1.0 + 0.55 * len(rows)))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="#bbbbbb")
    image = ax.imshow(
        np.ma.masked_invalid(values), cmap=cmap, norm=TwoSlopeNorm(vmin=-6, vcenter=0, vmax=2), aspect="auto"
    )
    for i, name in enumerate(rows):
        for j, (o, w) in enumerate(cols):
            cell = cells.get((name, o, w))
            if cell is None:
                continue
            text = cell["verdict"]
            if cell["verdict"] == "fail":
                ax.add_patch(
                    Rectangle(
                        (j - 0.46, i - 0.44), 0.92, 0.88, fill=False, edgecolor="#b00000", linewidth=2.5
                    )
                )
            if cell.get("first_failing_step"):
                text += f"\n{cell['first_failing_contract']} step {cell['first_failing_step']}"
            elif not math.isnan(values[i, j]):
                text += f"\n{cell['error_over_tolerance']:.0e}"
            ax.text(j, i, text, ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(cols)), [f"{o}\nworld {w}" for o, w in cols])
    ax.set_yticks(range(len(rows)), rows)
    ax.set_title(f"zerosim verify --all: max error / tolerance (log10), {matrix['dtype']}")
    fig.colorbar(image, ax=ax, label="C-ZERO-002: log10(max error / tolerance); >= 0 fails")
    fig.tight_layout()
    try:
        save_figure(fig, path, dpi=110)
    finally:
        plt.close(fig)


def write_matrix(matrix: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``verify-matrix.json``, ``.md`` and ``.png`` under ``out_dir``; a matrix of the resume column
    alone goes to ``verify-resume-matrix.json`` and ``.md``. Each file is written next to its
    target and renamed over it (:mod:`zerosim.outputs`)."""
    out = Path(out_dir)
    stem = "verify-matrix" if matrix["cells"] else (
        "verify-precision-matrix" if matrix.get("precision_cells") and not matrix.get("resume_cells")
        else "verify-resume-matrix")
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    write_text(paths["json"], json.dumps(matrix, indent=1) + "\n")
    write_text(paths["md"], render_markdown(matrix))
    if matrix["cells"]:
        paths["png"] = out / "verify-matrix.png"
        render_heatmap(matrix, paths["png"])
    return paths


def matrix_exit_code(matrix: dict[str, Any]) -> int:
    """3 if a cell's run failed outright (a rank failed, hung, or the peer rejected the run), 1 if a
    contract failed, else 0."""
    verdicts = {c["verdict"] for c in [*matrix["cells"], *matrix.get("resume_cells", []),
                                        *matrix.get("mesh_cells", []), *matrix.get("accum_cells", []),
                                        *matrix.get("precision_cells", [])]}
    return 3 if "error" in verdicts else 1 if "fail" in verdicts else 0


def run_all(
    *,
    worlds: Sequence[int] = WORLDS,
    dtype: str = "float64",
    device: str = "cpu",
    out_dir: str | Path,
    adapters: Sequence[str] | None = None,
    timeout_s: float | None = None,
    echo: Any = print,
    optimizers: Sequence[str] = OPTIMIZER_PHASES,
    resume_pairs: Sequence[tuple[int, int]] = RESUME_PAIRS,
    mesh_worlds: Sequence[int] = MESH_WORLDS,
    accum_pairs: Sequence[tuple[int, int]] = ACCUM_CELLS,
    precision_pairs: Sequence[tuple[str, int]] = PRECISION_CELLS,
) -> int:
    """``zerosim verify --all``: run the matrix, write it, print one line per cell; the exit status."""

    def progress(cell: dict[str, Any]) -> None:
        if "resume_world" in cell:
            what = f"resume {cell['world']}->{cell['resume_world']}: {_resume_label(cell)}"
        elif "mesh" in cell:
            what = f"{cell['optimizer']:<6} world {cell['world']} mesh {cell['world']}x1: {_label(cell)}"
        elif "grad_accum" in cell:
            what = f"accum {cell['grad_accum']} @ {cell['world']}: {_accum_label(cell)}"
        elif "precision" in cell:
            what = progress_line(cell)
        else:
            what = f"{cell['optimizer']:<6} world {cell['world']}: {_label(cell)}"
        echo(
            f"{cell['adapter']:<14} {what} [{cell['wall_s']:.1f} s]"
            + (f" {cell['error']}" if cell.get("error") else "")
        )

    from zerogpu.fork_server import serving_launches

    with serving_launches():  # one torch import for all the matrix's launches
        matrix = run_matrix(
            adapters,
            optimizers=optimizers,
            worlds=worlds,
            dtype=dtype,
            device=device,
            timeout_s=timeout_s,
            progress=progress,
            resume_pairs=resume_pairs,
            mesh_worlds=mesh_worlds,
            accum_pairs=accum_pairs,
            precision_pairs=precision_pairs,
        )
    paths = write_matrix(matrix, out_dir)
    echo("wrote " + ", ".join(str(p) for p in paths.values()))
    return matrix_exit_code(matrix)


def run_cli(args: Any, timeout_s: float | None) -> int:
    """The ``--all`` branch of ``zerosim verify``: ``--out`` (default a new
    ``reports/verify-matrix-<timestamp>/``), ``--dtype``,
    ``--device`` and ``--timeout`` apply to every cell; the worlds are 2 and 4, the resume pairs
    2 -> 3 and 4 -> 2, the steps and model the defaults. ``--resume-matrix``: the resume column
    alone. Every option is checked, and the output directory made, before the first cell."""
    from zerosim.outputs import output_dir

    from .runner import validate_options

    resume_only = bool(getattr(args, "resume_matrix", False))
    fixed = (("target", args.target, None), ("world", args.world, None), ("steps", args.steps, None),
             ("model", args.model, "gpt"), ("optimizers", args.optimizers, "sgd,adamw"),
             ("resume_at", getattr(args, "resume_at", None), None),
             ("resume_world", getattr(args, "resume_world", None), None),
             ("mesh", getattr(args, "mesh", None), None), ("strict", getattr(args, "strict", False), False),
             ("allow_world_1", getattr(args, "allow_world_1", False), False),
             ("precision", getattr(args, "precision", None), None),
             ("reduce_dtype", getattr(args, "reduce_dtype", None), None))
    what = "--resume-matrix" if resume_only else "--all"
    for flag, value, default in fixed:
        if value != default:
            raise ConfigError(flag, value, f"{what} runs every installed adapter at world 2 and 4 (resumed "
                              "2 -> 3 and 4 -> 2) with the default steps, model and optimizers; drop it, "
                              f"or drop {what}")
    dtype, device = getattr(args, "dtype", None) or "float64", getattr(args, "device", "cpu")
    validate_options(world=2, steps=None, dtype=dtype, device=device, model="gpt",
                     optimizers="sgd,adamw", timeout_s=timeout_s)
    name = "verify-resume-matrix" if resume_only else "verify-matrix"
    out_dir = output_dir(getattr(args, "out", None), name)
    if resume_only:
        return run_all(dtype=dtype, device=device, out_dir=out_dir, timeout_s=timeout_s, optimizers=(),
                       worlds=(), mesh_worlds=(), accum_pairs=(), precision_pairs=())
    return run_all(dtype=dtype, device=device, out_dir=out_dir, timeout_s=timeout_s)


def _timed_verify(cell: dict[str, Any], adapter: str, **options: Any) -> VerifyReport | None:
    """``verify(adapter, **options)`` with its wall time in ``cell``; None (``cell`` marked "error" with
    the one-line reason) when it ends in a ZeroSimError."""
    from . import verify

    start = time.perf_counter()
    try:
        report = verify(adapter, **options)
    except ZeroSimError as e:
        cell.update(verdict="error", error=f"{type(e).__name__}: {e}", wall_s=time.perf_counter() - start)
        return None
    cell["wall_s"] = time.perf_counter() - start
    return report


def _failing_steps(report: Any) -> tuple[int, str] | None:
    """(step, contract) of the earliest violation in ``report`` (ties: the lowest contract id), or None."""
    failing = [
        (v["step"], cid)
        for cid, o in report.contracts.items()
        if o.status == "fail"
        for v in o.violations
        if v.get("step") is not None
    ]
    return min(failing) if failing else None
