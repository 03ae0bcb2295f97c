"""``zerosim verify`` catches each deliberately broken trainer and says where the bug lives.

Every trainer in ``tests/verify_trainers/broken.py`` is the correct example ZeRO-1 with one real-world
bug. Each runs once through :func:`zerosim.verify.verify` (world 2, or 4 for the 2x2 hybrid) and the
test asserts: the verdict, the contract that breaks, the first failing step (derived from the suite's
phases and the bug, never read off a run), the rank / tensor / element range the violation names
(derived from the example's layout: contiguous slices of ceil(total / world) elements of the flat
vector in ``named_parameters()`` order), the contracts that must still hold, and the bug class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tests.verify_trainers import broken  # noqa: E402
from zerosim.testing.verify import failure_message  # noqa: E402
from zerosim.verify import VerifyReport, verify  # noqa: E402
from zerosim.verify.model import build_model  # noqa: E402

pytestmark = [pytest.mark.torchdist, pytest.mark.slow]

LAUNCH_TIMEOUT_S = 120.0  # per collective; the launcher adds its own wall-clock bound
STEPS = 8  # 4 per phase: every bug here shows within 4 steps of its phase (the defaults are longer)


# ---- the example's layout, computed here from the model ------------------------------------------------


def flat_spans(model: str = "gpt") -> list[tuple[str, int, int]]:
    """Each parameter's half-open range in the flat vector, in ``named_parameters()`` order."""
    spans, lo = [], 0
    for name, p in build_model(model).named_parameters():
        spans.append((name, lo, lo + p.numel()))
        lo += p.numel()
    return spans


def total_elements() -> int:
    return flat_spans()[-1][2]


def tensor_ranges(flat_lo: int, flat_hi: int) -> dict[str, tuple[int, int]]:
    """The flat range [flat_lo, flat_hi) as element ranges of the flattened tensors it touches."""
    out = {}
    for name, lo, hi in flat_spans():
        start, stop = max(lo, flat_lo), min(hi, flat_hi)
        if start < stop:
            out[name] = (start - lo, stop - lo)
    return out


def owned_by(rank: int, world: int) -> dict[str, tuple[int, int]]:
    """What the example's ``rank`` owns at ``world``: slice ``rank`` of ceil(total / world) elements."""
    size = math.ceil(total_elements() / world)
    return tensor_ranges(rank * size, (rank + 1) * size)


# ---- reading a report ---------------------------------------------------------------------------------


def phase(report: VerifyReport, name: str) -> dict[str, Any]:
    return next(p for p in report.phases if p["name"] == name)


def first_failing_step(report: VerifyReport, contract: str) -> int:
    return min(v["step"] for v in report.contracts[contract].violations)


def violations_at(report: VerifyReport, contract: str, step: int) -> list[dict[str, Any]]:
    return [v for v in report.contracts[contract].violations if v["step"] == step]


def inside(v: dict[str, Any], ranges: dict[str, tuple[int, int]]) -> bool:
    span = ranges.get(v["tensor"])
    return span is not None and span[0] <= v["start"] and v["stop"] <= span[1]


# ---- the cases -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    factory: str
    contract: str  # the contract that must fail
    first_step: Callable[[VerifyReport], int]  # derived from the report's phases
    bug_class: str
    world: int = 2
    holds: tuple[str, ...] = ()  # contracts that must still pass
    where: Callable[[VerifyReport, int], None] | None = None  # (report, first failing step) -> asserts


def sgd_step(k: int) -> Callable[[VerifyReport], int]:
    """The k-th step (1-based) of the SGD phase, as a global step number."""
    return lambda r: phase(r, "sgd")["first_step"] + k - 1


def adamw_step(k: int) -> Callable[[VerifyReport], int]:
    return lambda r: phase(r, "adamw")["first_step"] + k - 1


def first_binding_clip(report: VerifyReport) -> int:
    binds = phase(report, "adamw")["clip_binds_at"]
    assert binds, f"the suite's clip never binds: {phase(report, 'adamw')}"
    return binds[0]


def on_every_rank(report: VerifyReport, step: int, world: int = 2) -> None:
    ranks = {v["rank"] for v in violations_at(report, "C-ZERO-002", step)}
    assert ranks == set(range(world)), f"every rank holds the wrong values, violations name ranks {ranks}"


def in_rank_1_slice(report: VerifyReport, step: int) -> None:
    own = owned_by(broken.BROKEN_RANK, 2)
    found = violations_at(report, "C-ZERO-002", step)
    outside = [v for v in found if not inside(v, own)]
    assert found and not outside, f"violations outside rank 1's slice {own}: {outside[:3]}"
    rank_local = next(d for d in report.diagnosis if d.bug_class == "rank-local")
    assert f"rank {broken.BROKEN_RANK}" in rank_local.evidence, rank_local.evidence


