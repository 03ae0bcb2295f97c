"""The reference optimizer's Adam/AdamW update as one Triton pass (zerogpu.triton_kernel).

On a GPU: the reference's bits (every operation the reference's single IEEE rounding), for AdamW,
Adam with and without its L2 term and lerp's other branch, on a shard that is not a multiple of the
kernel's block. Under Triton's interpreter on the CPU (``tl.fma`` computed as a product and a sum):
within C-ZERO-002's one-step bound, and the values do differ there, so the comparison can fail.
Without Triton the reference optimizer is what ``optimizer_kernel="reference"`` gets."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from test_zerogpu_compiled_kernel import SPECS, _compare  # noqa: E402

from zerogpu.optimizer_kernels import make_step_optimizer  # noqa: E402
from zerogpu.triton_kernel import BLOCK, TritonExactAdam, adam_coefficients, triton_available  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec, make_optimizer  # noqa: E402
from zerosim.numerics.xp import torch_namespace  # noqa: E402


def test_the_reference_kernel_on_the_cpu_is_never_the_triton_pass():
    spec = OptimizerSpec.parse("sgd", lr=1e-3)
    opt = make_step_optimizer(spec, torch_namespace("cpu"), "reference")
    assert type(opt) is type(make_optimizer(spec, torch_namespace("cpu")))
    assert not isinstance(make_step_optimizer(OptimizerSpec.parse("adamw", lr=1e-3), torch_namespace("cpu"),
                                              "reference"), TritonExactAdam)


def test_the_coefficients_are_the_reference_optimizers_float32_values():
    import numpy as np

    decay, low, c = adam_coefficients(OptimizerSpec.parse("adamw", lr=1e-3, weight_decay=0.01), 3)
    assert (decay, low) == ("decoupled", True)
    assert all(float(np.float32(x)) == x for x in c)  # passing them as float32 rounds nothing
    assert c[6] == float(np.float32(-(1e-3 / (1 - 0.9**3))))
    assert adam_coefficients(OptimizerSpec.parse("adam", lr=1e-3, weight_decay=0.01), 1)[0] == "l2"
    assert adam_coefficients(OptimizerSpec.parse("adamw", lr=1e-3, betas=(0.3, 0.999)), 1)[1] is False


#: a folder holding Triton for the interpreter test where it is not installed beside torch (CI installs it
#: there rather than into the environment every other test imports)
TRITON_PATH = os.environ.get("ZEROSIM_TRITON_PATH", "")


@pytest.mark.skipif(not (triton_available() or os.path.isdir(os.path.join(TRITON_PATH, "triton"))),
                    reason="Triton is not installed (torch's CPU build has none); set ZEROSIM_TRITON_PATH")
def test_the_one_pass_kernel_under_the_interpreter_stays_within_the_rounding_bound():
    """Each spec's result from Triton's interpreter (numpy, multiply-adds rounded twice) against the
    reference, within the bound; the values differ somewhere, so the check is not vacuous."""
    program = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from test_zerogpu_compiled_kernel import SPECS, _compare
        from zerogpu.triton_kernel import TritonExactAdam
        from zerosim.numerics.optim import OptimizerSpec
        from zerosim.numerics.xp import torch_namespace

        class OnCpu(TritonExactAdam):
            def _one_pass(self, param, grad, state):  # the interpreter runs on CPU tensors
                return self.spec.name in ("adam", "adamw")

        for name, kw in SPECS:
            opt = OnCpu(OptimizerSpec.parse(name, **kw), torch_namespace("cpu"))
            unequal = _compare(name, kw, opt, "cpu")
            print(name, kw, unequal)
            assert unequal > 0, (name, kw)
    """)
    path = os.pathsep.join(p for p in (TRITON_PATH, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", program, tests], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible to torch)")
@pytest.mark.parametrize("name,kw", SPECS)
def test_the_one_pass_kernel_on_the_gpu_is_the_reference_bit_for_bit(name, kw):
    import test_zerogpu_compiled_kernel as helpers

    spec = OptimizerSpec.parse(name, **kw)
    opt = make_step_optimizer(spec, torch_namespace("cuda"), "reference")
    assert isinstance(opt, TritonExactAdam)
    n = helpers.N
    helpers.N = 3 * BLOCK + 5  # a last block cut short by the mask
    try:
        assert _compare(name, kw, opt, "cuda") == 0
    finally:
        helpers.N = n
    assert _compare(name, kw, opt, "cuda") == 0
