"""Rank 0's evaluation of a ``zerosim verify`` run: reference, bounds, checks, diagnosis -> VerifyReport.

For every phase that ran, the reference (:mod:`zerosim.verify.reference`) replays the phase from the
same initial model on the global batches, the error model (:mod:`zerosim.checks.tolerance`) derives
each step's per-element bound in the trainer's arithmetic dtype (for a matrix optimizer, Adafactor,
Muon or a user's, the per-tensor bound estimated from a perturbed twin of the reference,
:mod:`zerosim.verify.estimated_bound`) (float32 when the run is float32,
or when the trainer keeps float32 master weights of a float64 model: every parameter exactly
float32-representable after every step); under a mixed-precision policy the reference re-starts every
step under the policy (:mod:`zerosim.verify.mixed_reference`). The contracts are judged through
:func:`zerosim.checks.judges.judge` (C-ZERO-001 on the ranges, 002 on the values, 003 across the
ranks, 008 on the logged gradient norm) and the diagnosis (:mod:`zerosim.verify.diagnosis`) reads the
verdicts. C-ZERO-004 and C-ZERO-005's ``ring_model`` come judged from the ranks
(:func:`zerosim.verify.resources.resource_outcomes`); C-ZERO-005's ``reduce_dtype`` is judged here,
where each phase's arithmetic dtype is known (every gradient reduction must move that dtype), and the
two clauses make one verdict in :func:`zerosim.checks.traffic.with_reduce_dtype`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from zerosim.checks.equivalence import float32_masters
from zerosim.checks.judges import judge
from zerosim.checks.tolerance import ErrorModel, unit_roundoff
from zerosim.checks.traffic import with_reduce_dtype
from zerosim.files import datafile
from zerosim.values.observe import TrainerObservation
from zerosim.values.verdict import Verdict, Violation

from .estimated_bound import TwinBound
from .mixed_precision import DEFAULT_REDUCE_DTYPE, FULL, policy
from .model_source import model_source
from .observation import StepRecord
from .optimizers import is_elementwise
from .outcome import VerifyReport, mark_findings
from .reference import Reference
from .resume import ResumeRun, resume_outcome
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
    device: str = "cpu",
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
        model: ErrorModel | TwinBound
        if is_elementwise(phase.name):
            model = ErrorModel(phase.optim, arithmetic, cfg, bound_world * grad_accum,
                               rounded_start=masters32)
        else:  # a matrix optimizer: the bound is estimated from a perturbed twin of the reference
            model = TwinBound(base, phase.optim, arithmetic, cfg, world, source=source, phase=phase.name,
                              data_offset=phase.data_offset, resume=ref.resume, grad_accum=grad_accum,
                              bound_world=bound_world, device=device)
            info[phase.name]["bound"] = "estimated"
        binds = []
        for s, ranks in zip(phase.step_numbers, steps, strict=True):
            ref_step = ref.step(s)
            if ref_step.clip_bound:
                binds.append(s)
            records.append(StepRecord(ref_step, model.step(ref_step), ranks, dict(phase.optim)))
        info[phase.name]["arithmetic"] = arithmetic
        if isinstance(model, TwinBound) and model.bf16_twin is not None:
            info[phase.name]["bf16_twin_from_step"] = model.bf16_from
        if masters32:
            info[phase.name]["master_dtype"] = "float32"
        if phase.optim.get("max_grad_norm") is not None:
            info[phase.name]["clip_binds_at"] = binds
    return records


def reduce_dtype_verdicts(
    phases: list[Phase],
    phase_info: list[dict[str, Any]],
    observations: dict[int, list[TrainerObservation]],
    expected_dtypes: dict[str, str] | None = None,
) -> list[Verdict]:
    """C-ZERO-005 ``reduce_dtype`` per phase that ran with counted traffic: every gradient reduction moves
    the dtype the phase's policy names (``expected_dtypes[phase]``; by default the arithmetic dtype
    :func:`build_records` noted in ``phase_info``: the run's dtype, or float32 for float32 masters)."""
    info = {p["name"]: p for p in phase_info}
    verdicts = []
    for phase in phases:
        noted = info.get(phase.name, {})
        expected = (expected_dtypes or {}).get(phase.name) or noted.get("arithmetic")
        if noted.get("status") != "ran" or expected is None:
            continue
        for step in phase.step_numbers:  # one step at a time: a resumed run changes world size
            ranks = observations.get(step, [])
            per_rank = [[obs.traffic] for obs in sorted(ranks, key=lambda o: o.rank)]
            verdicts.append(
                judge("C-ZERO-005", per_rank, reduce_dtype=expected, phase=phase.name, first_step=step)
            )
    return verdicts


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
    resources: dict[str, Verdict] | None = None,
    resume: ResumeRun | None = None,
    mesh: tuple[int, int] | None = None,
    strict: bool = False,
    grad_accum: int = 1,
    precision: str = FULL,
    reduce_dtype: str = DEFAULT_REDUCE_DTYPE,
) -> VerifyReport:
    """The report of one run: the contracts judged on the records (C-ZERO-001 against ``mesh`` when the
    run names one), efficiency-only failures of a run whose values are right marked as findings
    (:func:`~zerosim.verify.outcome.mark_findings`; ``strict`` makes them fail), and the diagnosis.
    Under a mixed-precision policy the reference re-starts every step under the policy
    (:mod:`zerosim.verify.mixed_reference`), C-ZERO-002 and C-ZERO-008 are judged by the per-tensor
    normwise bounds (:mod:`zerosim.checks.mixed_precision`), every gradient reduction must move the
    policy's ``reduce_dtype`` (C-ZERO-005) and the diagnosis is the mixed-precision one."""
    from .diagnosis import diagnose, diagnose_mixed
    from .mixed_reference import mixed_records

    mesh = None if mesh is None else (int(mesh[0]), int(mesh[1]))
    mixed = policy(precision, reduce_dtype)
    records: list[Any]
    if mixed is None:
        records = build_records(phases, phase_info, observations, base, world=world, dtype=dtype,
                                model_name=model_name, seed=seed, resume=resume, grad_accum=grad_accum,
                                device=device)
        identity: list[Any] = records
        roundoff = {p["name"]: unit_roundoff(p["arithmetic"]) for p in phase_info if "arithmetic" in p}
        expected = None
    else:
        records = mixed_records(phases, phase_info, observations, base, model_source(model_name, seed), mixed,
                                world=world, grad_accum=grad_accum, resume=resume, seed=seed)
        identity = [_IdentityRecord(r.step, r.phase, r.ranks, _NamedReference(r.ref)) for r in records]
        roundoff = {}
        expected = {p.name: str(mixed["reduce_dtype"]) for p in phases}
    contracts: dict[str, Verdict] = {}
    if records:
        contracts["C-ZERO-001"] = judge("C-ZERO-001", records, numels=numels, mesh=mesh)
        contracts["C-ZERO-002"] = judge("C-ZERO-002", records)
        contracts["C-ZERO-003"] = judge("C-ZERO-003", identity)
        contracts["C-ZERO-008"] = judge("C-ZERO-008", records, roundoff)
    _add_skipped_and_resources(contracts, phase_info, resources)
    reduce_verdicts = reduce_dtype_verdicts(phases, phase_info, observations, expected)
    contracts["C-ZERO-005"] = with_reduce_dtype(contracts["C-ZERO-005"], reduce_verdicts)
    if resume is not None:
        contracts["C-ZERO-007"] = resume_outcome(records, resume, {p.name: p.first_step for p in phases})
        if not resume.after_load:
            why = "; ".join(p.get("reason", "") for p in phase_info if p.get("reason"))
            contracts["C-ZERO-007"] = Verdict.skipped("C-ZERO-007", f"no phase resumed: {why}")
    mark_findings(contracts)
    diagnosis = (diagnose(records, contracts, mesh) if mixed is None
                 else diagnose_mixed(records, contracts, reduce_verdicts))
    report = VerifyReport(target, world, sum(p.steps for p in phases), dtype, contracts, diagnosis, device,
                          model_name, phase_info, strict=strict)
    if mixed is not None:
        report.extra["mixed_precision"] = mixed
    if mesh is not None:
        report.extra["mesh"] = list(mesh)
    if resume is not None:
        report.extra["resume"] = resume.to_json()
    if grad_accum > 1:
        report.extra["grad_accum"] = grad_accum
    return report


