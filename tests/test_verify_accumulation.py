"""``zerosim verify --grad-accum K`` and the logged gradient norm (C-ZERO-008).

Pure tests first: the option's validation, the reference's mean over K x world micro-batches, the
traffic band under accumulation, the logged-norm bound against a float32 sum of squares. Then real
launches (world 2, 4 steps): every built-in adapter passes with K = 3 (one launch each), and each
broken trainer of ``tests/verify_trainers/accumulation.py`` fails with its bug class named.
"""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zerosim.checks.logged_norm import check_logged_norm  # noqa: E402
from zerosim.checks.tolerance import logged_norm_bound  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.values.observe import TrainerObservation  # noqa: E402
from zerosim.verify.adapters import ADAPTERS, missing_requirement  # noqa: E402
from zerosim.verify.model import build_model, micro_batch  # noqa: E402
from zerosim.verify.reference import Reference  # noqa: E402
from zerosim.verify.run_value import MAX_GRAD_ACCUM, VerifyRun, require_grad_accum  # noqa: E402

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "max_grad_norm": None}


# ---- the option ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -1, MAX_GRAD_ACCUM + 1, 10**6, True, "3", 2.0])
def test_grad_accum_outside_its_range_is_refused_naming_the_field(value: object) -> None:
    with pytest.raises(ConfigError) as e:
        require_grad_accum(value)
    assert e.value.field == "grad_accum"
    with pytest.raises(ConfigError):
        VerifyRun("ddp", world=2, grad_accum=value).validate()  # type: ignore[arg-type]


def test_grad_accum_round_trips_through_the_run_file() -> None:
    run = VerifyRun("ddp", world=2, grad_accum=3).validate()
    assert VerifyRun.from_json(run.to_json()) == run
    assert VerifyRun.from_json({**run.to_json(), "grad_accum": 1}).grad_accum == 1
    with pytest.raises(ConfigError, match="grad_accum"):
        VerifyRun.from_json({**run.to_json(), "grad_accum": "3"})


