"""``optimizer_kernel="compiled"`` (zerogpu.compiled_kernel): the exact reference on the CPU; its one-pass
update function, run eagerly in float32 on the CPU (each multiply-add rounded twice), within
C-ZERO-002's one-step rounding bound of the reference; compiled on a GPU, the same bound (GPU only)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zerogpu.compiled_kernel import CompiledOptimizer  # noqa: E402
from zerogpu.optimizer_kernels import make_step_optimizer  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec, make_optimizer  # noqa: E402
from zerosim.numerics.xp import torch_namespace  # noqa: E402

SPECS = [("adamw", {"lr": 1e-3, "weight_decay": 0.01}), ("adam", {"lr": 1e-3, "weight_decay": 0.01}),
         ("adam", {"lr": 1e-3}), ("adamw", {"lr": 1e-3, "betas": (0.3, 0.999)})]  # last: lerp's other branch
N = 1 << 15


def _values(n: int, device: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    vals = {"param": torch.randn(n, generator=gen), "grad": 1e-2 * torch.randn(n, generator=gen),
            "exp_avg": 1e-3 * torch.randn(n, generator=gen),
            "exp_avg_sq": 1e-5 * torch.rand(n, generator=gen)}
    return {k: v.to(device) for k, v in vals.items()}


def _step(opt, vals: dict[str, torch.Tensor], t: int) -> None:
    state = {"step": t - 1, "exp_avg": vals["exp_avg"], "exp_avg_sq": vals["exp_avg_sq"]}
    opt.step(vals["param"], vals["grad"], state)
    assert state["step"] == t


def _bound(name: str, kw: dict, before: dict, after: dict, t: int) -> dict[str, np.ndarray]:
    from zerosim.checks.rounding import OptimizerHyper, RoundingBound, StepValues

    spec = OptimizerSpec.parse(name, **kw)
    f = {k: np.asarray(v, dtype=np.float64) for k, v in after.items()}
    bound = RoundingBound(OptimizerHyper.from_mapping(spec.to_dict(), name=name), u=2.0**-24, n=1)
    b = bound.step(StepValues(
        t=t, params_before={"x": np.asarray(before["param"], np.float64)}, params={"x": f["param"]},
        state={"x": {"exp_avg": f["exp_avg"], "exp_avg_sq": f["exp_avg_sq"]}},
        grad={"x": np.asarray(before["grad"], np.float64)}, grad_terms={"x": np.zeros(len(f["param"]))},
        grad_norm=0.0, clip_coef=1.0))
    return {"param": b.params["x"], **b.state["x"]}


def _compare(name: str, kw: dict, opt, device: str, t: int = 3) -> int:
    """One step of ``opt`` on ``device`` against the reference on the CPU; returns values unequal."""
    spec = OptimizerSpec.parse(name, **kw)
    want, got = _values(N, "cpu"), _values(N, device)
    before = {k: v.numpy().copy() for k, v in want.items()}
    _step(make_optimizer(spec, torch_namespace("cpu")), want, t)
    _step(opt, got, t)
    bounds = _bound(name, kw, before, {k: v.numpy() for k, v in want.items()}, t)
    unequal = 0
    for k, bound in bounds.items():
        a, b = got[k].cpu().numpy().astype(np.float64), want[k].numpy().astype(np.float64)
        unequal += int(np.count_nonzero(a != b))
        assert np.all(np.abs(a - b) <= bound), (k, float(np.max(np.abs(a - b) / np.maximum(bound, 1e-300))))
    return unequal


@pytest.mark.parametrize("name,kw", SPECS)
def test_compiled_kernel_is_the_exact_reference_on_the_cpu(name, kw):
    spec = OptimizerSpec.parse(name, **kw)
    opt = make_step_optimizer(spec, torch_namespace("cpu"), "compiled")
    assert not isinstance(opt, CompiledOptimizer)
    assert _compare(name, kw, opt, "cpu") == 0


@pytest.mark.parametrize("name,kw", SPECS)
def test_the_one_pass_update_in_float32_stays_within_the_rounding_bound(name, kw):
    """The compiled function's own operations, eager on the CPU: no FMA contraction, so each
    multiply-add is rounded twice; the bound holds and the values do differ."""
    opt = CompiledOptimizer(OptimizerSpec.parse(name, **kw), torch_namespace("cpu"), compile=False)
    assert _compare(name, kw, opt, "cpu") > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible to torch)")
@pytest.mark.parametrize("name,kw", SPECS[:2])  # two graphs: each compiles in seconds on a GPU
def test_compiled_kernel_on_the_gpu_stays_within_the_rounding_bound(name, kw):
    spec = OptimizerSpec.parse(name, **kw)
    opt = make_step_optimizer(spec, torch_namespace("cuda"), "compiled")
    assert isinstance(opt, CompiledOptimizer)
    _compare(name, kw, opt, "cuda")
