"""Ground truth: unsharded training on every rank's micro-batches, with the full optimizer."""

from __future__ import annotations

import math

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.flat import flatten, unflatten
from zerosim.numerics.groundtruth import global_batch, train_ground_truth
from zerosim.numerics.model import BlockModel, SimModelConfig, init_params, sim_layout, synthetic_batch
from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.xp import numpy_namespace

TINY = SimModelConfig.from_preset("tiny")
ADAM = OptimizerSpec.parse("adam", lr=1e-3)


def test_loss_decreases_with_adam_lr_1e3():
    gt = train_ground_truth(TINY, ADAM, "fp32", world_size=2, micro_batches=2, steps=40, seed=0)
    losses = gt.losses
    assert len(losses) == 40 and all(math.isfinite(v) for v in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.4
    assert [s.step for s in gt.snapshots] == list(range(1, 41))
    assert gt.snapshots[-1].optimizer_step == 40


def test_deterministic_given_the_seed():
    a = train_ground_truth(TINY, ADAM, "fp32", 2, 2, 3, seed=5)
    b = train_ground_truth(TINY, ADAM, "fp32", 2, 2, 3, seed=5)
    c = train_ground_truth(TINY, ADAM, "fp32", 2, 2, 3, seed=6)
    for sa, sb in zip(a.snapshots, b.snapshots, strict=True):
        np.testing.assert_array_equal(sa.params, sb.params)
        for k in sa.state:
            np.testing.assert_array_equal(sa.state[k], sb.state[k])
        assert (sa.loss, sa.grad_norm) == (sb.loss, sb.grad_norm)
    assert not np.array_equal(a.final_params, c.final_params)


def test_concatenated_batch_grad_equals_mean_of_micro_batch_grads():
    """Equal-sized micro-batches: mean over the concatenation == mean of per-micro means. Exact in
    real arithmetic (float64 shows it to 1e-13); in float32 the two sum in different orders, so
    they agree to a few float32 roundings of the accumulated sums (normwise 1e-5)."""
    W, M = 3, 2
    tokens, targets = global_batch(TINY, 0, 0, W, M)
    assert tokens.shape == (W * M * TINY.batch_size, TINY.seq_len)
    for dtype, tol in ((np.float64, 1e-13), (np.float32, 1e-5)):
        model = BlockModel(TINY)
        params = {k: v.astype(dtype) for k, v in init_params(TINY, 0).items()}
        loss, grads = model.loss_and_grads(params, tokens, targets)
        mean_loss, mean_grads = 0.0, {k: np.zeros_like(v) for k, v in params.items()}
        for r in range(W):
            for m in range(M):
                lm, gm = model.loss_and_grads(
                    params, *synthetic_batch(TINY, 0, 0, r, m), loss_scale=1 / (W * M)
                )
                mean_loss += lm / (W * M)
                for k in gm:
                    mean_grads[k] += gm[k]
        assert loss == pytest.approx(mean_loss, rel=tol)
        for k in grads:
            err = np.max(np.abs(grads[k] - mean_grads[k])) / np.max(np.abs(grads[k]))
            assert err < tol, (dtype, k, err)


def test_grad_modes_agree_over_training():
    spec = OptimizerSpec.parse("sgd", lr=0.1, momentum=0.9)
    a = train_ground_truth(TINY, spec, "fp32", 2, 3, 5, seed=1, grad_mode="concat")
    b = train_ground_truth(TINY, spec, "fp32", 2, 3, 5, seed=1, grad_mode="micro")
    assert a.losses == pytest.approx(b.losses, rel=1e-6)
    moved = np.linalg.norm(a.final_params - a.initial_params)
    assert np.linalg.norm(a.final_params - b.final_params) / moved < 1e-5


def test_batch_is_rank_major_then_micro():
    tokens, _ = global_batch(TINY, 0, 2, 2, 3)
    B = TINY.batch_size
    for r in range(2):
        for m in range(3):
            i = (r * 3 + m) * B
            np.testing.assert_array_equal(tokens[i:i + B], synthetic_batch(TINY, 0, 2, r, m)[0])


def test_snapshot_matches_an_independent_step():
    """Step 1 recomputed by hand from the pieces: batch, model, clipping, optimizer."""
    spec = OptimizerSpec.parse("adamw", lr=1e-2, max_grad_norm=0.05)
    gt = train_ground_truth(TINY, spec, "fp32", 2, 2, 1, seed=3)
    layout = sim_layout(TINY)
    master = flatten(init_params(TINY, 3), layout)
    np.testing.assert_array_equal(gt.initial_params, master)
    loss, grads = BlockModel(TINY).loss_and_grads(unflatten(master, layout), *global_batch(TINY, 3, 0, 2, 2))
    g = flatten(grads, layout)
    norm = math.sqrt(math.fsum(float(x) ** 2 for x in g))
    snap = gt.snapshots[0]
    assert snap.loss == loss
    # float64 sum of n exact squares in any order: gamma_{n-1} (unit 2**-53), halved by the root, +1 rounding
    n = g.size
    assert snap.grad_norm == pytest.approx(norm, rel=n * 2.0**-53 / (1 - n * 2.0**-53) + 2.0**-53)
    assert snap.clip_coef < 1.0  # max_grad_norm far below the norm: clipped
    # torch's float32 arithmetic: rounding the norm, 1e-6 and 0.05, the add, the reciprocal and the
    # product: six roundings of at most 2**-24 each (gamma_6)
    assert snap.clip_coef == pytest.approx(0.05 / (norm + 1e-6), rel=6 * 2.0**-24 / (1 - 6 * 2.0**-24))
    g *= np.float32(snap.clip_coef)
    opt = make_optimizer(spec, numpy_namespace())
    state = opt.init_state(master.size)
    opt.step(master, g, state)
    np.testing.assert_array_equal(snap.params, master)
    assert set(snap.state) == {"exp_avg", "exp_avg_sq"}
    np.testing.assert_array_equal(snap.state["exp_avg"], state["exp_avg"])
    np.testing.assert_array_equal(
        gt.named_params(1)["lm_head.weight"], unflatten(master, layout)["lm_head.weight"]
    )


def test_sgd_without_momentum_has_no_state():
    gt = train_ground_truth(TINY, OptimizerSpec.parse("sgd", lr=0.1), "fp32", 1, 1, 2, seed=0)
    assert gt.snapshots[0].state == {}
    assert gt.params_after(0) is gt.initial_params


@pytest.mark.parametrize("kwargs,field", [
    (dict(world_size=0), "world_size"),
    (dict(micro_batches=-1), "micro_batches"),
    (dict(steps=1.5), "steps"),
    (dict(precision="fp8"), "precision"),
    (dict(grad_mode="sum"), "grad_mode"),
    (dict(spec="adam"), "optimizer"),
])
def test_bad_arguments_name_the_field(kwargs, field):
    args = dict(cfg=TINY, spec=ADAM, precision="fp32", world_size=1, micro_batches=1, steps=1, seed=0)
    args.update(kwargs)
    with pytest.raises(ConfigError) as e:
        train_ground_truth(**args)
    assert e.value.field == field


def test_params_after_out_of_range():
    gt = train_ground_truth(TINY, ADAM, "fp32", 1, 1, 1, seed=0)
    with pytest.raises(ConfigError) as e:
        gt.params_after(2)
    assert e.value.field == "step"