def remainder_unowned(report: VerifyReport, step: int) -> None:
    total, world = total_elements(), 2
    expected = tensor_ranges(world * (total // world), total)
    got = {
        v["tensor"]: (v["start"], v["stop"])
        for v in report.contracts["C-ZERO-001"].violations
        if v["step"] == step
    }
    assert got == expected, f"unowned elements named {got}, the remainder is {expected}"
    moved_wrong = violations_at(report, "C-ZERO-002", step)
    assert moved_wrong and all(inside(v, expected) for v in moved_wrong), moved_wrong[:3]


def overlap_named(report: VerifyReport, step: int) -> None:
    size = math.ceil(total_elements() / 2)
    expected = tensor_ranges(size, size + broken.OVERLAP_ELEMENTS)
    found = report.contracts["C-ZERO-001"].violations
    got = {v["tensor"]: (v["start"], v["stop"]) for v in found if v["step"] == step}
    assert got == expected, f"overlap named {got}, rank 0 reaches into rank 1's slice at {expected}"
    assert all("[0, 1]" in v["message"] for v in found), found[:3]


def stale_rank_named(report: VerifyReport, step: int) -> None:
    found = violations_at(report, "C-ZERO-003", step)
    assert found and all(v["rank"] == broken.BROKEN_RANK for v in found), found[:3]


def halves_swapped(report: VerifyReport, step: int) -> None:
    """Reversed at world 2: flat [0, S-1) holds the reference's [S, total), S = ceil(total / 2)."""
    total = total_elements()
    size = math.ceil(total / 2)
    evidence = next(d.evidence for d in report.diagnosis if d.bug_class == "permuted-shards")
    assert f"[0:{size - 1}]" in evidence and f"[{size}:{total}]" in evidence, evidence


def step_counter_named(report: VerifyReport, step: int) -> None:
    evidence = next(d.evidence for d in report.diagnosis if d.bug_class == "ranks-agree-wrong")
    assert "step counter" in evidence, f"the diagnosis should point at the Adam step counter: {evidence}"


def replicas_named(report: VerifyReport, step: int) -> None:
    ranks = {v["rank"] for v in violations_at(report, "C-ZERO-003", step)}
    assert ranks and ranks <= {2, 3}, f"the second replica (ranks 2, 3) differs from rank 0's; named {ranks}"


CASES = [
    Case(
        "summed_gradient",
        "C-ZERO-002",
        sgd_step(1),
        "gradient-scale",
        holds=("C-ZERO-001", "C-ZERO-003"),
        where=on_every_rank,
    ),
    Case(
        "local_clip_norm", "C-ZERO-002", first_binding_clip, "clip-norm", holds=("C-ZERO-001", "C-ZERO-003")
    ),
    Case(
        "unowned_remainder",
        "C-ZERO-001",
        sgd_step(1),
        "unowned-elements",
        holds=("C-ZERO-003",),
        where=remainder_unowned,
    ),
    Case(
        "overlapping_shards",
        "C-ZERO-001",
        sgd_step(1),
        "overlapping-shards",
        holds=("C-ZERO-002", "C-ZERO-003"),
        where=overlap_named,
    ),
    Case(
        "rank_stops_updating",
        "C-ZERO-002",
        sgd_step(broken.STOPS_AFTER_STEPS + 1),
        "rank-local",
        holds=("C-ZERO-001", "C-ZERO-003"),
        where=in_rank_1_slice,
    ),
    Case(
        "wrong_gather_order",
        "C-ZERO-002",
        sgd_step(1),
        "permuted-shards",
        holds=("C-ZERO-001", "C-ZERO-003"),
        where=halves_swapped,
    ),
    Case(
        "double_weight_decay",
        "C-ZERO-002",
        sgd_step(1),
        "ranks-agree-wrong",
        holds=("C-ZERO-001", "C-ZERO-003"),
        where=on_every_rank,
    ),
    Case(
        "stale_parameters",
        "C-ZERO-003",
        sgd_step(1),
        "ranks-disagree",
        holds=("C-ZERO-001",),
        where=stale_rank_named,
    ),
    Case(
        "adam_step_off_by_one",
        "C-ZERO-002",
        adamw_step(1),
        "ranks-agree-wrong",
        holds=("C-ZERO-001", "C-ZERO-003"),
        where=step_counter_named,
    ),
    Case(
        "gradients_never_zeroed",
        "C-ZERO-002",
        sgd_step(2),
        "late-divergence",
        holds=("C-ZERO-001", "C-ZERO-003"),
    ),
    Case(
        "hybrid_replicas_drift",
        "C-ZERO-003",
        sgd_step(1),
        "ranks-disagree",
        world=4,
        holds=("C-ZERO-001",),
        where=replicas_named,
    ),
]

# The late classes also name the step: a bug that starts at step k > 1 of its phase is "late-divergence".
ALSO_LATE = {"rank_stops_updating", "gradients_never_zeroed"}

_reports: dict[tuple[str, int], VerifyReport] = {}


def report_for(factory: str, world: int) -> VerifyReport:
    """One launch per trainer, shared by every test that reads its report."""
    key = (factory, world)
    if key not in _reports:
        _reports[key] = verify(
            f"tests.verify_trainers.broken:{factory}", world=world, steps=STEPS, timeout_s=LAUNCH_TIMEOUT_S
        )
    return _reports[key]


@pytest.mark.parametrize("case", CASES, ids=[c.factory for c in CASES])
def test_broken_trainer_is_caught_where_the_bug_lives(case: Case) -> None:
    report = report_for(case.factory, case.world)
    text = failure_message(report)
    assert report.verdict == "fail", text
    outcome = report.contracts[case.contract]
    assert outcome.status == "fail", f"{case.contract} should fail:\n{text}"
    step = case.first_step(report)
    assert first_failing_step(report, case.contract) == step, f"first failing step should be {step}:\n{text}"
    for cid in case.holds:
        assert report.contracts[cid].status == "pass", f"{cid} should hold for {case.factory}:\n{text}"
    classes = [d.bug_class for d in report.diagnosis]
    assert case.bug_class in classes, f"expected {case.bug_class!r} among {classes}:\n{text}"
    if case.factory in ALSO_LATE:
        assert "late-divergence" in classes, text
    if case.where is not None:
        case.where(report, step)


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.bug_class != "permuted-shards"],
    ids=[c.factory for c in CASES if c.bug_class != "permuted-shards"],
)
def test_no_gather_order_blamed_where_values_really_differ(case: Case) -> None:
    """``permuted-shards`` claims the values are the reference's in the wrong places: a bug that changes
    the values themselves must not get that class."""
    report = report_for(case.factory, case.world)
    assert "permuted-shards" not in [d.bug_class for d in report.diagnosis], failure_message(report)


