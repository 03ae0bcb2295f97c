"""The numpy Muon and Adafactor (zerosim.numerics.optim_matrix) against torch 2.13's torch.optim.Muon /
Adafactor.

Bounds, derived from the arithmetic that differs (u = 2^-24, gamma_n = n u / (1 - n u)):

* Adafactor: both compute the same operations on float32 values; torch sums the squares of a norm in
  float32 (a reduction of at most ``numel`` terms: relative error gamma_numel), ours in float64 and
  rounds once. Every state and parameter value is a short chain of such norms and ten or so rounded
  operations, so per step its relative error is at most ``gamma_numel + 10 u``, and over T steps
  ``T (gamma_numel + 10 u)`` of the tensor's largest magnitude.
* Muon: the momentum buffer (and the AdamW part's moments) is the same lerp, at most one rounding
  apart. The orthogonalised update runs torch's own ``_zeropower_via_newtonschulz`` with its
  bfloat16 cast made a float32 copy, so the two iterations differ only in how a matrix product
  sums its k terms (gamma_k each; ours sums float64 products and rounds once). Each of the
  ``ns_steps`` iterations multiplies a difference by at most |a| + |b| + |c| (the polynomial's
  coefficients; the iterate's norm stays at most 1 + that) and adds three products' errors, so the
  update differs by at most ``3 ns_steps gamma_k (|a| + |b| + |c|)^ns_steps`` of its largest
  magnitude, times the adjusted learning rate per step.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.optim_matrix import (
    MatrixOptimizer,
    TensorSlot,
    adjusted_lr,
    sliced_slots,
    whole_tensor_slots,
)

torch = pytest.importorskip("torch")

U = 2.0**-24
SHAPES = [(64, 16), (16,), (16, 64), (8, 8)]
STEPS = 3


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def _slots() -> list[TensorSlot]:
    slots, pos = [], 0
    for i, shape in enumerate(SHAPES):
        slots.append(TensorSlot(f"t{i}", shape, pos))
        pos += math.prod(shape)
    return slots


def _train(spec: OptimizerSpec, torch_opts, seed: int = 0):
    """Ours and torch's optimizer stepped on the same parameters and gradients for STEPS steps."""
    rng = np.random.default_rng(seed)
    slots = _slots()
    n = sum(s.numel for s in slots)
    ours = MatrixOptimizer(spec, slots)
    p = rng.standard_normal(n).astype(np.float32)
    state = ours.init_state(n)
    params = [torch.nn.Parameter(torch.from_numpy(p[s.position:s.position + s.numel].reshape(s.shape).copy()))
              for s in slots]
    theirs = torch_opts(params)
    for _ in range(STEPS):
        g = rng.standard_normal(n).astype(np.float32)
        for s, t in zip(slots, params, strict=True):
            t.grad = torch.from_numpy(g[s.position:s.position + s.numel].reshape(s.shape).copy())
        ours.step(p, g, state)
        for o in theirs:
            o.step()
    return slots, p, state, params, theirs


def _their_state(theirs, param) -> dict:
    return next(o.state[param] for o in theirs if param in o.state)


def test_adafactor_matches_torch_within_the_norms_rounding():
    spec = OptimizerSpec.parse("adafactor", lr=1e-2, weight_decay=0.01)
    slots, p, state, params, theirs = _train(
        spec, lambda ps: [torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.01, foreach=False)])
    assert state["step"] == STEPS
    for s, t in zip(slots, params, strict=True):
        rel = STEPS * (gamma(s.numel) + 10 * U)
        got = p[s.position:s.position + s.numel]
        want = t.detach().numpy().ravel()
        assert np.abs(got - want).max() <= rel * np.abs(want).max(), s
        for key, value in _their_state(theirs, t).items():
            if key == "step":
                assert int(value) == STEPS
                continue
            full = np.broadcast_to(value.numpy(), s.shape).ravel()  # ours holds row_var / col_var expanded
            mine = state[key][s.position:s.position + s.numel]
            assert np.abs(mine - full).max() <= rel * np.abs(full).max(), (s, key)
        others = {"row_var", "col_var"} if len(s.shape) == 1 else {"variance"}
        for key in others:  # the statistics this tensor's kind does not keep stay zero
            assert not state[key][s.position:s.position + s.numel].any()


