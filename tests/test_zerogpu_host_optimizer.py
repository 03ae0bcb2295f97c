"""The offload host tier's optimizer (zerogpu.host_optimizer): torch's fused CPU kernel against zerosim's
exact reference, bitwise where torch's CPU build runs fused multiply-adds and within C-ZERO-002's
one-step rounding bound on the scalar build (run in a subprocess with ATEN_CPU_CAPABILITY=default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from zerogpu.host_optimizer import HostOptimizer, fused_kernel_is_exact  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec  # noqa: E402

SPECS = [
    ("adamw", {"lr": 1e-3, "weight_decay": 0.01}),
    ("adam", {"lr": 1e-3, "weight_decay": 0.01}),
    ("sgd", {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-4}),
    ("sgd", {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
]
N = 1 << 16


def _run(name: str, kw: dict, kernel: str, steps: int, n: int = N) -> dict[str, np.ndarray]:
    """``steps`` steps from seeded values; the arrays before the last step and after it."""
    spec = OptimizerSpec.parse(name, **kw)
    opt = HostOptimizer(spec, n, kernel=kernel)
    gen = torch.Generator().manual_seed(11)
    opt.load_master(torch.randn(n, generator=gen))
    before: dict[str, np.ndarray] = {}
    for _ in range(steps):
        opt.receive_grad(1e-2 * torch.randn(n, generator=gen))
        before = {"param": opt.master.numpy().copy(), "grad": opt.grad.numpy().copy(),
                  **{k: opt.state[k].numpy().copy() for k in spec.state_names}}
        opt.step()
    after = {"param": opt.master.numpy().copy(), **{k: opt.state[k].numpy().copy() for k in spec.state_names}}
    return {**{f"before_{k}": v for k, v in before.items()}, **{f"after_{k}": v for k, v in after.items()}}


@pytest.mark.parametrize("name,kw", SPECS)
def test_fused_host_kernel_is_bitwise_the_reference_with_fma(name, kw):
    """N is a multiple of the vector width: every element goes through the kernel's vector loop."""
    if not fused_kernel_is_exact():
        pytest.skip(f"torch's CPU capability here is {torch.backends.cpu.get_cpu_capability()} (no FMA)")
    want = _run(name, kw, "reference", 3)
    got = _run(name, kw, "fused", 3)
    for key in want:
        assert np.array_equal(got[key], want[key]), key


def _one_step_bound(name: str, kw: dict, ref: dict[str, np.ndarray], t: int) -> dict[str, np.ndarray]:
    """C-ZERO-002's bound for two faithful float32 computations of one step from the same values."""
    from zerosim.checks.rounding import OptimizerHyper, RoundingBound, StepValues

    spec = OptimizerSpec.parse(name, **kw)
    f64 = {k: v.astype(np.float64) for k, v in ref.items()}
    state = {k: f64[f"after_{k}"] for k in spec.state_names}
    bound = RoundingBound(OptimizerHyper.from_mapping(spec.to_dict(), name=name), u=2.0**-24, n=1)
    values = StepValues(t=t, params_before={"x": f64["before_param"]}, params={"x": f64["after_param"]},
                        state={"x": state}, grad={"x": f64["before_grad"]},
                        grad_terms={"x": np.zeros_like(f64["after_param"])}, grad_norm=0.0, clip_coef=1.0)
    b = bound.step(values)
    return {"param": b.params["x"], **b.state["x"]}


_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from test_zerogpu_host_optimizer import _run
name, kw, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
both = {{}}
for kernel in ("reference", "fused"):
    both.update({{f"{{kernel}}_{{k}}": v for k, v in _run(name, kw, kernel, 3).items()}})