@pytest.mark.parametrize("value", ["0", "1000000"])
def test_cli_refuses_a_bad_grad_accum_in_one_line_before_starting_ranks(value: str) -> None:
    p = subprocess.run([sys.executable, "-m", "zerosim", "verify", "ddp", "--world", "2",
                        "--grad-accum", value], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "grad_accum" in lines[0] and value in lines[0], p.stderr


# ---- the reference -------------------------------------------------------------------------------------


def test_micro_batch_zero_is_the_unaccumulated_batch_and_others_differ() -> None:
    a, b = micro_batch(1, 3), micro_batch(1, 3, micro=0)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(micro_batch(1, 3, micro=1)[0], a[0])
    assert not torch.equal(micro_batch(1, 3, micro=1)[0], micro_batch(2, 3)[0])


def test_reference_steps_on_the_mean_gradient_of_all_k_times_world_micro_batches() -> None:
    world, k = 2, 3
    model = build_model("gpt")
    ref = Reference(model, SGD, world, grad_accum=k).step(1)
    # by hand: the mean over every (rank, micro) micro-batch's gradient at the initial weights
    m = build_model("gpt").to(torch.float64)
    grads = {n: np.zeros(tuple(p.shape)) for n, p in m.named_parameters()}
    for r in range(world):
        for j in range(k):
            m.zero_grad()
            m(*micro_batch(r, 1, micro=j)).backward()
            for n, p in m.named_parameters():
                grads[n] += p.grad.numpy() / (world * k)
    for n, g in grads.items():
        scale = np.max(np.abs(g)) + 1e-300
        assert np.max(np.abs(ref.grad[n] - g)) <= 1e-12 * scale, n
    assert len(ref.micro_grads) == k
    for n, g in grads.items():  # the per-micro-batch means average to the step's gradient
        mean = sum(mg[n] for mg in ref.micro_grads) / k
        assert np.max(np.abs(mean - g)) <= 1e-12 * (np.max(np.abs(g)) + 1e-300)
    assert Reference(model, SGD, world).step(1).micro_grads == []


# ---- C-ZERO-005 under accumulation ----------------------------------------------------------------------


def test_traffic_band_under_accumulation_widens_only_for_sharded_gradients() -> None:
    from zerosim.checks.holdings import as_layout, strategy_from_declared
    from zerosim.checks.traffic import traffic_band

    layout = as_layout(build_model("gpt"))
    band = {}
    for declared in ("ddp", "zero1", "zero2", "zero3"):
        strategy = strategy_from_declared(declared)
        one = traffic_band(layout, strategy, 2, 0, 8, 8, "fsdp", "all_reduce", 1)
        three = traffic_band(layout, strategy, 2, 0, 8, 8, "fsdp", "all_reduce", 3)
        band[declared] = (one, three)
    for declared in ("ddp", "zero1"):  # one reduction per step, accumulated or not
        assert band[declared][0] == band[declared][1]
    for declared in ("zero2", "zero3"):  # from one reduction per step to one per micro-batch
        (lo1, hi1), (lo3, hi3) = band[declared][0]["reduce"], band[declared][1]["reduce"]
        assert lo3 == lo1 and hi3 == 3 * hi1
    lo, hi = band["zero3"][1]["gather"]
    assert hi == 3 * band["zero3"][0]["gather"][1] and lo == band["zero3"][0]["gather"][0]
    assert band["zero2"][1]["gather"] == band["zero2"][0]["gather"]
    assert all(isinstance(x, Fraction) for x in band["zero3"][1]["reduce"])


# ---- C-ZERO-008, the logged norm -----------------------------------------------------------------------


def _record(ref_norm: float, grad_bound: dict[str, np.ndarray], logged: list[float | None],
            shards: list[dict[str, list[tuple[int, int]]]] | None = None) -> SimpleNamespace:
    ranks = [TrainerObservation("sgd", 1, r, 0.0, {}, None, shards[r] if shards else None, None, norm)
             for r, norm in enumerate(logged)]
    return SimpleNamespace(step=1, phase="sgd", ranks=ranks, ref=SimpleNamespace(grad_norm=ref_norm),
                           bounds=SimpleNamespace(grad=grad_bound))


def test_logged_norm_bound_covers_a_float32_sum_of_squares_in_any_order() -> None:
    """The derivation's claim, measured: the float32 norm of a float64 gradient, summed in shards and
    then across ranks, differs from the exact norm by less than the bound (dg = the float32 rounding
    of the gradient itself, as C-ZERO-002's bound would allow)."""
    rng = np.random.default_rng(0)
    for trial in range(20):
        g = rng.standard_normal(5000) * rng.uniform(1e-3, 10)
        exact = float(np.linalg.norm(g))
        g32 = g.astype(np.float32)
        world = 4
        parts = np.array_split(rng.permutation(g32), world)
        partial = [np.float32(0)] * world
        for r, part in enumerate(parts):
            for x in part[::-1] if trial % 2 else part:
                partial[r] = np.float32(partial[r] + np.float32(x * x))
        logged = float(np.sqrt(np.float32(sum(partial[::-1]))))
        dg = {"g": np.abs(g - g32.astype(np.float64))}
        bound = logged_norm_bound(exact, dg, 2.0**-24, world)
        assert abs(logged - exact) <= bound
        assert bound < 1e-2 * exact  # and it is not vacuous


def test_a_norm_of_one_ranks_shard_fails_and_a_correct_norm_passes() -> None:
    g = np.linspace(-1.0, 2.0, 40)
    norm = float(np.linalg.norm(g))
    tiny = {"w": np.full(40, 1e-16)}
    good = check_logged_norm([_record(norm, tiny, [norm, norm * (1 + 1e-15)])], {"sgd": 2.0**-53})
    assert good.passed and good.details["error_over_tolerance"] < 1
    local = float(np.linalg.norm(g[:20]))
    bad = check_logged_norm([_record(norm, tiny, [local, norm])], {"sgd": 2.0**-53})
    assert not bad.passed
    v = bad.violations[0]
    assert v.clause == "logged_norm" and v.ranks == (0,) and v.got == local and v.expected == norm
    assert "rank 0" in v.message and v.error > v.tolerance
    skipped = check_logged_norm([_record(norm, tiny, [None, None])], {"sgd": 2.0**-53})
    assert skipped.passed and "last_grad_norm" in skipped.details["skipped"]


# ---- real launches ---------------------------------------------------------------------------------------

LAUNCH_TIMEOUT_S = 300
K = 3


def _run(target: str, world: int = 2, steps: int = 4, grad_accum: int = K) -> object:
    from zerosim.verify import verify

    return verify(target, world=world, steps=steps, timeout_s=LAUNCH_TIMEOUT_S, grad_accum=grad_accum)


@pytest.mark.torchdist
@pytest.mark.slow
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_every_adapter_passes_with_gradient_accumulation(name: str) -> None:
    reason = missing_requirement(name)
    if reason:
        pytest.skip(reason)
    report = _run(name)
    failed = {cid: o.reason for cid, o in report.contracts.items() if o.status == "fail"}
    known = {"deepspeed-2": {"C-ZERO-005"}, "deepspeed-3": {"C-ZERO-005"}}.get(name, set())
    assert set(failed) <= known, failed
    for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-008"):
        assert report.contracts[cid].status == "pass", (cid, report.contracts[cid].reason)
    assert report.extra["grad_accum"] == K


@pytest.mark.torchdist
def test_a_trainer_without_step_accumulated_is_bad_input_naming_the_method() -> None:
    p = subprocess.run([sys.executable, "-m", "zerosim", "verify", "examples.zero1_trainer:make_trainer",
                        "--world", "2", "--steps", "4", "--grad-accum", "2"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "step_accumulated" in lines[0], p.stderr


@pytest.mark.torchdist
@pytest.mark.parametrize(("factory", "bug_class"), [("last_micro_batch_only", "accumulation-dropped"),
                                                    ("summed_micro_batches", "accumulation-sum")])
def test_a_broken_accumulation_fails_with_its_class(factory: str, bug_class: str) -> None:
    report = _run(f"tests.verify_trainers.accumulation:{factory}", steps=4)
    assert report.verdict == "fail"
    assert report.contracts["C-ZERO-002"].status == "fail"
    first = min(v["step"] for v in report.contracts["C-ZERO-002"].violations)
    assert first == 1  # the first SGD step already uses the wrong gradient
    classes = [d.bug_class for d in report.diagnosis]
    assert classes[0] == bug_class, report.diagnosis


@pytest.mark.torchdist
def test_a_logged_norm_of_the_local_shard_fails_c_zero_008_with_right_parameters() -> None:
    report = _run("tests.verify_trainers.accumulation:local_shard_norm", steps=4, grad_accum=1)
    statuses = {cid: o.status for cid, o in report.contracts.items()}
    assert statuses["C-ZERO-008"] == "fail"
    for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003"):
        assert statuses[cid] == "pass", (cid, report.contracts[cid].reason)
    assert [d.bug_class for d in report.diagnosis] == ["logged-norm"]
    assert "owns" in report.diagnosis[0].evidence
    first = report.contracts["C-ZERO-008"].violations[0]
    assert first["error"] > first["tolerance"]
