"""Stacked micro-batches (``BlockModel.stacked_loss_and_grads``) give each micro-batch bitwise the loss
and gradients of running it alone, and the references built on them reduce exactly as before.

The ground truth's per-(rank, micro) passes and the ordered reference run micro-batches in stacks;
C-ZERO-002's bitwise comparison against the engine (which runs one micro-batch at a time) depends on
this equality, so it is asserted bit for bit, in every precision and for odd shapes.
"""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.flat import flatten, unflatten
from zerosim.numerics.groundtruth import STACK_ELEMENTS, local_gradients
from zerosim.numerics.model import BlockModel, SimModelConfig, init_params, sim_layout, synthetic_batch
from zerosim.numerics.precision import Precision

SHAPES = [
    {},
    {"batch_size": 1, "seq_len": 1},
    {"batch_size": 3, "seq_len": 5},
    {"vocab_size": 97, "d_model": 24, "d_ff": 40, "n_layer": 3, "seq_len": 7},
]


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_stack_equals_each_micro_batch_alone(precision: str, shape: dict[str, int]) -> None:
    cfg = SimModelConfig.from_preset("tiny", **shape)
    model = BlockModel(cfg, "numpy")
    layout = sim_layout(cfg)
    prec = Precision.parse(precision)
    params = unflatten(prec.to_params(flatten(init_params(cfg, 3), layout), "numpy"), layout)
    pairs = [synthetic_batch(cfg, 1, 2, r, 0) for r in range(5)]
    tokens = np.stack([p[0] for p in pairs])
    targets = np.stack([p[1] for p in pairs])
    for scale in (1.0, 1.0 / 5):
        losses, grads = model.stacked_loss_and_grads(params, tokens, targets, scale)
        for i, (tok, tgt) in enumerate(pairs):
            loss, alone = model.loss_and_grads(params, tok, tgt, scale)
            assert losses[i] == loss
            for name, g in alone.items():
                assert grads[name][i].dtype == g.dtype and grads[name][i].shape == g.shape
                assert _bits(grads[name][i]) == _bits(g), (precision, shape, i, name)


def test_local_gradients_in_rank_major_order_across_stacks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Split into several stacks (a tiny element budget), rows still come rank-major then micro and
    each is that micro-batch's own float32 gradient."""
    cfg = SimModelConfig.from_preset("tiny")
    model = BlockModel(cfg, "numpy")
    layout = sim_layout(cfg)
    prec = Precision.parse("bf16")
    params = unflatten(prec.to_params(flatten(init_params(cfg, 0), layout), "numpy"), layout)
    monkeypatch.setattr("zerosim.numerics.groundtruth.STACK_ELEMENTS", 2 * layout.total_numel)
    assert STACK_ELEMENTS > 2 * layout.total_numel  # the default would run all six in one stack
    rows, sizes = [], []
    for losses, stack in local_gradients(model, params, prec, cfg, 4, 1, 3, 2):
        sizes.append(len(losses))
        rows += [(loss, stack[i]) for i, loss in enumerate(losses)]
    assert sizes == [2, 2, 2]
    for (loss, row), (r, m) in zip(rows, [(r, m) for r in range(3) for m in range(2)], strict=True):
        alone_loss, alone = model.loss_and_grads(params, *synthetic_batch(cfg, 4, 1, r, m))
        assert loss == alone_loss
        assert _bits(row) == _bits(prec.grad_to_master(flatten(alone, layout), "numpy"))


def test_stack_needs_three_axes() -> None:
    cfg = SimModelConfig.from_preset("tiny")
    model = BlockModel(cfg, "numpy")
    tokens, targets = synthetic_batch(cfg, 0, 0, 0, 0)
    with pytest.raises(ConfigError, match="tokens"):
        model.stacked_loss_and_grads(init_params(cfg, 0), tokens, targets)