def test_muon_matches_torchs_newton_schulz_run_in_float32(monkeypatch):
    spec = OptimizerSpec.parse("muon", lr=0.02, adamw_lr=1e-2)
    # torch's own iteration, its bfloat16 cast turned into a float32 copy
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: self.float().clone())
    slots, p, state, params, theirs = _train(spec, lambda ps: [
        torch.optim.Muon([t for t in ps if t.ndim == 2], lr=0.02),
        torch.optim.AdamW([t for t in ps if t.ndim != 2], lr=1e-2, foreach=False)])
    a, b, c = spec.ns_coefficients
    growth = (abs(a) + abs(b) + abs(c)) ** spec.ns_steps
    for s, t in zip(slots, params, strict=True):
        got = p[s.position:s.position + s.numel]
        want = t.detach().numpy().ravel()
        if len(s.shape) == 2:
            k = max(s.shape)
            update_bound = 3 * spec.ns_steps * gamma(k) * growth  # the update's magnitude is below 1
            lr = adjusted_lr(spec.lr, None, s.shape)
            allowed = STEPS * (lr * update_bound + 4 * U * np.abs(want).max())
        else:
            allowed = STEPS * 16 * U * np.abs(want).max()  # the AdamW part: the same float32 operations
        assert np.abs(got - want).max() <= allowed, s
        for key, value in _their_state(theirs, t).items():
            if key == "step":
                continue
            mine = state[key][s.position:s.position + s.numel]
            assert np.abs(mine - value.numpy().ravel()).max() <= 2 * STEPS * U * np.abs(value.numpy()).max()
        unused = ("exp_avg", "exp_avg_sq") if len(s.shape) == 2 else ("momentum_buffer",)
        for key in unused:
            assert not state[key][s.position:s.position + s.numel].any()


def test_a_sharded_step_on_whole_tensors_is_bitwise_the_full_step():
    """Two owners, each stepping its whole tensors from its own packed shard, give the full step's bits."""
    for name in ("muon", "adafactor"):
        spec = OptimizerSpec.parse(name, lr=0.02)
        slots = _slots()
        n = sum(s.numel for s in slots)
        rng = np.random.default_rng(1)
        p, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        full = MatrixOptimizer(spec, slots)
        st = full.init_state(n)
        expected = p.copy()
        full.step(expected, g, st)
        # owner 0: tensors 0 and 2, owner 1: tensors 1 and 3, each packed at the front of its shard
        for owned in ((0, 2), (1, 3)):
            pieces, pos = [], 0
            for i in owned:
                pieces.append((slots[i].position, slots[i].position + slots[i].numel, pos))
                pos += slots[i].numel
            mine = MatrixOptimizer(spec, whole_tensor_slots_for(pieces))
            shard_p = np.concatenate([p[a:b] for a, b, _ in pieces])
            shard_g = np.concatenate([g[a:b] for a, b, _ in pieces])
            shard_st = mine.init_state(pos)
            mine.step(shard_p, shard_g, shard_st)
            for a, b, at in pieces:
                assert np.array_equal(shard_p[at:at + b - a], expected[a:b])
                for key in spec.state_names:
                    assert np.array_equal(shard_st[key][at:at + b - a], st[key][a:b])


def whole_tensor_slots_for(pieces):
    from zerosim.values.layout import ParamLayout, TensorSpec

    layout = ParamLayout(tuple(TensorSpec(f"t{i}", shape) for i, shape in enumerate(SHAPES)))
    return whole_tensor_slots(layout, pieces)


