"""The SPMD entry points: the per-rank program every backend runs, and the in-process simulated run.

* :func:`rank_program` ``(comm, cfg) -> RankObservation``: what every rank runs. Backend-agnostic:
  it talks to the :class:`~zerosim.comm.base.Communicator` it is given and computes through the
  array namespace named by ``cfg.xp``. The simulator runs it on N threads; ``zerosim.mpi`` under
  ``mpiexec``; zerogpu under ``torchrun``.
* :func:`run_simulated` ``(cfg) -> RunResult``: the in-process backend (``zerosim simulate``): the
  program on N simulated ranks, then :func:`zerosim.engine.run_result.evaluate`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from ..comm.base import Communicator
from ..comm.sim import run_spmd
from ..numerics.xp import numpy_namespace, torch_namespace
from ..values.observe import RankObservation
from .block_schedule import BlockSchedule, block_rank_state
from .config import ResolvedRun, RunConfig
from .fault_catalog import engine_fault
from .observation import finish_observation
from .run_result import (
    ProgressFn,
    ReferenceJob,
    RunResult,
    evaluate,
    plan_refused_result,
    plan_verdict,
    resolve_run,
)

__all__ = ["rank_program", "run_simulated", "simulate_observations"]


def rank_program(comm: Communicator, cfg: RunConfig | ResolvedRun,
                 on_step: Callable[[int], None] | None = None, device: str = "cpu",
                 save_to: str | Path | None = None) -> RankObservation:
    """The per-rank SPMD program: build the engine for ``cfg`` on ``comm`` and train ``cfg.steps`` steps.

    ``device`` places the engine's torch arrays (``cfg.xp == "torch"``): ``"cpu"``, or ``"cuda:<i>"``
    under NCCL. Observations are host numpy either way, so every backend is checked the same way.
    ``save_to``: after the last step every rank saves the engine's state there as a sharded checkpoint
    (:func:`zerosim.checkpoint.engine_state.save_engine_state`, collective; what ``zerosim checkpoint``
    inspects and reshards).
    """
    run = resolve_run(cfg)
    xp = numpy_namespace() if run.cfg.xp == "numpy" else torch_namespace(device)
    state = block_rank_state(comm, run, xp, fault=engine_fault(run))
    schedule = BlockSchedule(state)
    for s in range(run.steps):
        schedule.step(s)
        if on_step is not None:
            on_step(s)
    if save_to is not None:
        from ..checkpoint.engine_state import save_engine_state

        save_engine_state(state, save_to)
    return finish_observation(state)


def simulate_observations(
    cfg: RunConfig | ResolvedRun, progress: ProgressFn | None = None, save_to: str | Path | None = None
) -> list[RankObservation]:
    """Run ``rank_program`` on ``world_size`` simulated ranks in this process (``save_to``: the ranks save
    a checkpoint there after the last step)."""
    run = resolve_run(cfg)

    def program(comm: Communicator) -> RankObservation:
        tick = None
        if progress is not None and comm.rank == 0:
            def tick(s: int) -> None:
                progress("train", s + 1, run.steps)
        return rank_program(comm, run, tick, save_to=save_to)

    return run_spmd(run.world_size, program, timeout_s=run.cfg.timeout_s, schedule=run.cfg.schedule)


def run_simulated(cfg: RunConfig, progress: ProgressFn | None = None,
                  save_to: str | Path | None = None) -> RunResult:
    """Validate, run on the in-process simulator, evaluate every step contract; ``save_to``: a sharded
    checkpoint of the trained state is written there after the last step (by the same ranks).

    Where it pays (:meth:`ReferenceJob.worth_it`: many ranks, a small model) the unsharded
    references are computed in a child process while the ranks train, on the core the serially
    scheduled ranks leave idle; the contracts and what they compare are the same either way."""
    run = resolve_run(cfg)
    plan = plan_verdict(run)
    if not plan.passed:  # a plan with gaps or overlaps is never trained
        return plan_refused_result(run, plan)
    job = None
    if ReferenceJob.worth_it(run):
        try:
            job = ReferenceJob(run, ordered=run.observe_values)
        except OSError:  # no child process here: evaluate computes the references itself
            job = None
    t = time.perf_counter()
    try:
        obs = simulate_observations(run, progress, save_to)
    except BaseException:
        if job is not None:
            job.cancel()
        raise
    train_s = time.perf_counter() - t
    result = evaluate(run, obs, progress=progress, references=job)
    result.timings["train_s"] = train_s
    return result
