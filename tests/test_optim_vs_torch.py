"""The reference optimizers against torch.optim (foreach=False), step by step, and clipping against
torch.nn.utils.clip_grad_norm_.

Tolerances (float32 ulps of the parameters and of every state array, at every step):

* SGD: bitwise on CPUs whose torch kernels use fused multiply-add (AVX2 / AVX-512 / arm64); elsewhere
  torch's unfused ``a * b + c`` may differ by an ulp, so 2 ulps.
* Adam / AdamW: torch's vectorised CPU ``sqrt`` is not correctly rounded (ours is), so ``denom`` can
  differ by 1 ulp; that perturbs the update by ~1 ulp of the update, and the parameters by at most a
  few ulps over the run. Budget 8 ulps (measured on torch 2.13 / AVX-512: at most 3.75, on at
  most 0.4% of the 1031 elements; every other element bitwise, which is asserted too).
"""

from __future__ import annotations

import itertools
import math
import platform

import numpy as np
import pytest

from zerosim.errors import ConfigError
from zerosim.optim import OptimizerSpec, apply_clip_, clip_coefficient, global_norm_from_sumsq, make_optimizer
from zerosim.xp import numpy_namespace

torch = pytest.importorskip("torch")

N = 1031  # not a multiple of any SIMD width: exercises the kernels' scalar tails too
STEPS = 12


def _fma_cpu() -> bool:
    if platform.machine().lower() in ("arm64", "aarch64"):
        return True
    try:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    except AttributeError:  # pragma: no cover - old torch
        return False


SGD_ULPS = 0 if _fma_cpu() else 2
ADAM_ULPS = 8


def ulp_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Max over elements of ``|a - b|`` in float32 ulps of ``max(|a|, |b|, floor)``, where ``floor`` is
    1/64 of the array's largest magnitude: near zero a value's own ulp is meaninglessly small (a
    parameter that moved from -0.05 to -2e-4 keeps the absolute 1e-9 error it had at -0.05, which
    is 16 of its new ulps). 0 when bitwise."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    assert a.shape == b.shape
    if np.array_equal(a, b):
        return 0.0
    floor = np.float32(2.0**-6) * max(float(np.max(np.abs(a))), float(np.max(np.abs(b))))
    scale = np.maximum(np.maximum(np.abs(a), np.abs(b)), floor)
    return float(np.max(np.abs(a.astype(np.float64) - b) / np.spacing(scale)))


def _torch_optimizer(spec: OptimizerSpec, p):
    if spec.name == "sgd":
        return torch.optim.SGD([p], lr=spec.lr, momentum=spec.momentum, dampening=spec.dampening,
                               nesterov=spec.nesterov, weight_decay=spec.weight_decay, foreach=False)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return cls([p], lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False)


def run_both(spec: OptimizerSpec, steps: int = STEPS, seed: int = 0):
    """Step ours and torch's on the same gradients; yield (step, ours, theirs) arrays each step.

    Gradients depend on the current parameters (a quadratic pull plus noise) so a divergence would
    feed back, as in training. With ``max_grad_norm`` both sides clip first (ours from the float64
    sum of squares, torch with clip_grad_norm_)."""
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N).astype(np.float32)
    ns = numpy_namespace()
    opt = make_optimizer(spec, ns)
    ours = p0.copy()
    state = opt.init_state(N)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = _torch_optimizer(spec, tp)
    for step in range(steps):
        noise = (rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 0, N)).astype(np.float32)
        g_ours = (np.float32(0.5) * ours + noise).astype(np.float32)
        g_torch = (np.float32(0.5) * tp.detach().numpy() + noise).astype(np.float32)
        if spec.max_grad_norm is not None:
            norm = global_norm_from_sumsq(ns.sum_of_squares(g_ours))
            apply_clip_(g_ours, clip_coefficient(norm, spec.max_grad_norm), ns)
        opt.step(ours, g_ours, state)
        tp.grad = torch.from_numpy(g_torch)
        if spec.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([tp], spec.max_grad_norm, foreach=False)
        topt.step()
        tstate = topt.state[tp]
        yield step, ours, tp.detach().numpy(), {k: state[k] for k in spec.state_names}, \
            {k: tstate[k].numpy() for k in spec.state_names}, state["step"]


SGD_CASES = [
    dict(momentum=m, dampening=d, nesterov=n, weight_decay=wd)
    for m, d, n, wd in itertools.product((0.0, 0.9), (0.0, 0.1), (False, True), (0.0, 0.01))
    if not (n and (m == 0 or d != 0)) and not (m == 0 and d != 0)
]


