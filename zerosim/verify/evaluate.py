"""Rank 0's evaluation of a ``zerosim verify`` run: reference, bounds, checks, diagnosis -> VerifyReport.

For every phase that ran, the reference (:mod:`zerosim.verify.reference`) replays the phase from the
same initial model on the global batches, the error model (:mod:`zerosim.checks.tolerance`) derives
each step's per-element bound in the trainer's arithmetic dtype (float32 when the run is float32,
or when the trainer keeps float32 master weights of a float64 model: every parameter exactly
float32-representable after every step), and the contracts' checks (:mod:`zerosim.checks`:
C-ZERO-001 :func:`~zerosim.checks.partition_ranges.check_partition_ranges`, C-ZERO-002
:func:`~zerosim.checks.equivalence.check_step_equivalence`, C-ZERO-003
:func:`~zerosim.checks.identity.check_replica_identity`, C-ZERO-008
:func:`~zerosim.checks.logged_norm.check_logged_norm` on the logged gradient norm) and the diagnosis
(:mod:`zerosim.verify.diagnosis`) run on the result.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from zerosim import datafile
from zerosim.checks.equivalence import check_step_equivalence, float32_masters
from zerosim.checks.identity import check_replica_identity
from zerosim.checks.logged_norm import check_logged_norm
from zerosim.checks.partition_ranges import check_partition_ranges
from zerosim.checks.tolerance import ErrorModel, unit_roundoff
from zerosim.observe import TrainerObservation

from .model_source import model_source
from .observation import StepRecord
from .outcome import ContractOutcome, VerifyReport
from .reference import Reference
from .resume import ResumeRun, check_resume
from .suite import Phase


def build_records(
    phases: list[Phase],
    phase_info: list[dict[str, Any]],
    observations: dict[int, list[TrainerObservation]],
    base: torch.nn.Module,
    *,
    world: int,
    dtype: str,
    model_name: str,
    seed: int,
    resume: ResumeRun | None = None,
    grad_accum: int = 1,
) -> list[StepRecord]:
    """Reference and bounds beside every observed step; notes per phase the arithmetic dtype judged
    and the steps where the clip bound, in ``phase_info``. With ``resume``, the reference's batches
    after the resume are the new world's, and the bound's reduction length is the larger world's. Under
    accumulation the reference averages all ``grad_accum`` x world micro-batches, and the bound's
    reduction length counts them all (K x world local gradients are added)."""
    source = model_source(model_name, seed)
    cfg = source.sizes()
    info = {p["name"]: p for p in phase_info}
    records: list[StepRecord] = []
    for phase in phases:
        if info.get(phase.name, {}).get("status") != "ran":
            continue
        steps = [observations[s] for s in phase.step_numbers]
        masters32 = dtype == "float64" and float32_masters(steps)
        arithmetic = "float32" if dtype == "float32" or masters32 else "float64"
        ref = Reference(
            base,
            phase.optim,
            world,
            model_name=model_name,
            seed=seed,
            phase=phase.name,
            data_offset=phase.data_offset,
            resume=(resume.last_step_before(phase.first_step), resume.world_after) if resume else None,
            grad_accum=grad_accum,
            source=source,
        )
        bound_world = max(world, resume.world_after) if resume else world
        model = ErrorModel(phase.optim, arithmetic, cfg, bound_world * grad_accum, rounded_start=masters32)
        binds = []
        for s, ranks in zip(phase.step_numbers, steps, strict=True):
            ref_step = ref.step(s)
            if ref_step.clip_bound:
                binds.append(s)
            records.append(StepRecord(ref_step, model.step(ref_step), ranks))
        info[phase.name]["arithmetic"] = arithmetic
        if masters32:
            info[phase.name]["master_dtype"] = "float32"
        if phase.optim.get("max_grad_norm") is not None:
            info[phase.name]["clip_binds_at"] = binds
    return records


def evaluate(
    *,
    target: str,
    world: int,
    dtype: str,
    device: str,
    model_name: str,
    seed: int,
    phases: list[Phase],
    phase_info: list[dict[str, Any]],
    observations: dict[int, list[TrainerObservation]],
    base: torch.nn.Module,
    numels: dict[str, int],
    resources: dict[str, ContractOutcome] | None = None,
    resume: ResumeRun | None = None,
    grad_accum: int = 1,
) -> VerifyReport:
    from .diagnosis import diagnose

    records = build_records(
        phases,
        phase_info,
        observations,
        base,
        world=world,
        dtype=dtype,
        model_name=model_name,
        seed=seed,
        resume=resume,
        grad_accum=grad_accum,
    )
    contracts: dict[str, ContractOutcome] = {}
    if records:
        contracts["C-ZERO-001"] = ContractOutcome.from_verdict(check_partition_ranges(records, numels))
        contracts["C-ZERO-002"] = ContractOutcome.from_verdict(check_step_equivalence(records))
        contracts["C-ZERO-003"] = ContractOutcome.from_verdict(check_replica_identity(records))
        roundoff = {p["name"]: unit_roundoff(p["arithmetic"]) for p in phase_info if "arithmetic" in p}
        contracts["C-ZERO-008"] = ContractOutcome.from_verdict(check_logged_norm(records, roundoff))
    else:
        why = "every phase was skipped: " + "; ".join(p.get("reason", "") for p in phase_info)
        for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-008"):
            contracts[cid] = ContractOutcome("skipped", why)
    for cid in ("C-ZERO-004", "C-ZERO-005"):
        contracts[cid] = (resources or {}).get(cid) or ContractOutcome(
            "skipped",
            "no phase ran with a declared strategy (declared_strategy): memory and traffic have no "
            "model to be compared with",
        )
    if resume is not None:
        contracts["C-ZERO-007"] = check_resume(records, resume, {p.name: p.first_step for p in phases})
        if not resume.after_load:
            why = "; ".join(p.get("reason", "") for p in phase_info if p.get("reason"))
            contracts["C-ZERO-007"] = ContractOutcome("skipped", f"no phase resumed: {why}")
    total = sum(p.steps for p in phases)
    report = VerifyReport(
        target, world, total, dtype, contracts, diagnose(records, contracts), device, model_name, phase_info
    )
    if resume is not None:
        report.extra["resume"] = resume.to_json()
    if grad_accum > 1:
        report.extra["grad_accum"] = grad_accum
    return report


#: the dataclasses a saved run is made of (:func:`zerosim.datafile.load` rebuilds these and no other)
SAVED_TYPES = (Phase, TrainerObservation, ContractOutcome)


def save_observations(path: str, run: dict[str, Any]) -> None:
    """Store what :func:`evaluate` needs besides the model (rebuilt from its name and seed) in ``path``
    as plain data (:mod:`zerosim.datafile`)."""
    datafile.save(path, run)


def evaluate_saved(path: str) -> VerifyReport:
    """Re-evaluate a run saved with ``--save-observations``. The file is read as plain data (no code
    runs, whoever wrote it); DataFileError when it is not a saved run."""
    run = datafile.load(path, types=SAVED_TYPES)
    accepted = set(inspect.signature(evaluate).parameters) - {"base", "resume"}
    needed = {"model_name", "dtype", "seed", "phases", "observations"}
    if not isinstance(run, dict) or not needed <= set(run) <= accepted:
        raise datafile.DataFileError(f"{path}: not a run saved by --save-observations")
    base = model_source(run["model_name"], run["seed"]).build(run["dtype"])
    return evaluate(base=base, **run)
