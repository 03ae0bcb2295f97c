"""The array-namespace seam: numpy and torch give the same model and optimizer results.

* Optimizers use only elementwise IEEE ops plus the seam's ``fma`` and ``sqrt`` (the same emulation
  on both backends): bitwise identical on numpy and torch CPU.
* The model uses matrix products (different BLAS on each side): float64 agrees to 1e-12 normwise,
  float32 to 1e-5 (accumulated float32 roundings of sums over d_ff and vocab elements). 16-bit
  parameters: the model computes in float32 and rounds each gradient to 16 bits once, at the end;
  rounding to nearest moves a value by at most half a 16-bit spacing, so the two sides' 16-bit
  gradients differ by at most their float32 difference (the float32 bound) plus one 16-bit spacing,
  element by element, whichever BLAS kernels ran.
"""

from __future__ import annotations

from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.numerics.flat import flatten
from zerosim.numerics.groundtruth import train_ground_truth
from zerosim.numerics.model import BlockModel, SimModelConfig, init_params, sim_layout, synthetic_batch
from zerosim.numerics.optim import OptimizerSpec, make_optimizer
from zerosim.numerics.xp import get_namespace, namespace_of, numpy_namespace, torch_namespace

torch = pytest.importorskip("torch")

TINY = SimModelConfig.from_preset("tiny")
NP = numpy_namespace()
TH = torch_namespace("cpu")


def _normwise(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-300))


FLOAT32_TOL = 1e-5


def _spacing(x: np.ndarray, dtype: str) -> np.ndarray:
    """Distance between adjacent values of the 16-bit ``dtype`` at magnitude ``|x|``."""
    info = ml_dtypes.finfo(getattr(ml_dtypes, dtype) if dtype == "bfloat16" else np.float16)
    ax = np.abs(np.asarray(x, dtype=np.float64))
    exp = np.floor(np.log2(np.where(ax > 0, ax, 1.0)))
    return np.maximum(2.0 ** (exp - info.nmant), float(info.smallest_subnormal))


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("float32", FLOAT32_TOL), ("bfloat16", None),
                                       ("float16", None)])
def test_model_forward_backward_match_across_namespaces(dtype, tol):
    params = {k: NP.astype(v, dtype) for k, v in init_params(TINY, 0).items()}
    tokens, targets = synthetic_batch(TINY, 0, 0, 0, 0)
    loss_np, g_np = BlockModel(TINY, NP).loss_and_grads(params, tokens, targets, loss_scale=0.25)
    tparams = {k: TH.from_numpy(v) for k, v in params.items()}
    loss_th, g_th = BlockModel(TINY, "torch").loss_and_grads(tparams, tokens, targets, loss_scale=0.25)
    assert loss_th == pytest.approx(loss_np, rel=tol or FLOAT32_TOL)  # the loss stays in float32
    for k in g_np:
        assert isinstance(g_th[k], torch.Tensor)
        assert TH.dtype_name(g_th[k]) == NP.dtype_name(g_np[k]) == dtype
        a, b = TH.to_numpy(g_th[k]).astype(np.float64), g_np[k].astype(np.float64)
        if tol is not None:
            assert _normwise(a, b) < tol, k
            continue
        bound = FLOAT32_TOL * np.max(np.abs(b)) + _spacing(np.maximum(np.abs(a), np.abs(b)), dtype)
        bad = np.flatnonzero(np.abs(a - b) > bound)
        assert bad.size == 0, f"{k}[{bad[:3]}]: torch {a.flat[bad[:3]]} numpy {b.flat[bad[:3]]}"


def test_per_block_hidden_states_match():
    params = init_params(TINY, 1)
    tokens, targets = synthetic_batch(TINY, 1, 0, 0, 0)
    m_np, m_th = BlockModel(TINY, NP), BlockModel(TINY, TH)
    x_np, x_th = tokens, TH.from_numpy(tokens)
    for block in m_np.block_names:
        names = m_np.tensor_names(block)
        x_np, _ = m_np.forward(
            block, {n: params[n] for n in names}, x_np, targets if block == "lm_head" else None
        )
        x_th, _ = m_th.forward(block, {n: TH.from_numpy(params[n]) for n in names}, x_th,
                               TH.from_numpy(targets) if block == "lm_head" else None)
        assert _normwise(TH.to_numpy(x_th), x_np) < 1e-5, block


