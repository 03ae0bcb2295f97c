"""zerogpu.torch_kernels: ZeroTrainer's ``optimizer_kernel="torch"|"fused"`` steps the flat master shard
with torch.optim's own functional kernels.

The wrapper is checked against torch.optim itself holding the same flat tensor as its only parameter:
the same kernel on the same tensor, so equal bit for bit on any processor (a hyper-parameter, state or
step count passed wrongly shows up as a difference), also when the wrapper runs the kernel chunk by
chunk (elementwise, chunk boundaries at multiples of every SIMD width). How far these kernels sit from the
reference optimizer is verify's business (tests/test_verify_adapters.py runs the ``-native``
adapters against the derived bound).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zerogpu.optimizer_kernels import OPTIMIZER_KERNELS, make_step_optimizer  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec, make_optimizer  # noqa: E402
from zerosim.numerics.xp import torch_namespace  # noqa: E402

N = 1031  # not a multiple of any SIMD width: the kernels' scalar tails run too
STEPS = 4

SPECS = {
    "adamw": (OptimizerSpec("adamw", lr=1e-2, weight_decay=0.05),
              lambda p, **kw: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.05, **kw)),
    "adam": (OptimizerSpec("adam", lr=1e-2, weight_decay=0.01),
             lambda p, **kw: torch.optim.Adam([p], lr=1e-2, weight_decay=0.01, **kw)),
    "sgd-momentum": (OptimizerSpec("sgd", lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
                     lambda p, **kw: torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.1,
                                                     weight_decay=1e-3, **kw)),
    "sgd-nesterov": (OptimizerSpec("sgd", lr=0.1, momentum=0.9, nesterov=True),
                     lambda p, **kw: torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True, **kw)),
    "sgd-plain": (OptimizerSpec("sgd", lr=0.1),
                  lambda p, **kw: torch.optim.SGD([p], lr=0.1, **kw)),
}


@pytest.mark.parametrize("kernel", ["torch", "fused"])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [None, 256])
def test_the_kernel_equals_torch_optim_on_the_same_flat_tensor(monkeypatch, kernel: str, name: str, dtype,
                                                               chunk: int | None) -> None:
    """``chunk``: the CPU single-tensor kernel run 256 elements at a time over the 1031 (five calls, the
    last one with a scalar tail) must still equal torch.optim's one call on the whole tensor."""
    if chunk is not None:
        monkeypatch.setattr("zerogpu.torch_kernels.CPU_CHUNK", chunk)
    spec, make_torch = SPECS[name]
    gen = torch.Generator().manual_seed(7)
    start = torch.randn(N, generator=gen, dtype=dtype)
    grads = [torch.randn(N, generator=gen, dtype=dtype) * 10.0 ** -k for k in range(STEPS)]
    ours = make_step_optimizer(spec, torch_namespace("cpu"), kernel)
    param = start.clone()
    state = ours.init_state(N, "float64" if dtype == torch.float64 else "float32")
    ref_param = torch.nn.Parameter(start.clone())
    ref = make_torch(ref_param, **({"fused": True} if kernel == "fused" else {"foreach": False}))
    for g in grads:
        ours.step(param, g.clone(), state)
        ref_param.grad = g.clone()
        ref.step()
        assert torch.equal(param, ref_param.detach())
    assert state["step"] == STEPS
    ref_state = ref.state[ref_param]
    for key in spec.state_names:
        assert torch.equal(state[key], ref_state[key]), key


def test_the_reference_kernel_is_zerosims_own_optimizer() -> None:
    """SGD: the reference itself; Adam/AdamW: the reference, or a kernel with its bits
    (tests/test_zerogpu_exact_optimizer.py)."""
    from zerogpu.exact_optimizer import FusedPrefixAdam

    xp = torch_namespace("cpu")
    sgd = OptimizerSpec("sgd", lr=1e-3)
    assert type(make_step_optimizer(sgd, xp, "reference")) is type(make_optimizer(sgd, xp))
    adamw = OptimizerSpec("adamw", lr=1e-3)
    exact = (type(make_optimizer(adamw, xp)), FusedPrefixAdam)
    assert isinstance(make_step_optimizer(adamw, xp, "reference"), exact)
    assert OPTIMIZER_KERNELS == ("reference", "torch", "fused", "compiled")


def test_an_unknown_kernel_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match=r"invalid optimizer_kernel='fast': must be one of reference, "
                                          r"torch, fused") as err:
        make_step_optimizer(OptimizerSpec("sgd", lr=0.1), torch_namespace("cpu"), "fast")
    assert "\n" not in str(err.value)


def test_a_bad_state_is_refused_as_by_the_reference_optimizer() -> None:
    opt = make_step_optimizer(OptimizerSpec("adamw", lr=1e-3), torch_namespace("cpu"), "torch")
    with pytest.raises(ConfigError, match="state"):
        opt.step(torch.zeros(4), torch.zeros(4), {"step": 0})


def test_a_started_all_reduce_is_in_place_and_refuses_what_it_cannot_reduce_in_place(world_of_one) -> None:
    """``TorchCommunicator.all_reduce_start``, what ZeRO-1 overlaps with backward (exercised at two ranks
    by tests/zerogpu_programs/trainer_probe.py): in place, traffic recorded like ``all_reduce``."""
    from zerogpu.comm import TorchCommunicator

    comm = TorchCommunicator(device="cpu")
    x = torch.arange(6, dtype=torch.float32)
    pending = comm.all_reduce_start(x[2:5], "avg")
    assert pending.wait().data_ptr() == x[2:5].data_ptr()  # the caller's own elements, reduced in place
    assert torch.equal(x, torch.arange(6, dtype=torch.float32))  # one rank: the average is the value
    record = comm.traffic.records[("world", "all_reduce")]
    assert (record.calls, record.payload_bytes) == (1, 12)  # three float32 elements
    with pytest.raises(ConfigError, match=r"all_reduce_start reduces in place"):
        comm.all_reduce_start(torch.zeros(4, 2).t()[0], "sum")  # a strided view: not in place
    import numpy as np

    with pytest.raises(ConfigError, match=r"all_reduce_start reduces in place"):
        comm.all_reduce_start(np.zeros(3, np.float32), "sum")
