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

The optimizer columns (``adam @ 2``, ``adafactor @ 2``, ``muon @ 2``): every adapter with each
optimizer of :data:`OPTIMIZER_CELLS` beyond the default phases, one cell each at world 2, so a
framework's answer for a matrix optimizer (its own, or torch's on its shards) is shown as it is: a
verdict with the diagnosis, or ``unsupported`` with the framework's reason. The model column
(``moe @ 2``): both default phases on the built-in mixture of experts (``--model moe``).

The mixed-precision columns (``bf16 @ 4``, ``fp16 @ 4``): :mod:`zerosim.verify.matrix_precision`.

A cell counts its findings (traffic or memory off the declared strategy's model in a run whose values
are right; the cell passes and says how many). A cell whose run ends with an error (a rank failed, the
peer rejected the configuration) is kept as ``"error"`` with its one-line message: a peer that fails
is reported, never dropped.

The cells are :mod:`zerosim.verify.matrix_cells`, the renderings :mod:`zerosim.verify.matrix_render`;
this module runs them in order, writes the files and gives the exit status.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zerosim.errors import ConfigError
from zerosim.files.outputs import write_text

from .adapters import ADAPTERS, HYBRID_ADAPTERS, installed_adapters
from .matrix_cells import (
    ACCUM_CELLS,
    MESH_WORLDS,
    MODEL_CELLS,
    OPTIMIZER_CELLS,
    OPTIMIZER_PHASES,
    PHASE_STEPS,
    RESUME_AT,
    RESUME_PAIRS,
    WORLDS,
    run_accum_cell,
    run_cell,
    run_model_cell,
    run_resume_cell,
)
from .matrix_precision import PRECISION_CELLS, progress_line, run_precision_cell
from .matrix_render import (
    _accum_label,
    _label,
    _resume_label,
    column_label,
    columns_only,
    render_heatmap,
    render_markdown,
)

__all__ = [
    "ACCUM_CELLS", "MESH_WORLDS", "MODEL_CELLS", "OPTIMIZER_CELLS", "OPTIMIZER_PHASES", "PHASE_STEPS",
    "PRECISION_CELLS", "RESUME_AT", "RESUME_PAIRS", "WORLDS", "matrix_exit_code", "render_heatmap",
    "render_markdown", "run_accum_cell", "run_all", "run_cell", "run_cli", "run_matrix", "run_model_cell",
    "run_resume_cell", "write_matrix",
]


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
    optimizer_pairs: Sequence[tuple[str, int]] = (),
    model_pairs: Sequence[tuple[str, int]] = (),
) -> dict[str, Any]:
    """Every cell of the matrix (see the module docstring), the mesh column (hybrid adapters on the
    (world, 1) mesh for each world in ``mesh_worlds``), the optimizer and model columns, then the
    resume column for each pair in ``resume_pairs``, the accumulation and the mixed-precision columns;
    ``progress(cell)`` is called after each."""
    names = list(adapters) if adapters is not None else installed_adapters()
    for name in names:
        if name not in ADAPTERS:
            raise ConfigError("adapter", name, f"not a built-in adapter; known: {', '.join(ADAPTERS)}")
    columns: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("cells", "mesh_cells", "optimizer_cells", "model_cells", "resume_cells",
                        "accum_cells", "precision_cells")}

    def keep(column: str, cell: dict[str, Any]) -> None:
        columns[column].append(cell)
        if progress is not None:
            progress(cell)

    common: dict[str, Any] = {"steps": steps, "device": device, "timeout_s": timeout_s}
    for name in names:
        for world in worlds:
            for optimizer in optimizers:
                keep("cells", run_cell(name, optimizer, world, dtype=dtype, **common))
        for world in mesh_worlds if name in HYBRID_ADAPTERS else ():
            for optimizer in optimizers:
                keep("mesh_cells", run_cell(name, optimizer, world, dtype=dtype, mesh=(world, 1), **common))
        for optimizer, world in optimizer_pairs:
            keep("optimizer_cells", {**run_cell(name, optimizer, world, dtype=dtype, **common),
                                     "column": "optimizer"})
        for model, world in model_pairs:
            keep("model_cells", run_model_cell(name, model, world, dtype=dtype, **common))
        for n, m in resume_pairs:
            keep("resume_cells", run_resume_cell(name, n, m, dtype=dtype, **common))
        for k, n in accum_pairs:
            keep("accum_cells", run_accum_cell(name, k, n, dtype=dtype, **common))
        for precision, n in precision_pairs:
            keep("precision_cells", run_precision_cell(name, precision, n, **common))
    cells, resume_cells, mesh_cells = columns["cells"], columns["resume_cells"], columns["mesh_cells"]
    accum_cells, precision_cells = columns["accum_cells"], columns["precision_cells"]
    optimizer_cells, model_cells = columns["optimizer_cells"], columns["model_cells"]
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
        "optimizer_pairs": [list(p) for p in optimizer_pairs],
        "optimizer_cells": optimizer_cells,
        "model_pairs": [list(p) for p in model_pairs],
        "model_cells": model_cells,
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

def write_matrix(matrix: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """``verify-matrix.json``, ``.md`` and ``.png`` under ``out_dir``; a matrix of the resume column
    alone goes to ``verify-resume-matrix.json`` and ``.md``, of the mixed-precision columns alone
    to ``verify-precision-matrix.*``, of the optimizer and model columns alone to
    ``verify-columns-matrix.*``. Each file is written next to its
    target and renamed over it (:mod:`zerosim.files.outputs`)."""
    out = Path(out_dir)
    stem = "verify-matrix" if matrix["cells"] else "verify-columns-matrix" if columns_only(matrix) else (
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
                                        *matrix.get("precision_cells", []),
                                        *matrix.get("optimizer_cells", []), *matrix.get("model_cells", [])]}
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
    optimizer_pairs: Sequence[tuple[str, int]] = OPTIMIZER_CELLS,
    model_pairs: Sequence[tuple[str, int]] = MODEL_CELLS,
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
        elif "model" in cell:
            what = f"{cell['model']} @ {cell['world']}: {column_label(cell)}"
        elif cell.get("column"):
            what = f"{cell['optimizer']:<9} world {cell['world']}: {column_label(cell)}"
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
            optimizer_pairs=optimizer_pairs,
            model_pairs=model_pairs,
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
    from zerosim.files.outputs import output_dir

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
                       worlds=(), mesh_worlds=(), accum_pairs=(), precision_pairs=(), optimizer_pairs=(),
                       model_pairs=())
    return run_all(dtype=dtype, device=device, out_dir=out_dir, timeout_s=timeout_s)