@dataclass
class _NamedReference:
    params: dict[str, Any]


@dataclass
class _IdentityRecord:
    """A mixed-precision step as C-ZERO-003 reads it (the ranks and the parameter names)."""

    step: int
    phase: str
    ranks: list[TrainerObservation]
    ref: _NamedReference


#: the dataclasses a saved run is made of (:func:`zerosim.files.datafile.load` rebuilds these and no other)
SAVED_TYPES = (Phase, TrainerObservation, Verdict, Violation)


def save_observations(path: str, run: dict[str, Any]) -> None:
    """Store what :func:`evaluate` needs besides the model (rebuilt from its name and seed) in ``path``
    as plain data (:mod:`zerosim.files.datafile`)."""
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


def _add_skipped_and_resources(contracts: dict[str, Verdict], phase_info: list[dict[str, Any]],
                               resources: dict[str, Verdict] | None) -> None:
    """C-ZERO-001/002/003/008 "skipped" when no phase ran (``contracts`` holds none of them then), and
    C-ZERO-004/005 from ``resources`` or "skipped" where no phase declared a strategy."""
    if not contracts:
        reasons = (p.get("reason", "").removesuffix(f" for {p.get('name')}") for p in phase_info)
        why = "every phase was skipped: " + "; ".join(dict.fromkeys(reasons))  # each reason once
        for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-008"):
            contracts[cid] = Verdict.skipped(cid, why)
    for cid in ("C-ZERO-004", "C-ZERO-005"):
        contracts[cid] = (resources or {}).get(cid) or Verdict.skipped(
            cid,
            "no phase ran with a declared strategy (declared_strategy): memory and traffic have no "
            "model to be compared with",
        )