@pytest.mark.parametrize("name,opts", [
    ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(momentum=0.9, dampening=0.2)),
    ("adam", dict(weight_decay=0.1)),
    ("adamw", dict(betas=(0.3, 0.95))),
])
@pytest.mark.parametrize("via_numpy", [False, True], ids=["torch-ops", "numpy-views"])
def test_optimizers_are_bitwise_identical_across_namespaces(name, opts, via_numpy):
    """torch-ops: torch's own operations (what a GPU runs); numpy-views: CPU tensors stepped by numpy
    on views of their memory (the default on the CPU)."""
    spec = OptimizerSpec.parse(name, lr=1e-2, **opts)
    rng = np.random.default_rng(0)
    n = 2053
    p_np = rng.standard_normal(n).astype(np.float32)
    p_th = TH.from_numpy(p_np, copy=True)
    o_np, o_th = make_optimizer(spec, NP), make_optimizer(spec, TH)
    o_th.cpu_via_numpy = via_numpy
    s_np, s_th = o_np.init_state(n), o_th.init_state(n)
    for _ in range(6):
        g = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 0, n)).astype(np.float32)
        o_np.step(p_np, g, s_np)
        o_th.step(p_th, TH.from_numpy(g), s_th)
        np.testing.assert_array_equal(TH.to_numpy(p_th), p_np)
        for k in spec.state_names:
            np.testing.assert_array_equal(TH.to_numpy(s_th[k]), s_np[k])
        assert s_th["step"] == s_np["step"]