@pytest.mark.parametrize("opts", SGD_CASES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_sgd_matches_torch_step_by_step(opts):
    spec = OptimizerSpec.parse("sgd", lr=0.05, **opts)
    worst = 0
    for step, ours, theirs, s_ours, s_theirs, _ in run_both(spec):
        worst = max(worst, ulp_distance(ours, theirs))
        for k in s_ours:
            worst = max(worst, ulp_distance(s_ours[k], s_theirs[k]))
        assert worst <= SGD_ULPS, f"step {step}: {worst} ulps from torch.optim.SGD"


ADAM_CASES = [
    ("adam", dict()),
    ("adam", dict(weight_decay=0.1)),
    ("adam", dict(betas=(0.3, 0.99), eps=1e-6)),  # beta1 < 0.5: torch's other lerp branch
    ("adamw", dict()),  # torch's default weight decay 0.01
    ("adamw", dict(weight_decay=0.1, betas=(0.8, 0.95))),
    ("adamw", dict(weight_decay=0.0)),
]


@pytest.mark.parametrize("name,opts", ADAM_CASES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_adam_matches_torch_step_by_step(name, opts):
    spec = OptimizerSpec.parse(name, lr=1e-2, **opts)
    worst = 0
    for step, ours, theirs, s_ours, s_theirs, t in run_both(spec):
        assert t == step + 1
        worst = max(worst, ulp_distance(ours, theirs))
        for k in s_ours:
            worst = max(worst, ulp_distance(s_ours[k], s_theirs[k]))
        assert worst <= ADAM_ULPS, f"step {step}: {worst} ulps from torch.optim.{name}"
        # Tight, not just close: only the elements hit by torch's 1-ulp sqrt differences may differ.
        assert np.mean(ours != theirs) <= 0.02, f"step {step}: {np.mean(ours != theirs):.1%} of elements differ"


# torch's clip_grad_norm_ computes the norm in float32 (relative error ~1e-7, up to ~3 ulps of the
# clip coefficient, measured); ours accumulates in float64 (relative error ~1e-16). Every clipped
# gradient element inherits that coefficient difference, so clipped runs get 8 ulps.
CLIP_ULPS = 8


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_clipped_steps_match_torch(name):
    # max_norm 1.0 with gradient norms around 10: every step clips.
    spec = OptimizerSpec.parse(name, lr=1e-2, max_grad_norm=1.0, **({"momentum": 0.9} if name == "sgd" else {}))
    for step, ours, theirs, s_ours, s_theirs, _ in run_both(spec):
        assert ulp_distance(ours, theirs) <= CLIP_ULPS, f"step {step}"
        for k in s_ours:  # states cancel (signed averages): normwise, measured <= 3.6e-7
            err = np.max(np.abs(s_ours[k] - s_theirs[k])) / np.max(np.abs(s_theirs[k]))
            assert err <= 1e-6, f"step {step}: {k} normwise relative error {err:.2e}"


def test_global_norm_and_clip_match_clip_grad_norm():
    rng = np.random.default_rng(3)
    ns = numpy_namespace()
    for _trial in range(20):
        grads = [rng.standard_normal(s).astype(np.float32) * 0.3 for s in (17, 300, 4096)]
        exact = math.sqrt(math.fsum(float(x) ** 2 for g in grads for x in g))  # squares exact, sum exact
        norm = global_norm_from_sumsq(sum(ns.sum_of_squares(g) for g in grads))
        assert norm == pytest.approx(exact, rel=1e-13)
        for max_norm in (0.5, 5.0, 1e3):
            tparams = [torch.nn.Parameter(torch.zeros(g.shape)) for g in grads]
            for tp, g in zip(tparams, grads, strict=True):
                tp.grad = torch.from_numpy(g.copy())
            total = float(torch.nn.utils.clip_grad_norm_(tparams, max_norm, foreach=False))
            assert total == pytest.approx(exact, rel=1e-6)  # torch's float32 norm
            coef = clip_coefficient(norm, max_norm)
            coef_from_torch_norm = clip_coefficient(total, max_norm)
            assert coef == 1.0 if max_norm > norm else coef < 1.0
            assert ulp_distance(np.float32([coef]), np.float32([coef_from_torch_norm])) <= 4
            for tp, g in zip(tparams, grads, strict=True):
                # Given torch's norm, our coefficient and scaling reproduce torch's clipped grads exactly.
                ours = g.copy()
                apply_clip_(ours, coef_from_torch_norm)
                np.testing.assert_array_equal(ours, tp.grad.numpy())
                ours = g.copy()
                apply_clip_(ours, coef)
                assert ulp_distance(ours, tp.grad.numpy()) <= 4


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
    from zerosim import optim
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
        spec = OptimizerSpec.parse(name, lr=1e-2, **({"momentum": 0.9, "nesterov": True} if name == "sgd" else {}))
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
                opt.step(s, g[off:off + s.size], st)
                off += s.size
        np.testing.assert_array_equal(np.concatenate(shards), full)
        for k in spec.state_names:
            np.testing.assert_array_equal(np.concatenate([st[k] for st in st_shards]), st_full[k])


@pytest.mark.parametrize("kwargs,field", [
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
])
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


@pytest.mark.parametrize("precision", sorted(MIXED))
@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_mixed_precision_step_matches_torch_master_weights_recipe(precision, name):
    """The engine's mixed precision (zerosim.precision) against the usual torch recipe: an fp32 master
    ``Parameter`` stepped by torch.optim, the model computing with ``master.to(bf16/fp16)``, its 16-bit
    gradient upcast into ``master.grad``; clipping on. The working copies must be the same 16-bit
    bits (round to nearest even on both sides) and the master/state within the fp32 budgets above."""
    from zerosim.precision import Precision

    prec = Precision.parse(precision)
    tdtype = getattr(torch, MIXED[precision])
    spec = OptimizerSpec.parse(name, lr=1e-2, max_grad_norm=1.0, **({"momentum": 0.9} if name == "sgd" else {}))
    ns = numpy_namespace()
    rng = np.random.default_rng(11)
    p0 = rng.standard_normal(N).astype(np.float32)
    opt = make_optimizer(spec, ns)
    master, state = p0.copy(), opt.init_state(N)
    tmaster = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = _torch_optimizer(spec, tmaster)
    budget = max(CLIP_ULPS, ADAM_ULPS if name != "sgd" else SGD_ULPS)
    for step in range(STEPS):
        work = prec.to_params(master, ns)                      # ml_dtypes cast of our master
        twork = tmaster.detach().to(tdtype)                    # torch's cast of its master
        assert work.dtype.itemsize == 2 and twork.dtype == tdtype
        # the cast itself is bit-identical: cast our master with torch and compare bits
        ours_by_torch = torch.from_numpy(master.copy()).to(tdtype).view(torch.int16).numpy()
        np.testing.assert_array_equal(work.view(np.int16), ours_by_torch)
        noise = (rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 0, N)).astype(np.float32)
        g16 = (np.float32(0.5) * work.astype(np.float32) + noise).astype(work.dtype)  # the model's 16-bit grad
        tg16 = (0.5 * twork.float() + torch.from_numpy(noise)).to(tdtype)
        grad = prec.grad_to_master(g16, ns)
        assert grad.dtype == np.float32
        norm = global_norm_from_sumsq(ns.sum_of_squares(grad))
        apply_clip_(grad, clip_coefficient(norm, spec.max_grad_norm), ns)
        opt.step(master, grad, state)
        tmaster.grad = tg16.float()
        torch.nn.utils.clip_grad_norm_([tmaster], spec.max_grad_norm, foreach=False)
        topt.step()
        assert ulp_distance(master, tmaster.detach().numpy()) <= budget, f"step {step}: master"
        tstate = topt.state[tmaster]
        for k in spec.state_names:
            err = np.max(np.abs(state[k] - tstate[k].numpy())) / np.max(np.abs(tstate[k].numpy()))
            assert err <= 1e-6, f"step {step}: {k} normwise relative error {err:.2e}"
        # the next working copies: identical 16-bit values except where the fp32 masters' last-bit
        # differences straddle a 16-bit rounding boundary (then one 16-bit ulp apart)
        nxt = prec.to_params(master, ns).astype(np.float32)
        tnxt = tmaster.detach().to(tdtype).float().numpy()
        one_ulp16 = np.abs(nxt) * (2.0 ** -7 if precision == "bf16" else 2.0 ** -10)  # bf16 8, fp16 11 bits
        assert np.all(np.abs(nxt - tnxt) <= one_ulp16), f"step {step}"
        assert np.mean(nxt != tnxt) <= 0.01, f"step {step}: {np.mean(nxt != tnxt):.1%} of working weights differ"