np.savez(out, **both)
"""


@pytest.mark.parametrize("name,kw", SPECS)
def test_fused_host_kernel_without_fma_stays_within_the_rounding_bound(name, kw, tmp_path):
    """The scalar build rounds each multiply-add twice: the values differ, each within its bound."""
    out = tmp_path / "steps.npz"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = _CHILD.format(tests=str(Path(__file__).parent))
    subprocess.run([sys.executable, "-c", code, name, json.dumps(kw), str(out)], env=env, check=True,
                   timeout=300)
    data = np.load(out)
    ref = {k[len("reference_"):]: data[k] for k in data.files if k.startswith("reference_")}
    got = {k[len("fused_"):]: data[k] for k in data.files if k.startswith("fused_")}
    assert np.array_equal(got["before_grad"], ref["before_grad"])  # the same gradients on both sides
    # the last step compared from the fused run's own state before it, against the reference's step
    # from those same values (both sides started from the same bits)
    spec = OptimizerSpec.parse(name, **kw)
    ref_from_same = _reference_step_from(spec, got)
    bounds = _one_step_bound(name, kw, ref_from_same, t=3)
    unequal = 0
    for k, bound in bounds.items():
        a, b = got[f"after_{k}"].astype(np.float64), ref_from_same[f"after_{k}"].astype(np.float64)
        unequal += int(np.count_nonzero(a != b))
        assert np.all(np.abs(a - b) <= bound), (k, float(np.max(np.abs(a - b) - bound)))
    assert unequal > 0  # the scalar build does round differently: the bound is what is tested


def _reference_step_from(spec: OptimizerSpec, got: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The reference's third step from the fused run's values before it."""
    from zerosim.numerics.optim import make_optimizer

    opt = make_optimizer(spec, "numpy")
    p = got["before_param"].copy()
    state = {"step": 2, **{k: got[f"before_{k}"].copy() for k in spec.state_names}}
    opt.step(p, got["before_grad"].copy(), state)
    out = {k: v for k, v in got.items() if k.startswith("before_")}
    out["after_param"] = p
    out.update({f"after_{k}": state[k] for k in spec.state_names})
    return out


def test_host_optimizer_refuses_bad_input():
    spec = OptimizerSpec.parse("adamw", lr=1e-3)
    with pytest.raises(ConfigError, match="must be one of fused, reference"):
        HostOptimizer(spec, 8, kernel="fast")
    opt = HostOptimizer(spec, 8)
    with pytest.raises(ConfigError, match="holds 8 elements"):
        opt.receive_grad(torch.zeros(9))
    with pytest.raises(ConfigError, match="no cast"):
        opt.load_master(torch.zeros(8, dtype=torch.float64))
    assert opt.nbytes() == 4 * 8 * 4  # master, gradient buffer, exp_avg, exp_avg_sq
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="pinned host memory needs CUDA"):
            HostOptimizer(spec, 8, pin_memory=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible to torch)")
