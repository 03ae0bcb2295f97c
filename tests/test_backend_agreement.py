"""The cross-backend agreement bound (zerosim/checks/agreement.py, zerosim/engine/backend_agreement.py): it is
a bound on reordered sums, a correct run computed another way stays within it, and one element moved
beyond its bound fails the comparison, naming the state.

(The launched backends against it: tests/test_mpi_cross_backend.py, tests/test_zerogpu_torchrun.py.)
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest

from zerosim.checks.agreement import (
    BITWISE_MAX_GROUP,
    bitwise_expected,
    compare_backends,
    cross_backend_length,
    reordered_sum_bound,
)
from zerosim.checks.rounding import UNIT_ROUNDOFF, gamma
from zerosim.engine.backend_agreement import agreement_bounds
from zerosim.engine.spmd import RunConfig, simulate_observations

CFG = RunConfig(model="tiny", world_size=4, strategy="zero3", steps=2, micro_batches=2, seed=7,
                observe="full")


def test_reordered_sums_stay_within_the_summation_bound() -> None:
    """Sums of the same values in many orders (cancelling ones included) differ by at most the bound."""
    rng = np.random.default_rng(0)
    for n in (3, 4, 8, 64):
        bound = reordered_sum_bound(n, "float32")
        assert bound == 2 * gamma(n - 1, UNIT_ROUNDOFF["float32"])
        for trial in range(200):
            x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
            if trial % 2:
                x[-1] = -np.float32(np.sum(x[:-1], dtype=np.float64))  # an exact sum near zero
            sums = []
            for _ in range(6):
                acc = np.float32(0)
                for v in rng.permutation(x):
                    acc = np.float32(acc + v)
                sums.append(float(acc))
            assert max(sums) - min(sums) <= bound * float(np.sum(np.abs(x), dtype=np.float64))


def test_groups_of_at_most_two_are_bitwise() -> None:
    assert BITWISE_MAX_GROUP == 2 and reordered_sum_bound(2, "float32") == 0.0
    assert bitwise_expected(2, 1, same_local_arithmetic=True) and bitwise_expected(2, 2, True)
    assert not bitwise_expected(4, 1, True) and not bitwise_expected(2, 1, same_local_arithmetic=False)
    assert cross_backend_length(4, 1) == 5 and cross_backend_length(2, 2, 100) == 104


@pytest.fixture(scope="module")
def sim() -> list:
    return simulate_observations(CFG)


@pytest.fixture(scope="module")
def bounds() -> list:
    out = agreement_bounds(CFG.validate(), same_local_arithmetic=False)
    assert out is not None and len(out) == CFG.steps
    return out


def test_a_correct_run_computed_with_another_library_agrees(sim: list, bounds: list) -> None:
    """The same run with the engine on torch tensors (torch's BLAS adds each dot product in its own
    order): not bitwise equal, within the derived bound everywhere."""
    pytest.importorskip("torch")
    other = simulate_observations(CFG.replace(xp="torch"))
    summary = compare_backends(other, sim, bitwise=False, bounds=bounds)
    assert summary["agrees"], summary
    assert summary["elements_differing"] > 0 and summary["max_diff_over_bound"] < 1


def _moved(sim: list, bounds: list, factor: float) -> tuple[list, int]:
    """A copy of ``sim`` with rank 1's last master element of largest bound moved by ``factor`` x its
    bound (its global index returned)."""
    moved = copy.deepcopy(sim)
    master = moved[1].steps[-1].master
    flat_bound = bounds[-1].bounds["master"]
    g0, g1, pos = master.pieces[0]
    j = int(np.argmax(flat_bound[g0:g1]))
    value = float(master.values[pos + j])
    master.values[pos + j] = np.float32(value + factor * float(flat_bound[g0 + j]))
    return moved, g0 + j


def test_one_element_beyond_its_bound_fails_and_within_it_passes(sim: list, bounds: list) -> None:
    inside, _ = _moved(sim, bounds, 0.5)
    assert compare_backends(inside, sim, bitwise=False, bounds=bounds)["agrees"]
    outside, index = _moved(sim, bounds, 1.5)
    summary = compare_backends(outside, sim, bitwise=False, bounds=bounds)
    assert not summary["agrees"] and summary["elements_differing"] == 1
    assert f"rank 1 step {CFG.steps - 1} master: 1 of" in summary["problems"][0]
    assert summary["max_diff_over_bound"] > 1 and math.isfinite(summary["max_diff_over_bound"])
    assert index >= 0


def test_the_bound_is_not_vacuous_another_seed_fails(sim: list, bounds: list) -> None:
    other = simulate_observations(CFG.replace(seed=8))
    summary = compare_backends(other, sim, bitwise=False, bounds=bounds)
    assert not summary["agrees"] and summary["problems"]


def test_a_wrong_implementation_fails_naming_what_it_broke(sim: list, bounds: list) -> None:
    """Two deliberately wrong engines (faults of zerosim.engine.fault_catalog) against the bound a correct
    backend meets: each fails, and the first problem names the state the bug broke, on the rank it broke."""
    summed = simulate_observations(CFG.replace(fault="sum-instead-of-avg"))
    summary = compare_backends(summed, sim, bitwise=False, bounds=bounds)
    assert not summary["agrees"]
    first = summary["problems"][0]
    assert first.startswith("rank 0 step 0: grad norm"), summary["problems"]
    # summed instead of averaged over the world (4 ranks: dividing by 4 is exact, the same additions in
    # the same order): the norm is exactly world-size times the correct one
    got, expected = (float(x) for x in first.split("grad norm ")[1].split(" (bound")[0].split(" vs "))
    assert got == CFG.world_size * expected
    assert any(p.startswith("rank 0 step 0 grads:") for p in summary["problems"])

    stale = simulate_observations(CFG.replace(fault="stale-params"))  # rank 1 computes with old weights
    summary = compare_backends(stale, sim, bitwise=False, bounds=bounds)
    assert not summary["agrees"]
    step0 = [p for p in summary["problems"] if " step 0" in p]
    assert step0 and all(p.startswith("rank 1 step 0 gathered:") for p in step0), summary["problems"]
