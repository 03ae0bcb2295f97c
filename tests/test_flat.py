"""flatten / unflatten: named tensors <-> one flat buffer in layout order."""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.flat import flatten, unflatten
from zerosim.numerics.model import SimModelConfig, init_params, sim_layout

TINY = SimModelConfig.from_preset("tiny")


def test_round_trip_and_offsets():
    layout = sim_layout(TINY)
    params = init_params(TINY, 0)
    flat = flatten(params, layout)
    assert flat.shape == (layout.total_numel,) and flat.dtype == np.float32
    for t in layout.tensors:
        a, b = layout.tensor_range(t.name)
        np.testing.assert_array_equal(flat[a:b], params[t.name].ravel())
    back = unflatten(flat, layout)
    assert list(back) == [t.name for t in layout.tensors]
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])


def test_unflatten_returns_views():
    layout = sim_layout(TINY)
    flat = flatten(init_params(TINY, 0), layout)
    views = unflatten(flat, layout, names=["final_norm.weight"])
    assert list(views) == ["final_norm.weight"]
    views["final_norm.weight"][:] = 7.0
    a, b = layout.tensor_range("final_norm.weight")
    assert np.all(flat[a:b] == 7.0)


def test_errors_name_the_problem():
    layout = sim_layout(TINY)
    params = init_params(TINY, 0)
    with pytest.raises(ConfigError) as e:
        flatten({k: v for k, v in params.items() if k != "lm_head.weight"}, layout)
    assert e.value.value == "lm_head.weight"
    with pytest.raises(ConfigError) as e:
        flatten(dict(params, **{"final_norm.weight": np.zeros(3, np.float32)}), layout)
    assert e.value.field == "final_norm.weight"
    with pytest.raises(ConfigError) as e:
        unflatten(np.zeros(layout.total_numel + 2, np.float32), layout)  # padded: strip first
    assert e.value.field == "flat"
    with pytest.raises(ConfigError) as e:
        unflatten(np.zeros(layout.total_numel, np.float32), layout, names=["nope"])
    assert e.value.field == "names"
