"""In-process runs around a checkpoint, on the simulator: train and save, load and gather, resume.

Each function runs one set of simulated ranks (``zerosim.comm.sim.run_spmd``) and returns every
rank's :class:`~zerosim.checks.checkpoint.StateSnapshot` (the full state each rank gathers), the
observations C-ZERO-007 is checked on.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.engine_state import (
    LoadResult,
    engine_snapshot,
    load_engine_state,
    load_full_state,
    save_engine_state,
)
from ..checks.checkpoint import StateSnapshot
from ..comm.sim import run_spmd
from ..engine.block_schedule import BlockSchedule, block_rank_state
from ..engine.config import ResolvedRun, RunConfig
from ..engine.fault_catalog import engine_fault
from ..engine.rank_state import RankState
from ..numerics.xp import numpy_namespace


def _engine(comm: Any, run: ResolvedRun) -> tuple[RankState, BlockSchedule]:
    state = block_rank_state(comm, run, numpy_namespace(), fault=engine_fault(run))
    return state, BlockSchedule(state)


def _resolve(cfg: RunConfig | ResolvedRun) -> ResolvedRun:
    return cfg if isinstance(cfg, ResolvedRun) else cfg.resolve()


def train_and_save(
    cfg: RunConfig | ResolvedRun, steps: int, directory: str | Path | None, *, block_bytes: int | None = None
) -> list[StateSnapshot]:
    """Train ``steps`` steps (0 .. steps-1) from the run's initial weights, save to ``directory`` (None:
    no save), and gather: every rank's snapshot of the state that was saved."""
    run = _resolve(cfg)

    def program(comm: Any) -> StateSnapshot:
        engine, schedule = _engine(comm, run)
        for s in range(steps):
            schedule.step(s)
        if directory is not None:
            kw = {"block_bytes": block_bytes} if block_bytes else {}
            save_engine_state(engine, directory, **kw)
        return engine_snapshot(engine)

    return run_spmd(run.world_size, program, timeout_s=run.cfg.timeout_s)


def load_and_snapshot(
    cfg: RunConfig | ResolvedRun,
    directory: str | Path,
    *,
    strict: bool = True,
    continue_steps: tuple[int, int] | None = None,
) -> list[tuple[StateSnapshot, LoadResult]]:
    """Fresh engines for ``cfg`` load ``directory``, optionally train steps ``range(*continue_steps)``,
    and gather; per rank ``(snapshot, load result)``."""
    run = _resolve(cfg)

    def program(comm: Any) -> tuple[StateSnapshot, LoadResult]:
        engine, schedule = _engine(comm, run)
        result = load_engine_state(engine, directory, strict=strict)
        if continue_steps is not None:
            for s in range(*continue_steps):
                schedule.step(s)
        return engine_snapshot(engine), result

    return run_spmd(run.world_size, program, timeout_s=run.cfg.timeout_s)


def transfer_and_continue(
    snapshot: StateSnapshot, cfg: RunConfig | ResolvedRun, steps: tuple[int, int]
) -> list[StateSnapshot]:
    """The reference for resuming at another world size: fresh engines for ``cfg`` take ``snapshot``'s
    full state in memory (no files), train steps ``range(*steps)`` and gather."""
    run = _resolve(cfg)

    def program(comm: Any) -> StateSnapshot:
        engine, schedule = _engine(comm, run)
        load_full_state(engine, snapshot)
        for s in range(*steps):
            schedule.step(s)
        return engine_snapshot(engine)

    return run_spmd(run.world_size, program, timeout_s=run.cfg.timeout_s)


def run_engines(cfg: RunConfig | ResolvedRun, body: Callable[[RankState, BlockSchedule], Any]) -> list[Any]:
    """``body(state, schedule)`` on every rank of a fresh simulated run of ``cfg``; the per-rank results."""
    run = _resolve(cfg)
    return run_spmd(run.world_size, lambda comm: body(*_engine(comm, run)), timeout_s=run.cfg.timeout_s)
