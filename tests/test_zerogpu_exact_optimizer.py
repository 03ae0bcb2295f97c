"""``optimizer_kernel="reference"`` on a CPU (zerogpu.exact_optimizer): where torch's CPU build runs fused
multiply-adds in its vector loops, torch's fused Adam/AdamW kernel on the shard's first multiple of 16
elements and the reference on the rest give the reference's bits, step after step, for every shard
length (a tail of 0 to 15 elements, a shard shorter than 16); the scalar build
(``ATEN_CPU_CAPABILITY=default``) gets the reference itself, as do SGD, float64 and strided shards."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from zerogpu.exact_optimizer import FUSED_UNIT, FusedPrefixAdam, make_exact_optimizer  # noqa: E402
from zerogpu.host_optimizer import fused_kernel_is_exact  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec, make_optimizer  # noqa: E402
from zerosim.numerics.xp import torch_namespace  # noqa: E402

SPECS = [("adamw", {"lr": 1e-3, "weight_decay": 0.01}), ("adam", {"lr": 1e-3, "weight_decay": 0.01}),
         ("adam", {"lr": 1e-3}), ("adamw", {"lr": 1e-3, "betas": (0.3, 0.999)})]  # last: lerp's other branch
LENGTHS = [1, FUSED_UNIT - 1, FUSED_UNIT, FUSED_UNIT + 1, 1000, (1 << 15) + 7]


def _values(n: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), [1e-2 * torch.randn(n, generator=gen) for _ in range(3)]


def _train(opt, n: int) -> dict[str, torch.Tensor]:
    """Three steps of ``opt`` from the same values: the parameter and state after each."""
    param, grads = _values(n, 7)
    state = opt.init_state(n, "float32")
    seen = {}
    for t, grad in enumerate(grads, start=1):
        opt.step(param, grad, state)
        assert state["step"] == t
        seen.update({f"param@{t}": param.clone(), **{f"{k}@{t}": v.clone() for k, v in state.items()
                                                      if isinstance(v, torch.Tensor)}})
    return seen


@pytest.mark.skipif(not fused_kernel_is_exact(), reason=f"torch's CPU capability here is "
                    f"{torch.backends.cpu.get_cpu_capability()}: its vector loops round twice, so the "
                    "reference itself runs (tested below)")
@pytest.mark.parametrize("name,kw", SPECS)
@pytest.mark.parametrize("n", LENGTHS)
def test_the_fused_prefix_and_reference_tail_give_the_references_bits(name, kw, n):
    spec = OptimizerSpec.parse(name, **kw)
    xp = torch_namespace("cpu")
    opt = make_exact_optimizer(spec, xp)
    assert isinstance(opt, FusedPrefixAdam)
    got, want = _train(opt, n), _train(make_optimizer(spec, xp), n)
    for key, value in want.items():
        assert torch.equal(got[key], value), (key, int((got[key] != value).sum()), "of", n)


def test_the_fused_kernel_alone_differs_in_its_scalar_tail_so_the_comparison_can_fail():
    """torch's fused kernel over a whole odd-length shard: its scalar tail rounds otherwise, which the
    bitwise comparison above would name (on a CPU where that tail differs from the reference)."""
    if not fused_kernel_is_exact():
        pytest.skip("the fused prefix is not used on this CPU")
    from zerogpu.torch_kernels import TorchKernelOptimizer

    spec, xp, n = OptimizerSpec.parse("adamw", lr=1e-3, weight_decay=0.01), torch_namespace("cpu"), 1000 + 15
    fused = _train(TorchKernelOptimizer(spec, xp, fused=True), n)
    reference = _train(make_optimizer(spec, xp), n)
    differ = [k for k in reference if not torch.equal(fused[k], reference[k])]
    assert differ, "torch's fused kernel matched the reference on its scalar tail too"
    head = n // FUSED_UNIT * FUSED_UNIT
    assert all(torch.equal(fused[k][:head], reference[k][:head]) for k in reference)


def test_elsewhere_the_reference_itself_runs():
    xp = torch_namespace("cpu")
    for spec in (OptimizerSpec.parse("sgd", lr=0.1, momentum=0.9), OptimizerSpec.parse("adamw", lr=1e-3)):
        opt = make_exact_optimizer(spec, xp)
        assert isinstance(opt, FusedPrefixAdam) == (spec.name == "adamw" and fused_kernel_is_exact())
    if fused_kernel_is_exact():  # float64 and strided shards step through the reference, same bits
        spec = OptimizerSpec.parse("adamw", lr=1e-3)
        opt = make_exact_optimizer(spec, xp)
        wide = torch.randn(64, dtype=torch.float64)
        state = opt.init_state(64, "float64")
        assert opt._prefix(wide, wide.clone(), state) == 0
        strided = torch.randn(128)[::2]
        assert opt._prefix(strided, strided.clone(), opt.init_state(64)) == 0
    done = subprocess.run(
        [sys.executable, "-c", "from zerogpu.exact_optimizer import make_exact_optimizer, FusedPrefixAdam\n"
         "from zerosim.numerics.optim import OptimizerSpec\nfrom zerosim.numerics.xp import torch_namespace\n"
         "opt = make_exact_optimizer(OptimizerSpec.parse('adamw', lr=1e-3), torch_namespace('cpu'))\n"
         "print(type(opt).__name__)"],
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "AdamW", done.stdout  # the scalar build: the reference itself