def test_slices_of_a_matrix_are_stepped_as_something_else():
    from zerosim.values.layout import ParamLayout, TensorSpec

    layout = ParamLayout((TensorSpec("w", (4, 8)), TensorSpec("b", (8,))))
    # rows 0-1 of w are stepped as a 2 x 8 matrix, its last 12 elements as one row, b as it is
    assert [s.shape for s in sliced_slots(layout, [(0, 16, 0)])] == [(2, 8)]
    assert [s.shape for s in sliced_slots(layout, [(20, 40, 0)])] == [(1, 12), (8,)]
    assert [(s.shape, s.position) for s in whole_tensor_slots(layout, [(32, 40, 3)])] == [((8,), 3)]
    with pytest.raises(ConfigError, match="splits tensor w"):
        whole_tensor_slots(layout, [(20, 40, 0)], "fsdp")


@pytest.mark.parametrize("kwargs, field", [
    ({"ns_steps": 0}, "ns_steps"), ({"ns_steps": 100}, "ns_steps"),
    ({"ns_coefficients": (1, 2)}, "ns_coefficients"),
    ({"adjust_lr_fn": "bogus"}, "adjust_lr_fn"), ({"dampening": 0.1}, "dampening"),
    ({"adamw_betas": (0.9, 1.0)}, "adamw_betas[1]"),
])
def test_bad_muon_options_name_the_field(kwargs, field):
    with pytest.raises(ConfigError) as e:
        OptimizerSpec.parse("muon", **kwargs)
    assert e.value.field == field


@pytest.mark.parametrize("name, kwargs, field", [
    ("adafactor", {"beta2_decay": 0.5}, "beta2_decay"), ("adafactor", {"d": 0.5}, "d"),
    ("adafactor", {"momentum": 0.9}, "momentum"), ("adamw", {"ns_steps": 3}, "ns_steps"),
    ("sgd", {"beta2_decay": -0.5}, "beta2_decay"),
])
def test_options_of_another_optimizer_are_refused(name, kwargs, field):
    with pytest.raises(ConfigError) as e:
        OptimizerSpec.parse(name, **kwargs)
    assert e.value.field == field


def test_specs_keep_torchs_defaults_and_their_dicts():
    muon = OptimizerSpec.parse("muon")
    assert (muon.lr, muon.weight_decay, muon.momentum, muon.nesterov, muon.eps) == (
        1e-3, 0.1, 0.95, True, 1e-7)
    ada = OptimizerSpec.parse("adafactor")
    assert (ada.lr, ada.weight_decay, ada.eps, ada.beta2_decay, ada.d, ada.eps1) == (
        1e-2, 0.0, 1e-3, -0.8, 1.0, None)
    assert set(OptimizerSpec.parse("adamw").to_dict()) == {
        "name", "lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps", "max_grad_norm"}
    d = muon.to_dict()
    assert d["ns_coefficients"] == [3.4445, -4.775, 2.0315] and "beta2_decay" not in d
    assert OptimizerSpec(**{**d, "ns_coefficients": d["ns_coefficients"]}) == muon  # JSON lists read back
    with pytest.raises(ConfigError, match="not elementwise"):
        make_optimizer(muon)
    assert muon.state_names == ("momentum_buffer", "exp_avg", "exp_avg_sq")
    assert ada.state_names == ("row_var", "col_var", "variance")


def test_newton_schulz_gives_the_same_bits_whatever_the_blas_threads():
    """The engine's ranks and the references (a child process with one BLAS thread, where that pays)
    must agree to the bit: the iteration's float64 products rounded once do, with 1 and 3 threads."""
    import os
    import subprocess
    import sys

    program = ("import hashlib, numpy as np; from zerosim.numerics.optim_matrix import newton_schulz; "
               "g = np.random.default_rng(0).standard_normal((1536, 384)).astype(np.float32); "
               "x = newton_schulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7); "
               "print(hashlib.sha256(x.tobytes()).hexdigest())")
    digests = set()
    for threads in ("1", "3"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads}
        out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1
