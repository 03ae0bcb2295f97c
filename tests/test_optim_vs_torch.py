"""The reference optimizers against torch.optim (foreach=False), and clipping against
torch.nn.utils.clip_grad_norm_, with bounds derived from the arithmetic, not tuned on one processor.

How the bounds are derived (tests/optim_rounding.py holds the model and its docstring the rules):

* Teacher-forced steps. At every step both zerosim and torch start from the SAME float32 parameter,
  gradient and state (torch's result of the previous step) and take one step. Each evaluates the same
  formula with a handful of elementwise float32 operations; under the model every operation is exact
  times ``(1 + d)``, ``|d| <= 2u`` (``u = 2**-24``: faithful rounding, so torch's vectorised ``sqrt``
  that is not correctly rounded, and fused as well as unfused ``a * b + c``, are all covered), and
  every hyper-parameter is rounded to float32 (``u``). Propagating those errors through the formula
  from exact inputs gives, per element, a bound ``e`` on how far EITHER side can be from the exact
  result (for the parameter this includes its final rounding, i.e. the ``ulp(p')`` term, plus
  ``~2 n 2u |update|`` for the n operations of the update, with the cancellation inside
  ``g + wd * p`` or ``v b2 + (1 - b2) g^2`` charged to the intermediate that cancels, not to the
  result). So ``|zerosim - torch| <= 2 e`` element by element, for the parameter and every state
  array: that is what is asserted, on every processor and ``ATEN_CPU_CAPABILITY``.
* With clipping, each side scales the gradient by its own clip factor: torch's float32 norm is within
  ``gamma_{n+8}`` (relative) of the exact one for ANY summation order (n squares, non-negative terms),
  zerosim's float64 norm far inside that, and the model carries the factor's error into the step.
* Free-running runs (each side keeps its own state and gradients depend on its own parameters) use the
  same model, started from the previous step's bound instead of exact inputs: looser, but it is what
  catches state that is not carried from one step to the next.
* Bitwise: SGD and Adam are chains of single IEEE operations (fused multiply-adds where torch's
  kernels fuse: AVX2, AVX-512, arm64), which zerosim reproduces, except Adam's ``sqrt``, which
  torch's vectorised kernel does not always round correctly. Asserted bit for bit only on fused
  kernels: SGD everywhere, Adam's moments everywhere and its parameters wherever torch's ``sqrt``
  is correctly rounded.
"""

from __future__ import annotations

import itertools
import math
import platform

import numpy as np
import pytest
from optim_rounding import (
    Bounded,
    check_step,
    clip_coefficient_model,
    clip_model,
    free_running_run,
    gamma,
    gradient,
    norm_model,
    teacher_forced_run,
)

from zerosim.checks.rounding import UNDERFLOW, UNIT_ROUNDOFF
from zerosim.errors import ConfigError
from zerosim.numerics.optim import (
    OptimizerSpec,
    apply_clip_,
    clip_coefficient,
    global_norm_from_sumsq,
    make_optimizer,
)
from zerosim.numerics.xp import numpy_namespace

torch = pytest.importorskip("torch")

N = 1031  # not a multiple of any SIMD width: exercises the kernels' scalar tails too
STEPS = 12


def _fused_kernels() -> bool:
    """torch's CPU kernels use fused multiply-adds for ``add(alpha=)`` / ``lerp`` / ``addcmul``: the
    AVX2 and AVX-512 kernels on x86 (not ``ATEN_CPU_CAPABILITY=default``), and arm64."""
    if platform.machine().lower() in ("arm64", "aarch64"):
        return True
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except AttributeError:  # pragma: no cover - old torch
        return False


def _report(lines: list[str]) -> str:
    return "\n".join(lines[:12]) + (f"\n... {len(lines) - 12} more" if len(lines) > 12 else "")


SGD_CASES = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd)
    for m, d, n, wd in itertools.product((0.0, 0.9), (0.0, 0.1), (False, True), (0.0, 0.01))
    if not (n and (m == 0 or d != 0)) and not (m == 0 and d != 0)
]
SGD_IDS = [",".join(f"{k}={v}" for k, v in o.items()) for o in SGD_CASES]


