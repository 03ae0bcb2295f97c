"""The MPI backend and the in-process simulator agree, run for run (same seed, model, strategy).

Each case is a ``zerosim.mpi simulate`` run whose own contract verdicts must pass, and every rank's
observations are compared with the simulator's: master weights, reduced gradients, optimizer state,
gathered weights, loss, grad norm and the traffic counters. The cases of one world size run in one
``mpiexec`` launch (tests/mpi_programs/simulate_runs.py: the entry point's own steps, run after run, so
the ranks start once); the world-8 case and the comparer's own test launch the real entry point,
``mpiexec -n N python -m zerosim.mpi simulate ... --save-observations``.

- Bitwise, where every reduction feeding the training state runs over at most
  ``BITWISE_MAX_GROUP`` (2) ranks: every strategy at world size 2, hybrid groups of 2 at 4.
- Otherwise within ``CROSS_BACKEND_RTOL`` / ``CROSS_BACKEND_ATOL`` (MPI picks its own reduction order).
- Traffic: always identical, call for call and byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerosim import datafile
from zerosim.engine.spmd import RunConfig, simulate_observations
from zerosim.mpi import BITWISE_MAX_GROUP, CROSS_BACKEND_ATOL, CROSS_BACKEND_RTOL
from zerosim.mpi.launch import mpi_unavailable_reason, run_mpiexec
from zerosim.observe import STORED_TYPES

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
    from zerosim.strategy import ShardingStrategy, StrategyKind

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


def state_arrays(step: Any) -> dict[str, np.ndarray]:
    out = {"master": step.master.values}
    if step.grads is not None:
        out["grads"] = step.grads.values
    for name, values in step.optimizer.items():
        out[f"optimizer.{name}"] = values.values
    if step.gathered is not None:
        out["gathered"] = step.gathered
    return out


def compare(mpi: list[Any], sim: list[Any], bitwise: bool) -> int:
    """Assert agreement; return how many state elements differ in any bit (0 when bitwise)."""
    differing = 0
    assert [o.rank for o in mpi] == [o.rank for o in sim]
    for m, s in zip(mpi, sim, strict=True):
        assert (m.backend, s.backend) == ("mpi", "sim")
        assert m.groups == s.groups
        assert len(m.steps) == len(s.steps)
        for ms, ss in zip(m.steps, s.steps, strict=True):
            where = f"rank {m.rank} step {ms.step}"
            assert ms.traffic == ss.traffic, f"{where}: traffic differs"
            assert ms.holdings == ss.holdings, f"{where}: holdings differ"
            np.testing.assert_allclose(
                [ms.loss, ms.grad_norm, ms.clip_coef],
                [ss.loss, ss.grad_norm, ss.clip_coef],
                rtol=CROSS_BACKEND_RTOL,
                atol=CROSS_BACKEND_ATOL,
                err_msg=where,
            )
            mine, theirs = state_arrays(ms), state_arrays(ss)
            assert mine.keys() == theirs.keys(), where
            for name in theirs:
                a, b = mine[name], theirs[name]
                assert a.dtype == b.dtype and a.shape == b.shape, f"{where} {name}"
                bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
                n_diff = int(np.count_nonzero(a.view(bits) != b.view(bits)))
                differing += n_diff
                if bitwise:
                    assert n_diff == 0, f"{where} {name}: {n_diff} of {a.size} elements differ in some bit"
                else:
                    np.testing.assert_allclose(
                        a.astype(np.float64),
                        b.astype(np.float64),
                        rtol=CROSS_BACKEND_RTOL,
                        atol=CROSS_BACKEND_ATOL,
                        err_msg=f"{where} {name}",
                    )
    return differing


@pytest.mark.parametrize(("world", "strategy", "extra"), CASES, ids=[_case_id(*c) for c in CASES])
def test_mpi_run_agrees_with_the_simulator(
    request: pytest.FixtureRequest, tmp_path: Path, world: int, strategy: str, extra: tuple[str, ...]
) -> None:
    cfg = sim_config(world, strategy, extra)
    run = cfg.validate()
    # every reduction that feeds the state: over the shard group (k) and the replicate group (world / k)
    bitwise = max(run.k, run.replicas) <= BITWISE_MAX_GROUP
    if world in SHARED_LAUNCH_WORLDS:
        saved = request.getfixturevalue("shared_launches")[_case_id(world, strategy, extra)]
        mpi = datafile.load(saved, types=STORED_TYPES)
    else:
        mpi = run_mpi(tmp_path, world, strategy, extra)
    sim = simulate_observations(cfg)
    compare(mpi, sim, bitwise)


def test_the_comparison_catches_a_different_run(tmp_path: Path) -> None:
    """The comparer is not vacuous: the same MPI run (through the real entry point) against a simulator
    run with another seed fails."""
    mpi = run_mpi(tmp_path, 2, "zero2", ())
    other = simulate_observations(sim_config(2, "zero2", ()).replace(seed=8))
    with pytest.raises(AssertionError):
        compare(mpi, other, bitwise=False)
