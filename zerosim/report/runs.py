"""The runs ``zerosim report`` measures: every strategy at every world size on the in-process
simulator, an odd-shaped model that every partitioner pads, and the launched backends (``mpiexec``,
``torchrun`` with gloo) when they work. Each run is checked against C-ZERO-001..005 as it is
measured; each entry holds its memory and traffic beside the closed-form model and its error against
the ground truth (:mod:`zerosim.report.measure`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..cost.memory_model import all_strategies
from ..engine.config import RunConfig
from ..engine.reference import ordered_reference
from ..engine.run_result import evaluate
from ..engine.spmd import simulate_observations
from ..numerics.model import SimModelConfig
from ..values.strategy import Topology
from .config import ReportConfig
from .measure import (
    equivalence_errors,
    memory_comparison,
    run_under_mpi,
    run_under_torch,
    traffic_comparison,
)

#: an odd-shaped simulator model: every partitioner pads it, so the padding column is not empty
PADDING_DEMO_MODEL = SimModelConfig(vocab_size=37, d_model=12, n_layer=3, d_ff=20, seq_len=4, batch_size=2)
MPI_STRATEGIES = ("no_shard", "shard_optimizer", "shard_grad_op", "full_shard")


def checked_run(run: Any, observations: Any, backend: str) -> tuple[dict[str, Any], Any]:
    """C-ZERO-001..005 on one measured run (:func:`zerosim.engine.run_result.evaluate`): (its JSON row, the
    evaluation, whose ``references`` the report reuses for the equivalence-error figure)."""
    result = evaluate(run, observations)
    row = {
        "backend": backend,
        "world_size": run.world_size,
        "strategy": run.strategy.name,
        "passed": result.passed,
        "verdicts": {
            c: {
                "passed": v.passed,
                "checked": v.checked,
                "violations": len(v.violations),
                "first": str(v.violations[0]) if v.violations else None,
            }
            for c, v in result.verdicts.items()
        },
    }
    return row, result


def strategy_names(ws: int, rpn: int) -> list[str]:
    """Every strategy measured at world size ``ws`` (hybrid ones when ``rpn`` ranks per node split it)."""
    topo = Topology(ws, rpn if ws % rpn == 0 and ws > rpn else ws)
    return [s.name for s in all_strategies(topo)]


def ranks_per_node_of(ws: int, rpn: int) -> int | None:
    """``rpn`` when world size ``ws`` spans more than one node of it, else None (one node)."""
    return rpn if ws % rpn == 0 and ws > rpn else None



def measure_simulator(cfg: ReportConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    """One simulator run per (world size, strategy) of the small model: memory, traffic, error."""
    runs: dict[str, dict[str, Any]] = {}
    for ws in cfg.world_sizes:
        rpn = ranks_per_node_of(ws, cfg.ranks_per_node)
        for name in strategy_names(ws, cfg.ranks_per_node):
            tick(f"simulator: world {ws}, {name}")
            rc = RunConfig(model=cfg.sim_model, world_size=ws, strategy=name, steps=cfg.steps,
                           precision=cfg.precision, optimizer=cfg.optimizer, partitioner=cfg.partitioner,
                           ranks_per_node=rpn, observe="full")
            run = rc.resolve()
            obs = simulate_observations(run)
            row, checked = checked_run(run, obs, "simulator")
            entry: dict[str, Any] = {
                "memory": memory_comparison(run, obs),
                "traffic": traffic_comparison(run, obs),
                "contracts": row,
            }
            refs = checked.references
            entry["ground_truth_error"] = equivalence_errors(run, obs, refs["independent"])
            entry["ordered_reference_error"] = equivalence_errors(run, obs, refs.get("ordered")
                                                                  or ordered_reference(run))
            runs[f"{ws}/{name}"] = entry
    return runs


def measure_padding_demo(cfg: ReportConfig, tick: Callable[[str], None]) -> list[dict[str, Any]]:
    """The sharded strategies on :data:`PADDING_DEMO_MODEL`: memory against the model, padding included."""
    out = []
    for ws in cfg.world_sizes:
        for name in ("shard_optimizer", "shard_grad_op", "full_shard"):
            tick(f"padding demo: world {ws}, {name}")
            run = RunConfig(
                model=PADDING_DEMO_MODEL,
                world_size=ws,
                strategy=name,
                steps=1,
                precision=cfg.precision,
                optimizer=cfg.optimizer,
                partitioner=cfg.partitioner,
            ).resolve()
            cmp = memory_comparison(run, simulate_observations(run))
            cmp.pop("measured_per_rank", None)
            cmp.pop("model_engine", None)
            cmp.pop("model_paper", None)
            out.append(cmp)
    return out


def launched_run(cfg: ReportConfig, world_size: int, strategy: str, **extra: Any) -> RunConfig:
    """One strategy of the report's settings as a launched backend runs it, every value observed."""
    return RunConfig(
        model=cfg.sim_model,
        world_size=world_size,
        strategy=strategy,
        steps=cfg.steps,
        precision=cfg.precision,
        optimizer=cfg.optimizer,
        partitioner=cfg.partitioner,
        observe="full",
        **extra,
    )


def measure_mpi(cfg: ReportConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    """:data:`MPI_STRATEGIES` under mpiexec, one launch each; the first failure skips the rest."""
    out: dict[str, Any] = {"world_size": cfg.mpi_world_size, "runs": {}, "error": None}
    for name in MPI_STRATEGIES:
        tick(f"mpiexec -n {cfg.mpi_world_size}: {name}")
        if out["error"]:
            continue
        rc = launched_run(cfg, cfg.mpi_world_size, name)
        res = run_under_mpi(rc)
        if res.error:
            out["error"] = res.error
            continue
        run = rc.resolve()
        assert res.observations is not None
        row, checked = checked_run(run, res.observations, "mpi")
        out["runs"][name] = {"memory": memory_comparison(run, res.observations),
                             "traffic": traffic_comparison(run, res.observations),
                             "ground_truth_error": equivalence_errors(run, res.observations,
                                                                      checked.references["independent"]),
                             "contracts": row,
                             "wall_s": res.wall_s}
    return out


def measure_torch(cfg: ReportConfig, tick: Callable[[str], None]) -> dict[str, Any]:
    """The MPI set of strategies under torchrun (one launch, gloo on CPU, torch arrays)."""
    out: dict[str, Any] = {"world_size": cfg.torch_world_size, "runs": {}, "error": None, "wall_s": 0.0}
    tick(f"torchrun --nproc-per-node {cfg.torch_world_size}: {len(MPI_STRATEGIES)} strategies")
    cfgs = [launched_run(cfg, cfg.torch_world_size, name, xp="torch") for name in MPI_STRATEGIES]
    res = run_under_torch(cfgs, cfg.torch_world_size)
    out["wall_s"] = res.wall_s
    if res.error:
        out["error"] = res.error
        return out
    assert res.observations is not None
    for name, rc, obs in zip(MPI_STRATEGIES, cfgs, res.observations, strict=True):
        run = rc.resolve()
        row, checked = checked_run(run, obs, "torch")
        out["runs"][name] = {
            "memory": memory_comparison(run, obs),
            "traffic": traffic_comparison(run, obs),
            "ground_truth_error": equivalence_errors(run, obs, checked.references["independent"]),
            "contracts": row,
            "wall_s": res.wall_s / len(cfgs),
        }
    return out