@pytest.mark.parametrize("opts", SGD_CASES, ids=SGD_IDS)
def test_sgd_matches_torch_within_the_rounding_model(opts):
    spec = OptimizerSpec.parse("sgd", lr=0.05, **opts)
    assert not (bad := teacher_forced_run(spec, N, STEPS, seed=0)), _report(bad)
    assert not (bad := free_running_run(spec, N, STEPS, seed=1)), _report(bad)


@pytest.mark.skipif(not _fused_kernels(), reason="torch's kernels here round a * b + c twice (no FMA)")
@pytest.mark.parametrize("opts", SGD_CASES, ids=SGD_IDS)
def test_sgd_is_bitwise_on_fused_multiply_add_kernels(opts):
    """Every SGD operation is one IEEE operation (multiply, or fused multiply-add) on both sides, in
    the same order, so the bits agree (zerosim's float64-emulated fma differs from a true fma only
    when the float64 sum lands exactly on a float32 midpoint, ~2**-29 of inputs)."""
    spec = OptimizerSpec.parse("sgd", lr=0.05, **opts)
    rng = np.random.default_rng(0)
    p = rng.standard_normal(N).astype(np.float32)
    state = {k: np.zeros(N, np.float32) for k in spec.state_names}
    for t in range(1, STEPS + 1):
        _, ours, theirs = check_step(spec, p, gradient(rng, p), state, t)
        for k in theirs:
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=f"step {t} {k}")
        p, state = theirs["param"], {k: theirs[k] for k in spec.state_names}


ADAM_CASES = [
    ("adam", dict()),
    ("adam", dict(weight_decay=0.1)),
    ("adam", dict(betas=(0.3, 0.99), eps=1e-6)),  # beta1 < 0.5: torch's other lerp branch
    ("adamw", dict()),  # torch's default weight decay 0.01
    ("adamw", dict(weight_decay=0.1, betas=(0.8, 0.95))),
    ("adamw", dict(weight_decay=0.0)),
]


