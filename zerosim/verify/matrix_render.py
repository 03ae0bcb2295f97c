"""The renderings of ``zerosim verify --all``: markdown tables and the heat map, each read from the
same cell values (:mod:`zerosim.verify.matrix_cells`).

The main table is adapter x (optimizer @ world), the mesh column beside it; then each contract per
cell, failures, skipped contracts, and the optimizer, model, resume, accumulation and mixed-precision
columns, each a table of its own with the reasons behind its failures and refusals.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from zerosim.files.outputs import save_figure

from .matrix_cells import RESUME_AT
from .matrix_precision import render_precision_markdown


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
        if columns_only(matrix):
            precision_only, kind = False, "optimizer and model"
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
        return "\n".join(head + render_columns_markdown(matrix) + render_resume_markdown(matrix)
                         + render_accum_markdown(matrix)
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
    lines += render_columns_markdown(matrix)
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


def columns_only(matrix: dict[str, Any]) -> bool:
    """True for a matrix of the optimizer and model columns alone."""
    others = ("cells", "resume_cells", "accum_cells", "precision_cells", "mesh_cells")
    return bool(matrix.get("optimizer_cells") or matrix.get("model_cells")) and not any(
        matrix.get(k) for k in others)


def refusal(reason: str | None) -> str:
    """The adapter's own words from a skipped phase's reason ("make_trainer raised NotImplementedError
    (WORDS) for PHASE" -> WORDS)."""
    text = reason or ""
    head = "raised NotImplementedError ("
    if head in text:
        text = text.split(head, 1)[1]
        text = text.rsplit(")", 1)[0] if ")" in text else text
    return text


def column_label(cell: dict[str, Any]) -> str:
    """An optimizer or model cell as one short text: verdict, C-ZERO-002's max error / tolerance, the
    first failing step and contract and the diagnosis; for a refused phase, ``unsupported:`` and the
    framework's words."""
    if cell["verdict"] == "error":
        return "error"
    if cell["verdict"] == "unsupported":
        return f"unsupported: {refusal(cell.get('unsupported'))}"
    text = _label(cell)
    if cell.get("diagnosis"):
        text += f"; {', '.join(cell['diagnosis'])}"
    return text


def render_columns_markdown(matrix: dict[str, Any]) -> list[str]:
    """The optimizer columns (one optimizer phase per cell) and the model columns (both default phases
    on another model): one row per adapter, then every failure's and refusal's evidence."""
    opt_cells = matrix.get("optimizer_cells") or []
    model_cells = matrix.get("model_cells") or []
    if not opt_cells and not model_cells:
        return []
    opt_pairs = [tuple(p) for p in matrix.get("optimizer_pairs") or []]
    model_pairs = [tuple(p) for p in matrix.get("model_pairs") or []]
    by_opt = {(c["adapter"], c["optimizer"], c["world"]): c for c in opt_cells}
    by_model = {(c["adapter"], c["model"], c["world"]): c for c in model_cells}
    heads = [*(f"{o} @ {w}" for o, w in opt_pairs), *(f"--model {m} @ {w}" for m, w in model_pairs)]
    lines = ["", "## Optimizers beyond SGD and AdamW, and other models", "",
             "Cell: verdict, C-ZERO-002's max error / tolerance (an estimated bound for adafactor and muon), "
             "the first failing step and contract, and the diagnosis; `unsupported:` and the framework's "
             "own words where the adapter refuses the phase. The model cells run both default phases.", "",
             "| adapter | " + " | ".join(heads) + " | wall s |", "|---|" + "---|" * (len(heads) + 1)]
    for name in matrix["adapters"]:
        row = [column_label(by_opt[(name, o, w)]) if (name, o, w) in by_opt else "-" for o, w in opt_pairs]
        row += [column_label(by_model[(name, m, w)]) if (name, m, w) in by_model else "-"
                for m, w in model_pairs]
        walls = [f"{c['wall_s']:.1f}" for c in [*(by_opt.get((name, o, w)) for o, w in opt_pairs),
                                                  *(by_model.get((name, m, w)) for m, w in model_pairs)]
                 if c is not None]
        lines.append(f"| {name} | " + " | ".join(row) + f" | {' / '.join(walls) or '-'} |")
    notes = []
    for c in [*opt_cells, *model_cells]:
        where = f"{c['adapter']} {c.get('optimizer') or '--model ' + str(c.get('model'))} @ {c['world']}"
        if c["verdict"] == "error":
            notes.append(f"- {where}: {c['error']}")
            continue
        if c.get("unsupported"):
            notes.append(f"- {where}: unsupported: {c['unsupported']}")
        notes += [f"- {where}: {cid} {c['contracts'].get(cid)}: {why}"
                  for cid, why in (c.get("reasons") or {}).items()
                  if c["contracts"].get(cid) in ("fail", "finding")]
        notes += [f"- {where}: diagnosis {cls}: {ev}"
                  for cls, ev in zip(c.get("diagnosis") or [], c.get("evidence") or [], strict=False)]
    return lines + (["", "### Evidence behind these columns", "", *notes] if notes else [])
