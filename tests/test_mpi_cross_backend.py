"""The MPI backend and the in-process simulator agree, run for run (same seed, model, strategy).

Each case is a ``zerosim.mpi simulate`` run whose own contract verdicts must pass, and every rank's
observations are compared with the simulator's: master weights, reduced gradients, optimizer state,
gathered weights, loss, grad norm and the traffic counters. The cases of one world size run in one
``mpiexec`` launch (tests/mpi_programs/simulate_runs.py: the entry point's own steps, run after run, so
the ranks start once); the world-8 case and the comparer's own test launch the real entry point,
``mpiexec -n N python -m zerosim.mpi simulate ... --save-observations``.

- Bitwise, where every reduction feeding the training state runs over at most
  ``BITWISE_MAX_GROUP`` (2) ranks: every strategy at world size 2, hybrid groups of 2 at 4.
- Otherwise every element within its derived bound (MPI picks its own reduction order):
  :mod:`zerosim.checks.agreement`.
- Traffic: always identical, call for call and byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from zerosim.checks.agreement import bitwise_expected, compare_backends
from zerosim.engine.backend_agreement import agreement_bounds
from zerosim.engine.spmd import RunConfig, simulate_observations
from zerosim.files import datafile
from zerosim.mpi.launch import mpi_unavailable_reason, run_mpiexec
from zerosim.values.observe import STORED_TYPES

REASON = mpi_unavailable_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.skipif(REASON is not None, reason=f"MPI unavailable: {REASON}")]

STRATEGIES = ("no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2")
CASES = [
    # (world size, strategy, extra options): every strategy at 2 and 4 ranks, one at 8
    *[(2, s, ()) for s in STRATEGIES],
    *[(2, s, ()) for s in ("hybrid_shard:1", "hybrid_shard_zero2:1")],  # hybrid with a replicate group of 2
    (2, "zero3", ("--offload", "--prefetch", "1")),
    (2, "zero3", ("--precision", "bf16")),
    (4, "zero1", ("--zero1-reduce", "reduce_scatter")),  # ZeRO-1 with the reduce-scatter gradient variant
    *[(4, s, ()) for s in STRATEGIES],
    (8, "hybrid_shard:4", ()),
]


def test_every_strategy_is_compared_at_2_and_4_ranks() -> None:
    """The case list itself: no strategy may drop out of the cross-backend comparison unnoticed."""
    from zerosim.values.strategy import ShardingStrategy, StrategyKind

    for world in (2, 4):
        kinds = {ShardingStrategy.parse(s).kind for w, s, e in CASES if w == world and not e}
        assert kinds == set(StrategyKind), f"world {world}: missing {set(StrategyKind) - kinds}"
    assert any(w == 8 for w, _, _ in CASES)


PROGRAM = str(Path(__file__).parent / "mpi_programs" / "simulate_runs.py")
#: world sizes whose cases share one launch of PROGRAM; the others launch the entry point case by case
SHARED_LAUNCH_WORLDS = (2, 4)


def _options(strategy: str, extra: tuple[str, ...]) -> list[str]:
    return ["--model", "tiny", "--strategy", strategy, "--steps", "2", "--micro-batches", "2", "--seed", "7",
            "--observe", "full", "--timeout", "60", *extra]


def _case_id(world: int, strategy: str, extra: tuple[str, ...]) -> str:
    return f"{world}-{strategy}{''.join(extra)}"


def run_mpi(tmp_path: Path, world: int, strategy: str, extra: tuple[str, ...]) -> list[Any]:
    """One case through the real entry point, ``python -m zerosim.mpi simulate``."""
    saved = tmp_path / "observations.safetensors"
    argv = ["-m", "zerosim.mpi", "simulate", *_options(strategy, extra), "--json",
            "--save-observations", str(saved)]
    result = run_mpiexec(world, argv, timeout_s=180)
    assert result.returncode == 0, (
        f"the MPI run's own contracts failed (exit {result.returncode}):\n{result.stderr}"
    )
    return datafile.load(saved, types=STORED_TYPES)


@pytest.fixture(scope="module")
def shared_launches(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every case of a SHARED_LAUNCH_WORLDS world run in one launch per world: case id -> saved file."""
    tmp = tmp_path_factory.mktemp("mpi-runs")
    saved: dict[str, Path] = {}
    for world in SHARED_LAUNCH_WORLDS:
        cases = [(_case_id(w, s, e), _options(s, e)) for w, s, e in CASES if w == world]
        runs = [[options, str(tmp / f"{case}.safetensors")] for case, options in cases]
        results = tmp / f"world{world}.jsonl"
        launch = run_mpiexec(world, [PROGRAM, str(results), json.dumps(runs)], timeout_s=60 * len(runs) + 60)
        assert launch.returncode == 0, f"world {world}: exit {launch.returncode}\n{launch.stderr[-3000:]}"
        codes = {r["save"]: r["exit"] for r in map(json.loads, results.read_text().splitlines())}
        for (case, _), (_, path) in zip(cases, runs, strict=True):
            assert codes[path] == 0, f"{case}: the MPI run's own contracts failed (exit {codes[path]})"
            saved[case] = Path(path)
    return saved


def sim_config(world: int, strategy: str, extra: tuple[str, ...]) -> RunConfig:
    opts = dict(zip(extra[::2], extra[1::2], strict=False))
    return RunConfig(model="tiny", world_size=world, strategy=strategy, steps=2, micro_batches=2, seed=7,
                     observe="full", offload="--offload" in extra, prefetch=int(opts.get("--prefetch", 0)),
                     precision=opts.get("--precision", "fp32"),
                     zero1_grad_reduce=opts.get("--zero1-reduce", "all_reduce"))


def compare(mpi: list[Any], sim: list[Any], run: Any, bitwise: bool) -> int:
    """Assert agreement; return how many state elements differ in any bit (0 when bitwise)."""
    assert all(m.backend == "mpi" for m in mpi) and all(o.backend == "sim" for o in sim)
    bounds = None if bitwise else agreement_bounds(run, same_local_arithmetic=True)
    summary = compare_backends(mpi, sim, bitwise=bitwise, bounds=bounds)
    assert summary["agrees"], summary
    return int(summary["elements_differing"])


@pytest.mark.parametrize(("world", "strategy", "extra"), CASES, ids=[_case_id(*c) for c in CASES])
def test_mpi_run_agrees_with_the_simulator(
    request: pytest.FixtureRequest, tmp_path: Path, world: int, strategy: str, extra: tuple[str, ...]
) -> None:
    cfg = sim_config(world, strategy, extra)
    run = cfg.validate()
    # every reduction that feeds the state: over the shard group (k) and the replicate group (world / k)
    bitwise = bitwise_expected(run.k, run.replicas, same_local_arithmetic=True)
    if world in SHARED_LAUNCH_WORLDS:
        saved = request.getfixturevalue("shared_launches")[_case_id(world, strategy, extra)]
        mpi = datafile.load(saved, types=STORED_TYPES)
    else:
        mpi = run_mpi(tmp_path, world, strategy, extra)
    sim = simulate_observations(cfg)
    compare(mpi, sim, run, bitwise)


def test_the_comparison_catches_a_different_run(tmp_path: Path) -> None:
    """The comparer is not vacuous: the same MPI run (through the real entry point) against a simulator
    run with another seed fails."""
    mpi = run_mpi(tmp_path, 2, "zero2", ())
    other = simulate_observations(sim_config(2, "zero2", ()).replace(seed=8))
    with pytest.raises(AssertionError):
        compare(mpi, other, sim_config(2, "zero2", ()).validate(), bitwise=False)