@pytest.mark.parametrize("name,opts", ADAM_CASES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_adam_matches_torch_within_the_rounding_model(name, opts):
    spec = OptimizerSpec.parse(name, lr=1e-2, **opts)
    assert not (bad := teacher_forced_run(spec, N, STEPS, seed=0)), _report(bad)
    assert not (bad := free_running_run(spec, N, STEPS, seed=1)), _report(bad)


@pytest.mark.skipif(not _fused_kernels(), reason="torch's kernels here round a * b + c twice (no FMA)")
@pytest.mark.parametrize("name,opts", ADAM_CASES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_adam_is_bitwise_on_fused_kernels_wherever_torchs_sqrt_is_correctly_rounded(name, opts):
    """On FMA kernels every Adam operation but one is a single IEEE operation (multiply, divide, add,
    fused multiply-add, lerp as one fma) in the same order on both sides: the moments are bitwise, and
    so is the parameter on every element where torch's vectorised float32 ``sqrt`` of ``exp_avg_sq``
    returns the correctly rounded root (zerosim's). How often it does not depends on the processor's
    sqrt kernel; which elements may differ does not."""
    spec = OptimizerSpec.parse(name, lr=1e-2, **opts)
    rng = np.random.default_rng(0)
    p = rng.standard_normal(N).astype(np.float32)
    state = {k: np.zeros(N, np.float32) for k in spec.state_names}
    for t in range(1, STEPS + 1):
        _, ours, theirs = check_step(spec, p, gradient(rng, p), state, t)
        for k in spec.state_names:
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=f"step {t} {k}")
        v = theirs["exp_avg_sq"]
        sqrt_exact = torch.from_numpy(v.copy()).sqrt().numpy() == np.sqrt(v)
        np.testing.assert_array_equal(
            ours["param"][sqrt_exact], theirs["param"][sqrt_exact], err_msg=f"step {t}"
        )
        p, state = theirs["param"], {k: theirs[k] for k in spec.state_names}


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("max_norm", [1e-2, 1.0])
def test_clipped_steps_match_torch(name, max_norm):
    # gradient norms around 10: every step clips
    spec = OptimizerSpec.parse(
        name, lr=1e-2, max_grad_norm=max_norm, **({"momentum": 0.9} if name == "sgd" else {})
    )
    assert not (bad := teacher_forced_run(spec, N, STEPS, seed=2)), _report(bad)
    assert not (bad := free_running_run(spec, N, STEPS, seed=3)), _report(bad)


def test_global_norm_and_clip_match_clip_grad_norm():
    """Norms and clip factors: zerosim's float64 norm is within gamma_{n+1} (float64 unit) of the exact
    one for any summation order; torch's float32 norm within :func:`norm_model`'s gamma_{n+8}; the
    clipped gradients within the model's ``2 e``. Given torch's norm, zerosim's factor and scaling
    are torch's IEEE operations (add, divide, multiply: correctly rounded on every processor), so
    bitwise."""
    rng = np.random.default_rng(3)
    ns = numpy_namespace()
    for _trial in range(20):
        grads = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in (17, 300, 4096)]
        n = sum(g.size for g in grads)
        exact = math.sqrt(math.fsum(float(x) ** 2 for g in grads for x in g))  # squares exact, sum exact
        norm = global_norm_from_sumsq(sum(ns.sum_of_squares(g) for g in grads))
        assert abs(norm - exact) <= (gamma(n + 1, 2.0**-53) + 2.0**-53) * exact
        flat = Bounded.exact(np.concatenate(grads))
        torch_norm_bound = float(norm_model(flat).e)
        for max_norm in (0.5, 5.0, 1e3):
            tparams = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
            for tp, g in zip(tparams, grads, strict=True):
                tp.grad = torch.from_numpy(g.copy())
            total = float(torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=False))
            assert abs(total - exact) <= torch_norm_bound, "torch's float32 norm outside gamma_{n+8}"
            coef = clip_coefficient(norm, max_norm)
            coef_from_torch_norm = clip_coefficient(total, max_norm)
            assert coef == 1.0 if max_norm > norm else coef < 1.0
            coef_model = clip_coefficient_model(norm_model(flat), max_norm)
            assert abs(coef - coef_from_torch_norm) <= 2 * float(coef_model.e)
            clipped = clip_model(flat, max_norm)
            off = 0
            for tp, g in zip(tparams, grads, strict=True):
                # Given torch's norm, our coefficient and scaling reproduce torch's clipped grads exactly.
                ours = g.copy()
                apply_clip_(ours, coef_from_torch_norm)
                np.testing.assert_array_equal(ours, tp.grad.numpy())
                ours = g.copy()
                apply_clip_(ours, coef)
                diff = np.abs(ours.astype(np.float64) - tp.grad.numpy())
                assert np.all(diff <= 2 * clipped.e[off : off + g.size]), f"max_norm {max_norm}"
                off += g.size


def test_clip_coefficient_formula_is_torchs_float32_arithmetic():
    # torch: clamp(max_norm / (norm + 1e-6), max=1) with norm a float32 tensor.
    for norm, mx in ((3.7, 1.0), (1e-3, 1e-4), (123.456, 0.25), (0.5, 1.0)):
        t = torch.tensor(norm, dtype=torch.float32)
        expected = float(torch.clamp(mx / (t + 1e-6), max=1.0))
        assert clip_coefficient(norm, mx) == expected


def test_sgd_momentum_buffer_first_step_copies_gradient():
    # torch's buffer starts as None: step 1 sets buf = g even with dampening.
    spec = OptimizerSpec.parse("sgd", lr=0.1, momentum=0.9, dampening=0.5)
    opt = make_optimizer(spec)
    p = np.ones(4, np.float32)
    g = np.full(4, 2.0, np.float32)
    st = opt.init_state(4)
    opt.step(p, g, st)
    np.testing.assert_array_equal(st["momentum_buffer"], g)
    opt.step(p, g, st)
    np.testing.assert_array_equal(st["momentum_buffer"], np.float32(2.0 * 0.9 + 0.5 * 2.0))


