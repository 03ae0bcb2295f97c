"""The block model's hand-written gradients against finite differences, and its block interface.

Finite differences run in float64 (the model computes in float64 for float64 parameters): with a
central difference of step h = 1e-5 the truncation error is O(h^2 * L''') ~ 1e-10 and the rounding
error ~ 1e-16 / h ~ 1e-11, so a relative tolerance of 1e-6 leaves a wide margin while any wrong
term in a gradient (errors of order 1) fails by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.model import (
    BlockModel,
    SimModelConfig,
    init_params,
    sim_layout,
    synthetic_batch,
    target_multiplier,
)
from zerosim.values.presets import get_preset

TINY = SimModelConfig.from_preset("tiny")
H = 1e-5


def _f64(params):
    return {k: v.astype(np.float64) for k, v in params.items()}


@pytest.fixture(scope="module")
def setup():
    model = BlockModel(TINY)
    params = _f64(init_params(TINY, seed=1))
    # Perturb the norm gains away from 1 so their gradients are generic.
    rng = np.random.default_rng(2)
    for k in params:
        if k.endswith("norm.weight"):
            params[k] = params[k] + 0.3 * rng.standard_normal(params[k].shape)
    tokens, targets = synthetic_batch(TINY, seed=1, step=0, rank=0, micro=0)
    loss, grads = model.loss_and_grads(params, tokens, targets, loss_scale=0.5)
    return model, params, tokens, targets, loss, grads


def test_directional_derivatives_match_every_tensor(setup):
    """<grad, v> == (L(p + h v) - L(p - h v)) / 2h for random directions v, one tensor at a time
    (checks every element of every tensor, including repeated-token rows of the embedding)."""
    model, params, tokens, targets, _, grads = setup
    rng = np.random.default_rng(3)
    for name in params:
        for _ in range(2):
            v = rng.standard_normal(params[name].shape)
            plus = dict(params, **{name: params[name] + H * v})
            minus = dict(params, **{name: params[name] - H * v})
            fd = 0.5 * (model.loss(plus, tokens, targets) - model.loss(minus, tokens, targets)) / (2 * H)
            analytic = float(np.sum(grads[name] * v))
            assert analytic == pytest.approx(fd, rel=1e-6, abs=1e-10), name


def test_coordinate_derivatives_match(setup):
    model, params, tokens, targets, _, grads = setup
    rng = np.random.default_rng(4)
    for name, arr in params.items():
        for _ in range(4):
            if name == "embedding.weight":  # rows of tokens in the batch have nonzero gradients
                idx = (int(tokens.flat[rng.integers(tokens.size)]), int(rng.integers(arr.shape[1])))
            else:
                idx = tuple(int(rng.integers(s)) for s in arr.shape)
            e = np.zeros_like(arr)
            e[idx] = H
            lp = model.loss(dict(params, **{name: arr + e}), tokens, targets)
            lm = model.loss(dict(params, **{name: arr - e}), tokens, targets)
            fd = 0.5 * (lp - lm) / (2 * H)
            assert grads[name][idx] == pytest.approx(fd, rel=1e-6, abs=1e-10), (name, idx)


def test_embedding_rows_of_absent_tokens_have_zero_gradient(setup):
    _, _, tokens, _, _, grads = setup
    absent = np.setdiff1d(np.arange(TINY.vocab_size), tokens)
    assert absent.size > 0
    assert np.all(grads["embedding.weight"][absent] == 0)


def test_float32_gradients_match_float64_reference(setup):
    model, params64, tokens, targets, loss64, grads64 = setup
    params32 = {k: v.astype(np.float32) for k, v in params64.items()}
    loss32, grads32 = model.loss_and_grads(params32, tokens, targets, loss_scale=0.5)
    assert loss32 == pytest.approx(loss64, rel=1e-6)
    for k, g in grads32.items():
        assert g.dtype == np.float32
        err = np.max(np.abs(g - grads64[k])) / np.max(np.abs(grads64[k]))
        assert err < 1e-5, k  # float32 compute: a few ulps of accumulated rounding


def test_loss_scale_scales_gradients_linearly(setup):
    model, params, tokens, targets, loss, grads = setup
    loss1, grads1 = model.loss_and_grads(params, tokens, targets, loss_scale=1.0)
    assert loss1 == loss
    for k in grads:
        np.testing.assert_allclose(grads[k], 0.5 * grads1[k], rtol=1e-12, atol=0)


def test_block_by_block_equals_loss_and_grads(setup):
    """The engine's path (forward all blocks, keep caches, backward in reverse, params passed
    again) gives the same loss and gradients as the convenience chain."""
    model, params, tokens, targets, loss, grads = setup
    x, caches = tokens, {}
    for block in model.block_names:
        p = {n: params[n] for n in model.tensor_names(block)}
        x, caches[block] = model.forward(block, p, x, targets if block == "lm_head" else None)
    assert float(x) == loss
    assert x.shape == ()
    dy, got = 0.5, {}
    for block in reversed(model.block_names):
        p = {n: params[n].copy() for n in model.tensor_names(block)}  # "re-gathered" copies
        dy, g = model.backward(block, p, caches[block], dy)
        assert set(g) == set(model.tensor_names(block))
        got.update(g)
    assert dy is None  # the embedding has no input gradient
    for k in grads:
        np.testing.assert_array_equal(got[k], grads[k])


def test_hidden_shapes_and_initial_loss():
    model = BlockModel(TINY)
    params = init_params(TINY, 0)
    tokens, targets = synthetic_batch(TINY, 0, 0, 0, 0)
    x, _ = model.forward("embedding", {"embedding.weight": params["embedding.weight"]}, tokens)
    assert x.shape == (TINY.batch_size * TINY.seq_len, TINY.d_model)
    assert x.dtype == np.float32
    # Initial loss close to ln V (logits of std 1/2): a sane initialisation.
    assert abs(model.loss(params, tokens, targets) - np.log(TINY.vocab_size)) < 0.5


def test_layout_order_blocks_and_counts():
    layout = sim_layout(TINY)
    names = [t.name for t in layout.tensors]
    assert names[0] == "embedding.weight" and names[-2:] == ["final_norm.weight", "lm_head.weight"]
    assert names[1:4] == ["blocks.0.norm.weight", "blocks.0.mlp.w_in", "blocks.0.mlp.w_out"]
    assert [b.name for b in layout.blocks] == ["embedding", "blocks.0", "blocks.1", "final_norm", "lm_head"]
    assert BlockModel(TINY).block_names == tuple(b.name for b in layout.blocks)
    V, d, f, n = TINY.vocab_size, TINY.d_model, TINY.d_ff, TINY.n_layer
    assert layout.total_numel == 2 * V * d + n * (d + 2 * d * f) + d
    assert all(t.dtype == "float32" for t in layout.tensors)
    assert TINY.d_ff == 4 * TINY.d_model


def test_from_gpt_maps_preset_shapes():
    g = get_preset("sim-10m")
    cfg = SimModelConfig.from_gpt(g, batch_size=3)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.d_ff, cfg.seq_len, cfg.batch_size) == (
        g.vocab_size, g.d_model, g.n_layer, g.mlp_ratio * g.d_model, g.seq_len, 3)
    assert SimModelConfig.from_preset("tiny", seq_len=4).seq_len == 4


def test_init_is_deterministic_and_seeded():
    a, b, c = init_params(TINY, 7), init_params(TINY, 7), init_params(TINY, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(v.dtype == np.float32 for v in a.values())


def test_synthetic_batches_are_deterministic_distinct_and_learnable():
    t0, y0 = synthetic_batch(TINY, 0, 0, 0, 0)
    t1, y1 = synthetic_batch(TINY, 0, 0, 0, 0)
    assert np.array_equal(t0, t1) and np.array_equal(y0, y1)
    assert t0.dtype == np.int64 and y0.dtype == np.int64 and t0.shape == (TINY.batch_size, TINY.seq_len)
    others = [synthetic_batch(TINY, 0, 0, 1, 0)[0], synthetic_batch(TINY, 0, 0, 0, 1)[0],
              synthetic_batch(TINY, 0, 1, 0, 0)[0], synthetic_batch(TINY, 1, 0, 0, 0)[0]]
    assert all(not np.array_equal(t0, o) for o in others)
    a = target_multiplier(TINY.vocab_size)
    np.testing.assert_array_equal(y0, (a * t0 + 3) % TINY.vocab_size)
    # The task is a permutation of the vocabulary, so it is learnable exactly.
    assert len(set(((a * np.arange(TINY.vocab_size) + 3) % TINY.vocab_size).tolist())) == TINY.vocab_size


@pytest.mark.parametrize("field,kwargs", [
    ("vocab_size", dict(vocab_size=0)),
    ("batch_size", dict(batch_size=-1)),
    ("d_ff", dict(d_ff=2.5)),
])
def test_bad_config_names_the_field(field, kwargs):
    base = dict(vocab_size=8, d_model=4, n_layer=1, d_ff=8, seq_len=2, batch_size=1)
    with pytest.raises(ConfigError) as e:
        SimModelConfig(**{**base, **kwargs})
    assert e.value.field == field


def test_bad_inputs_raise_config_errors():
    model = BlockModel(TINY)
    params = init_params(TINY, 0)
    tokens, targets = synthetic_batch(TINY, 0, 0, 0, 0)
    with pytest.raises(ConfigError) as e:
        model.tensor_names("blocks.9")
    assert e.value.field == "block"
    with pytest.raises(ConfigError) as e:
        model.loss(params, tokens + TINY.vocab_size, targets)
    assert e.value.field == "tokens"
    with pytest.raises(ConfigError) as e:
        model.forward(
            "lm_head", {"lm_head.weight": params["lm_head.weight"]}, np.zeros((16, TINY.d_model), np.float32)
        )
    assert e.value.field == "targets"
    with pytest.raises(ConfigError) as e:
        model.forward("blocks.0", {}, np.zeros((16, TINY.d_model), np.float32))
    assert e.value.field == "params"
    with pytest.raises(ConfigError) as e:
        synthetic_batch(TINY, 0, -1, 0, 0)
    assert e.value.field == "step"
    with pytest.raises(ConfigError) as e:
        SimModelConfig.from_preset("tiny", heads=3)
    assert e.value.field == "heads"
