"""The cells of ``zerosim verify --all``: each one a :func:`zerosim.verify.verify` launch, kept as plain data.

A cell records the run's verdict, each contract's status, the worst C-ZERO-002 error over its bound,
the first failing step and contract, the diagnosis and the wall time. A run that ends in an error (a
rank failed, the peer rejected the configuration) is a cell ``"error"`` with its one-line message; a
phase the adapter refuses (``NotImplementedError``) keeps its reason, so a refusal reads
``unsupported`` with the framework's own words, not as a crash.

Kinds of cell: an optimizer phase at a world size, optionally on a mesh (:func:`run_cell`); both
default phases on another model (:func:`run_model_cell`); resumed at another world size
(:func:`run_resume_cell`); with gradient accumulation (:func:`run_accum_cell`). The mixed-precision
cells are in :mod:`zerosim.verify.matrix_precision`.
"""

from __future__ import annotations

import time
from typing import Any

from zerosim.errors import ZeroSimError

from .outcome import VerifyReport

OPTIMIZER_PHASES = ("sgd", "adamw")
WORLDS = (2, 4)
PHASE_STEPS = 4  # each phase's length in the default two-phase suite (8 steps)
RESUME_PAIRS = ((2, 3), (4, 2))  # (world saved at, world resumed at) of the resume column
RESUME_AT = 2  # each phase resumes after this many of its steps
MESH_WORLDS = (4,)  # the mesh column: hybrid adapters on the (world, 1) mesh at these world sizes
ACCUM_CELLS = ((3, 4),)  # (micro-batches per step, world) of the accumulation column
#: (optimizer, world) of the optimizer columns: the optimizers beyond the default phases, one cell each
OPTIMIZER_CELLS = (("adam", 2), ("adafactor", 2), ("muon", 2))
#: (model, world) of the model columns: both default phases on that built-in model
MODEL_CELLS = (("moe", 2),)

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
        evidence=[d.evidence for d in report.diagnosis],
        unsupported=phase.get("reason") if phase.get("status") == "skipped" else None,
    )
    return cell


def run_model_cell(
    adapter: str,
    model: str,
    world: int,
    *,
    steps: int = PHASE_STEPS,
    dtype: str = "float64",
    device: str = "cpu",
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """One model cell: both default phases of ``steps`` each at ``world`` ranks on the built-in
    ``model`` (``--model``)."""
    cell: dict[str, Any] = {"adapter": adapter, "model": model, "world": world,
                            "steps": steps * len(OPTIMIZER_PHASES)}
    report = _timed_verify(cell, adapter, world=world, steps=steps * len(OPTIMIZER_PHASES), dtype=dtype,
                           device=device, timeout_s=timeout_s, model=model)
    if report is None:
        return cell
    eq = report.contracts.get("C-ZERO-002")
    failing = _failing_steps(report)
    skipped = {p["name"]: p.get("reason") for p in report.phases if p.get("status") == "skipped"}
    cell.update(
        verdict=report.verdict,
        contracts={cid: o.status for cid, o in report.contracts.items()},
        reasons={cid: o.reason for cid, o in report.contracts.items() if o.status != "pass"},
        error_over_tolerance=(eq.details if eq is not None else {}).get("error_over_tolerance"),
        first_failing_step=failing[0] if failing else None,
        first_failing_contract=failing[1] if failing else None,
        diagnosis=[d.bug_class for d in report.diagnosis],
        evidence=[d.evidence for d in report.diagnosis],
        findings=len(report.findings),
        unsupported="; ".join(f"{k}: {v}" for k, v in skipped.items()) or None,
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