def test_pinned_host_optimizer_steps_a_gradient_copied_down_from_the_gpu():
    """GPU only: a reduced gradient shard copied asynchronously into pinned memory, then stepped,
    gives the reference's bits (the copy moves bits; the step is the CPU's)."""
    spec = OptimizerSpec.parse("adamw", lr=1e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(5)
    master, grad = torch.randn(N, generator=gen), 1e-2 * torch.randn(N, generator=gen)
    pinned = HostOptimizer(spec, N, kernel="reference", pin_memory=True)
    plain = HostOptimizer(spec, N, kernel="reference")
    for opt in (pinned, plain):
        opt.load_master(master)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pinned.receive_grad(grad.cuda(), non_blocking=True)
    stream.synchronize()
    plain.receive_grad(grad)
    pinned.step()
    plain.step()
    assert pinned.master.is_pinned()
    assert torch.equal(pinned.master, plain.master)


#: piece boundaries: at odd offsets and lengths (the reference), at multiples of 16 elements (the fused
#: kernel: its vector loop then covers every piece, as it covers the whole shard)
ODD_CUTS = [0, 7, 1000, 1013, 50_001, 99_999, 100_003]
VECTOR_CUTS = [0, 16, 1008, 1024, 50_000, 99_984, 100_000]


@pytest.mark.parametrize("kernel,cuts", [("reference", ODD_CUTS), ("fused", VECTOR_CUTS)])
@pytest.mark.parametrize("name,kw", SPECS[:3])
def test_a_step_taken_unit_by_unit_is_the_whole_shards_step(kernel, cuts, name, kw):
    """The schedule steps each unit's piece once its gradient has landed, pieces in backward order:
    the same bits as the whole shard's step."""
    if kernel == "fused" and not fused_kernel_is_exact():
        pytest.skip(f"torch's CPU capability here is {torch.backends.cpu.get_cpu_capability()} (no FMA)")
    n = cuts[-1]
    spec = OptimizerSpec.parse(name, **kw)
    whole, pieces = HostOptimizer(spec, n, kernel=kernel), HostOptimizer(spec, n, kernel=kernel)
    gen = torch.Generator().manual_seed(2)
    master = torch.randn(n, generator=gen)
    whole.load_master(master)
    pieces.load_master(master)
    for _ in range(3):
        grad = 1e-2 * torch.randn(n, generator=gen)
        whole.receive_grad(grad)
        whole.step()
        pieces.receive_grad(grad)
        for lo, hi in reversed(list(zip(cuts, cuts[1:], strict=False))):
            pieces.step_piece(lo, hi)
        pieces.finish_step()
    assert pieces.state["step"] == whole.state["step"] == 3
    assert torch.equal(pieces.master, whole.master)
    for k in spec.state_names:
        assert torch.equal(pieces.state[k], whole.state[k])


@pytest.mark.parametrize("name,kw", SPECS[:3])
def test_the_fused_kernels_scalar_tails_stay_within_the_rounding_bound(name, kw):
    """Pieces of odd lengths end in the fused kernel's scalar tail (the last elements of a call that
    fill no vector), which forms the state update with unrounded coefficients: from the second step
    on some of those elements differ from the reference, each within its one-step bound."""
    spec = OptimizerSpec.parse(name, **kw)
    opt = HostOptimizer(spec, ODD_CUTS[-1], kernel="fused")
    gen = torch.Generator().manual_seed(4)
    opt.load_master(torch.randn(opt.numel, generator=gen))
    before: dict[str, np.ndarray] = {}
    for _ in range(3):
        opt.receive_grad(1e-2 * torch.randn(opt.numel, generator=gen))
        before = {"before_param": opt.master.numpy().copy(), "before_grad": opt.grad.numpy().copy(),
                  **{f"before_{k}": opt.state[k].numpy().copy() for k in spec.state_names}}
        for lo, hi in zip(ODD_CUTS, ODD_CUTS[1:], strict=False):
            opt.step_piece(lo, hi)
        opt.finish_step()
    got = {**before, "after_param": opt.master.numpy().copy(),
           **{f"after_{k}": opt.state[k].numpy().copy() for k in spec.state_names}}
    want = _reference_step_from(spec, got)
    bounds = _one_step_bound(name, kw, want, t=3)
    for k, bound in bounds.items():
        a, b = got[f"after_{k}"].astype(np.float64), want[f"after_{k}"].astype(np.float64)
        assert np.all(np.abs(a - b) <= bound), (k, float(np.max(np.abs(a - b) - bound)))


def test_pieces_must_tile_the_shard_once():
    opt = HostOptimizer(OptimizerSpec.parse("adamw", lr=1e-3), 10)
    opt.step_piece(0, 4)
    opt.step_piece(3, 10)
    with pytest.raises(ConfigError, match="overlap at 3"):
        opt.finish_step()
    opt = HostOptimizer(OptimizerSpec.parse("adamw", lr=1e-3), 10)
    opt.step_piece(0, 4)
    with pytest.raises(ConfigError, match=r"covered up to 4"):
        opt.finish_step()
    with pytest.raises(ConfigError, match="0 <= lo <= hi <= 10"):
        opt.step_piece(5, 11)