def test_chunked_update_changes_no_bit(monkeypatch):
    """The step runs in CHUNK-sized pieces on CPU; any chunk size gives the same bits."""
    from zerosim.numerics import optim

    for name in ("sgd", "adam"):
        spec = OptimizerSpec.parse(name, lr=1e-2, **({"momentum": 0.9} if name == "sgd" else {}))
        results = []
        for chunk in (N, 7, 64):
            monkeypatch.setattr(optim, "CHUNK", chunk)
            opt = make_optimizer(spec)
            p = np.linspace(-1, 1, N, dtype=np.float32)
            st = opt.init_state(N)
            for i in range(3):
                opt.step(p, np.cos(np.arange(N, dtype=np.float32) * (i + 1)), st)
            results.append((p, st))
        for p, st in results[1:]:
            np.testing.assert_array_equal(p, results[0][0])
            for k in spec.state_names:
                np.testing.assert_array_equal(st[k], results[0][1][k])


def test_sharded_step_equals_full_step_bitwise():
    """Elementwise-only: stepping shards gives the full step's bits (the basis of C-ZERO-002)."""
    rng = np.random.default_rng(5)
    for name in ("sgd", "adam", "adamw"):
        spec = OptimizerSpec.parse(
            name, lr=1e-2, **({"momentum": 0.9, "nesterov": True} if name == "sgd" else {})
        )
        opt = make_optimizer(spec)
        full = rng.standard_normal(N).astype(np.float32)
        shards = [full[a:b].copy() for a, b in ((0, 100), (100, 517), (517, N))]
        st_full = opt.init_state(N)
        st_shards = [opt.init_state(s.size) for s in shards]
        for _ in range(5):
            g = rng.standard_normal(N).astype(np.float32)
            opt.step(full, g, st_full)
            off = 0
            for s, st in zip(shards, st_shards, strict=True):
                opt.step(s, g[off : off + s.size], st)
                off += s.size
        np.testing.assert_array_equal(np.concatenate(shards), full)
        for k in spec.state_names:
            np.testing.assert_array_equal(np.concatenate([st[k] for st in st_shards]), st_full[k])


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(name="lion"), "optimizer"),
        (dict(name="sgd", lr=-1.0), "lr"),
        (dict(name="sgd", momentum=-0.1), "momentum"),
        (dict(name="sgd", nesterov=True), "nesterov"),
        (dict(name="sgd", nesterov=True, momentum=0.9, dampening=0.1), "nesterov"),
        (dict(name="adam", betas=(0.9, 1.0)), "betas[1]"),
        (dict(name="adam", betas=(0.9,)), "betas"),
        (dict(name="adam", eps=-1e-8), "eps"),
        (dict(name="adamw", weight_decay=-0.1), "weight_decay"),
        (dict(name="adam", momentum=0.9), "momentum"),
        (dict(name="sgd", max_grad_norm=0.0), "max_grad_norm"),
        (dict(name="sgd", lr="fast"), "lr"),
        (dict(name="sgd", lr=float("nan")), "lr"),
        (dict(name="sgd", learning_rate=0.1), "learning_rate"),
    ],
)
def test_bad_optimizer_spec_names_the_field(kwargs, field):
    name = kwargs.pop("name")
    with pytest.raises(ConfigError) as e:
        OptimizerSpec.parse(name, **kwargs)
    assert e.value.field == field


def test_spec_defaults_follow_torch():
    assert OptimizerSpec.parse("adamw").weight_decay == 0.01
    assert OptimizerSpec.parse("adam").weight_decay == 0.0
    assert OptimizerSpec.parse("ADAM", betas="0.8,0.9").betas == (0.8, 0.9)
    assert OptimizerSpec.parse("sgd", momentum=0.9).state_names == ("momentum_buffer",)
    assert OptimizerSpec.parse("sgd").state_names == ()


def test_optimizer_rejects_mismatched_shapes():
    opt = make_optimizer(OptimizerSpec.parse("adam"))
    st = opt.init_state(4)
    with pytest.raises(ConfigError) as e:
        opt.step(np.zeros(4, np.float32), np.zeros(5, np.float32), st)
    assert e.value.field == "grad"
    with pytest.raises(ConfigError) as e:
        opt.step(np.zeros(3, np.float32), np.zeros(3, np.float32), st)
    assert e.value.field == "state.exp_avg"


