"""Gradient shards down to the host optimizer (zerogpu.offload_gradients), driven in the offload plan's
backward order: each unit's piece stepped once, the whole shard's bits, the plan's bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from zerogpu.host_optimizer import HostOptimizer  # noqa: E402
from zerogpu.offload_gradients import GradientOffload  # noqa: E402
from zerogpu.offload_plan import plan_step  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.numerics.optim import OptimizerSpec  # noqa: E402

UNITS = [("embed", 96), ("b0", 41), ("b1", 40), ("b2", 40), ("head", 67)]  # elements, odd lengths included
SPEC = OptimizerSpec.parse("adamw", lr=1e-3, weight_decay=0.01)


def _pieces() -> dict[str, tuple[int, int]]:
    out, at = {}, 0
    for name, n in UNITS:
        out[name] = (at, at + n)
        at += n
    return out


def _start(kernel: str, pin: bool = False) -> tuple[HostOptimizer, torch.Tensor]:
    n = sum(n for _, n in UNITS)
    host = HostOptimizer(SPEC, n, kernel=kernel, pin_memory=pin)
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    host.load_master(master)
    return host, master


def test_backward_order_copies_and_steps_give_the_whole_step():
    host, _ = _start("reference")
    whole, _ = _start("reference")
    offload = GradientOffload(host, _pieces())
    plan = plan_step([(n, 4 * k) for n, k in UNITS], 10_000)
    order = [e.unit for e in plan.events if e.kind == "d2h_grad"]
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        grad = 1e-2 * torch.randn(host.numel, generator=gen)
        for name in order:
            lo, hi = offload.pieces[name]
            offload.grad_ready(name, grad[lo:hi].clone())
        offload.finish()
        whole.receive_grad(grad)
        whole.step()
    assert torch.equal(host.master, whole.master)
    assert all(torch.equal(host.state[k], whole.state[k]) for k in SPEC.state_names)
    assert host.state["step"] == 3
    assert offload.stats["bytes_device_to_host"] == 3 * plan.bytes_device_to_host
    assert offload.stats["pieces_stepped_early"] == 3 * len(UNITS)  # CPU: every copy lands at once
    assert torch.equal(offload.updated("b0"), host.master[96:137])


def test_refusals():
    host, _ = _start("reference")
    with pytest.raises(ConfigError, match="tile"):
        GradientOffload(host, {"a": (0, 10), "b": (11, host.numel)})
    with pytest.raises(ConfigError, match="cover"):
        GradientOffload(host, {"a": (0, 10)})
    offload = GradientOffload(host, _pieces())
    with pytest.raises(ConfigError, match="needs 41 elements"):
        offload.grad_ready("b0", torch.zeros(40))
    with pytest.raises(ConfigError, match="not a unit"):
        offload.grad_ready("nope", torch.zeros(40))
    offload.grad_ready("b0", torch.zeros(41))
    with pytest.raises(ConfigError, match="already received"):
        offload.grad_ready("b0", torch.zeros(41))
    with pytest.raises(ConfigError, match="no gradient received"):
        offload.finish()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible to torch)")
def test_gradients_from_the_gpu_on_a_side_stream_give_the_cpus_bits():
    """GPU only: shards produced on the device, copied into pinned memory on the side stream, stepped
    as they land or at finish: the same bits as the same step on the CPU."""
    host, _ = _start("reference", pin=True)
    cpu, _ = _start("reference")
    offload = GradientOffload(host, _pieces(), device="cuda")
    grad = 1e-2 * torch.randn(host.numel, generator=torch.Generator().manual_seed(2))
    on_device = grad.cuda()
    for name, _ in reversed(UNITS):
        lo, hi = offload.pieces[name]
        offload.grad_ready(name, on_device[lo:hi] * 1.0)  # a fresh tensor, as a reduce-scatter's output
    offload.finish()
    cpu.receive_grad(grad)
    cpu.step()
    assert torch.equal(host.master, cpu.master)
    assert offload.stats["pieces_stepped_early"] + offload.stats["pieces_stepped_at_finish"] == len(UNITS)
    assert offload.seconds_copying > 0