def test_correct_hybrid_passes_with_repeated_ranges() -> None:
    """The 2x2 hybrid baseline of ``hybrid_replicas_drift``: ranges repeat across replicas and C-ZERO-001
    accepts it (every element owned by 2 ranks, replicas own identical ranges); values match."""
    report = report_for("hybrid_zero1", 4)
    assert report.verdict == "pass", failure_message(report)
    assert report.contracts["C-ZERO-001"].status == "pass"


# ---- the regimes: defaults long enough for late bugs, a named mesh, a trainer that never clips ----------


def test_a_rank_that_stops_updating_late_is_caught_under_the_defaults() -> None:
    """Rank 1 stops from the 5th step of each phase: 4-step phases never see it; the default run (no
    --steps) has 12 per phase and names the rank and the step."""
    factory = "tests.verify_trainers.broken:rank_stops_updating_late"
    report = verify(factory, world=2, timeout_s=LAUNCH_TIMEOUT_S)
    text = failure_message(report)
    assert report.verdict == "fail", text
    step = sgd_step(broken.STOPS_LATE_AFTER_STEPS + 1)(report)
    assert first_failing_step(report, "C-ZERO-002") == step, text
    classes = [d.bug_class for d in report.diagnosis]
    assert "rank-local" in classes and "late-divergence" in classes, text
    in_rank_1_slice(report, step)


def test_a_hybrid_trainer_that_skips_the_replica_reduce_on_an_n_by_1_mesh_is_named() -> None:
    """``--mesh 2x1``: each shard group is one rank, the trainer reduces within it only, so nothing is
    reduced (pytorch #154888's class); its correct twin passes on the same mesh."""
    factory = "tests.verify_trainers.broken:hybrid_skips_replica_reduce"
    report = verify(factory, world=2, steps=4, mesh=(2, 1), timeout_s=LAUNCH_TIMEOUT_S)
    text = failure_message(report)
    assert report.verdict == "fail" and report.extra.get("mesh") == [2, 1], text
    assert first_failing_step(report, "C-ZERO-002") == sgd_step(1)(report), text
    assert "replicas-not-reduced" in [d.bug_class for d in report.diagnosis], text
    correct = verify("tests.verify_trainers.broken:hybrid_mesh_zero1", world=2, steps=4, mesh=(2, 1),
                     timeout_s=LAUNCH_TIMEOUT_S)
    assert correct.verdict == "pass", failure_message(correct)


def test_a_trainer_that_never_clips_is_not_told_its_norm_covers_the_wrong_elements() -> None:
    factory = "tests.verify_trainers.broken:never_clips"
    report = verify(factory, world=2, steps=STEPS, timeout_s=LAUNCH_TIMEOUT_S)
    text = failure_message(report)
    assert first_failing_step(report, "C-ZERO-002") == first_binding_clip(report), text
    clip = next(d.evidence for d in report.diagnosis if d.bug_class == "clip-norm")
    assert "does not clip at all" in clip and "wrong set of elements" not in clip, clip