# ---- mixed precision: 16-bit working weights and gradients, float32 master and state ---------------

MIXED = {"bf16": "bfloat16", "fp16": "float16"}




def _spacing16(x: np.ndarray, precision: str) -> np.ndarray:
    """The distance between adjacent 16-bit values at magnitude ``|x|`` (``x`` a 16-bit value)."""
    ax = np.abs(x.astype(np.float64))
    with np.errstate(divide="ignore"):
        exp = np.floor(np.log2(np.where(ax > 0, ax, 1.0)))
    dtype = MIXED[precision]  # an ulp at 2^exp is 2 u 2^exp; the subnormals' spacing twice the underflow
    return np.maximum(2.0 ** exp * 2 * UNIT_ROUNDOFF[dtype], 2 * UNDERFLOW[dtype])


@pytest.mark.parametrize("precision", sorted(MIXED))
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_mixed_precision_step_matches_torch_master_weights_recipe(precision, name):
    """The engine's mixed precision (zerosim.numerics.precision) against the usual torch recipe: an fp32
    master ``Parameter`` stepped by torch.optim, the model computing with ``master.to(bf16/fp16)``, its 16-bit
    gradient upcast into ``master.grad``; clipping on. Teacher-forced (both start each step from
    torch's master and state). Exact, on any processor: the casts of one master are the same 16-bit
    bits (round to nearest even on both sides), and so are the 16-bit gradients (``0.5 x`` is exact,
    then one correctly rounded float32 add and the same cast). The fp32 master and state: the rounding
    model's ``2 e``. The next working copies: round-to-nearest is monotone and moves a value by at most
    half a 16-bit spacing, so they are bitwise equal wherever the two masters are, and elsewhere
    ``|w - w'| <= |master - master'| + spacing16(max(|w|, |w'|))``."""
    from zerosim.numerics.precision import Precision

    prec = Precision.parse(precision)
    tdtype = getattr(torch, MIXED[precision])
    spec = OptimizerSpec.parse(
        name, lr=1e-2, max_grad_norm=1.0, **({"momentum": 0.9} if name == "sgd" else {})
    )
    ns = numpy_namespace()
    rng = np.random.default_rng(11)
    master = rng.standard_normal(N).astype(np.float32)
    state = {k: np.zeros(N, np.float32) for k in spec.state_names}
    for t in range(1, STEPS + 1):
        work = prec.to_params(master, ns)  # ml_dtypes cast
        twork = torch.from_numpy(master.copy()).to(tdtype)  # torch's cast
        assert work.dtype.itemsize == 2 and twork.dtype == tdtype
        np.testing.assert_array_equal(
            work.view(np.int16), twork.view(torch.int16).numpy(), err_msg=f"step {t}"
        )
        noise = (rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 0, N)).astype(np.float32)
        g16 = (np.float32(0.5) * work.astype(np.float32) + noise).astype(
            work.dtype
        )  # the model's 16-bit grad
        tg16 = (0.5 * twork.float() + torch.from_numpy(noise)).to(tdtype)
        np.testing.assert_array_equal(g16.view(np.int16), tg16.view(torch.int16).numpy(), err_msg=f"step {t}")
        grad = prec.grad_to_master(g16, ns)
        assert grad.dtype == np.float32
        np.testing.assert_array_equal(grad, tg16.float().numpy())
        bad, ours, theirs = check_step(spec, master, grad, state, t)
        assert not bad, _report(bad)
        nxt = prec.to_params(ours["param"], ns).astype(np.float64)
        tnxt = torch.from_numpy(theirs["param"]).to(tdtype).double().numpy()
        same = ours["param"] == theirs["param"]
        np.testing.assert_array_equal(
            nxt[same], tnxt[same], err_msg=f"step {t}: equal masters, unequal casts"
        )
        gap = np.abs(ours["param"].astype(np.float64) - theirs["param"])
        allowed = gap + _spacing16(np.maximum(np.abs(nxt), np.abs(tnxt)), precision)
        assert np.all(np.abs(nxt - tnxt) <= allowed), f"step {t}: 16-bit working copies too far apart"
        master, state = theirs["param"], {k: theirs[k] for k in spec.state_names}