@pytest.mark.parametrize("name,opts", [
    ("sgd", dict()),
    ("sgd", dict(weight_decay=0.01)),
    ("sgd", dict(momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("sgd", dict(momentum=0.9, dampening=0.2)),
    ("adam", dict(weight_decay=0.1)),
    ("adam", dict(betas=(0.6, 0.99))),
    ("adamw", dict()),
    ("adamw", dict(betas=(0.3, 0.95), weight_decay=0.0)),
])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_in_place_numpy_update_is_bitwise_the_generic_one(name, opts, dtype, monkeypatch):
    """On numpy the optimizer writes every intermediate into preallocated scratch memory
    (``_update_into``); the generic ``_update`` (what torch and other dtypes run) must give the same
    bits: chunk boundaries (a 1000-element chunk over 2503 elements), zeros, subnormals, huge and
    non-finite gradients included. ``betas=(0.6, ...)`` takes lerp's other branch (weight >= 0.5)."""
    import zerosim.numerics.optim as optim

    monkeypatch.setattr(optim, "CHUNK", 1000)
    spec = OptimizerSpec.parse(name, lr=1e-2, **opts)
    rng = np.random.default_rng(3)
    n = 2503
    p0 = rng.standard_normal(n).astype(dtype)
    results = []
    for in_place in (True, False):
        if not in_place:
            monkeypatch.setattr(optim._Scratch, "for_arrays", classmethod(lambda cls, *a: None))
        opt = make_optimizer(spec, NP)
        p, st = p0.copy(), opt.init_state(n, dtype)
        g_rng = np.random.default_rng(4)
        for _ in range(5):
            g = (g_rng.standard_normal(n) * 10.0 ** g_rng.uniform(-8, 3, n)).astype(dtype)
            g[:4] = [0.0, np.finfo(dtype).smallest_subnormal, np.finfo(dtype).max / 4, -np.inf]
            g[7] = np.nan
            with np.errstate(all="ignore"):
                opt.step(p, g, st)
        results.append((p, *(st[k] for k in spec.state_names)))
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_a_subclass_overriding_only_the_generic_update_runs_its_own_update():
    """A variant (here a deliberately wrong one) that overrides ``_update`` must not be bypassed by
    the in-place numpy form of its parent's update."""
    from zerosim.numerics.optim import AdamW

    class NoBiasCorrection(AdamW):
        def _update(self, p, g, st, t):
            super()._update(p, g, st, 10**6)

    spec = OptimizerSpec.parse("adamw", lr=1e-2)
    g = np.linspace(-1, 1, 64, dtype=np.float32)
    p_ok, p_bad = np.ones(64, np.float32), np.ones(64, np.float32)
    make_optimizer(spec, NP).step(p_ok, g, make_optimizer(spec, NP).init_state(64))
    bad = NoBiasCorrection(spec, NP)
    bad.step(p_bad, g, bad.init_state(64))
    assert not np.array_equal(p_ok, p_bad)


def test_ground_truth_on_torch_matches_numpy():
    spec = OptimizerSpec.parse("adamw", lr=1e-3, max_grad_norm=1.0)
    a = train_ground_truth(TINY, spec, "bf16", 2, 2, 3, seed=0)
    b = train_ground_truth(TINY, spec, "bf16", 2, 2, 3, seed=0, xp="torch")
    assert b.losses == pytest.approx(a.losses, rel=1e-6)
    # Normwise relative to how far training moved the weights (measured 1.6e-6): the matmuls differ
    # in the last float32 bit, which moves a few bf16 gradient roundings by one bf16 ulp.
    moved = np.linalg.norm(a.final_params - a.initial_params)
    assert np.linalg.norm(a.final_params - b.final_params) < 1e-4 * moved


def test_fma_is_a_single_rounding():
    rng = np.random.default_rng(1)
    a = rng.standard_normal(300).astype(np.float32)
    b = rng.standard_normal(300).astype(np.float32)
    c = (rng.standard_normal(300) * 1e-3).astype(np.float32)
    for ns in (NP, TH):
        got = ns.to_numpy(ns.fma(ns.from_numpy(a), ns.from_numpy(b), ns.from_numpy(c)))
        for i in range(300):
            exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
            # correctly rounded to float32: no float32 value is closer to the exact result
            err = abs(Fraction(float(got[i])) - exact)
            for nb in (np.nextafter(got[i], np.float32(np.inf)), np.nextafter(got[i], np.float32(-np.inf))):
                assert err <= abs(Fraction(float(nb)) - exact)
        # a scalar multiplier is rounded to float32 first (torch's alpha)
        np.testing.assert_array_equal(ns.to_numpy(ns.fma(ns.from_numpy(a), 0.1, ns.from_numpy(c))),
                                      NP.fma(a, float(np.float32(0.1)), c))


def test_sqrt_is_correctly_rounded_on_both():
    x = np.random.default_rng(2).random(100_003).astype(np.float32) + 0.1
    exact = np.sqrt(x.astype(np.float64)).astype(np.float32)  # exact rounding for float32 sqrt
    np.testing.assert_array_equal(NP.sqrt(x), exact)
    np.testing.assert_array_equal(TH.to_numpy(TH.sqrt(TH.from_numpy(x))), exact)


def test_conversions_dtypes_and_helpers():
    a = np.array([1.5, -2.25, 3e-3], dtype=np.float32)
    for name in ("bfloat16", "float16", "float32", "float64"):
        x = NP.astype(a, name)
        t = TH.from_numpy(x)
        assert TH.dtype_name(t) == NP.dtype_name(x) == name
        back = TH.to_numpy(t)
        assert back.dtype == x.dtype
        np.testing.assert_array_equal(back.view(np.uint8), x.view(np.uint8))  # bit-exact round trip
        assert TH.nbytes(t) == NP.nbytes(x) == x.nbytes
    assert NP.astype(a, "bf16").dtype == ml_dtypes.bfloat16
    # same rounding of fp32 -> bf16 on both sides
    r = np.random.default_rng(3).standard_normal(10_000).astype(np.float32)
    np.testing.assert_array_equal(TH.to_numpy(TH.astype(TH.from_numpy(r), "bfloat16")).view(np.uint16),
                                  NP.astype(r, "bfloat16").view(np.uint16))
    for ns in (NP, TH):
        z = ns.zeros((2, 3), "float16")
        assert tuple(z.shape) == (2, 3) and ns.dtype_name(z) == "float16"
        assert tuple(ns.empty(5).shape) == (5,)
        c = ns.concat([ns.zeros(2), ns.from_numpy(np.ones(3, np.float32))])
        np.testing.assert_array_equal(ns.to_numpy(c), [0, 0, 1, 1, 1])
        flat = ns.zeros(6)
        ns.assign(flat[2:4], ns.from_numpy(np.array([5.0, 6.0])))  # cast float64 -> float32 into a view
        ns.assign(flat[4:], 7.0)
        np.testing.assert_array_equal(ns.to_numpy(flat), [0, 0, 5, 6, 7, 7])
        assert ns.sum_of_squares(ns.from_numpy(np.array([3.0, 4.0], np.float32))) == 25.0
        assert ns.isfinite_all(flat) and not ns.isfinite_all(ns.from_numpy(np.array([1.0, np.nan])))
        out = ns.index_add_rows(
            4, ns.from_numpy(np.array([1, 3, 1])), ns.from_numpy(np.ones((3, 2), np.float32))
        )
        np.testing.assert_array_equal(ns.to_numpy(out), [[0, 0], [2, 2], [0, 0], [1, 1]])
        assert ns.to_float(ns.sum(flat)) == 25.0
        cp = ns.copy(flat)
        ns.assign(cp, 0.0)
        assert ns.to_float(ns.sum(flat)) == 25.0
    assert namespace_of(np.zeros(1)) is NP and namespace_of(torch.zeros(1)) is TH
    assert get_namespace(None) is NP and get_namespace("torch") is TH and get_namespace(TH) is TH
    assert NP.matmul is not None and TH.reshape is not None  # standard functions are delegated


def test_flatten_on_torch():
    layout = sim_layout(TINY)
    params = {k: TH.from_numpy(v) for k, v in init_params(TINY, 0).items()}
    flat = flatten(params, layout)
    assert isinstance(flat, torch.Tensor)
    np.testing.assert_array_equal(TH.to_numpy(flat), flatten(init_params(TINY, 0), layout))


def test_bad_namespace_arguments():
    with pytest.raises(ConfigError) as e:
        get_namespace("jax")
    assert e.value.field == "xp"
    with pytest.raises(ConfigError) as e:
        namespace_of([1, 2])
    assert e.value.field == "array"
    with pytest.raises(ConfigError) as e:
        NP.dtype("float8")
    assert e.value.field == "dtype"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("values", "finite"), [
    ([1.0, -2.0, 0.5], True),
    ([60000.0, 60000.0, 60000.0], True),  # the float16 sum overflows: decided element by element
    ([1.0, float("nan"), 2.0], False),
    ([float("inf"), float("-inf")], False),  # the sum is NaN, not Inf
    ([], True),
])
def test_isfinite_all_never_trusts_an_overflowing_sum(dtype: str, values: list, finite: bool) -> None:
    for ns in (NP, TH):
        arr = ns.astype(ns.from_numpy(np.asarray(values, dtype=np.float64)), dtype)
        assert ns.isfinite_all(arr) is finite, (ns.backend, dtype, values)


def test_the_numpy_namespace_is_numpy_itself_and_imports_none_of_its_unused_submodules():
    """numpy 2.1 and later is an array-API namespace of its own: the simulator uses it directly, so a
    process that builds the numpy namespace (each MPI rank does) never imports numpy's f2py, testing
    or masked-array submodules, as wrapping numpy in array_api_compat would (about 0.2 CPU-s)."""
    import subprocess
    import sys

    from zerosim.numerics.xp import NUMPY_IS_ARRAY_API

    if not NUMPY_IS_ARRAY_API:
        pytest.skip(f"numpy {np.__version__} predates the 2023.12 array API: array_api_compat wraps it")
    assert numpy_namespace().xp is np
    code = ("import sys; from zerosim.numerics.xp import numpy_namespace; numpy_namespace(); "
            "print(sorted(m for m in ('numpy.f2py', 'numpy.testing', 'numpy.ma') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
