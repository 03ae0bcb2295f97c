"""zerosim.monitor on CUDA (skipped cleanly where there is no GPU).

- The digest of a tensor on the GPU is the digest of the same bytes on the CPU, bit for bit (integer sums
  modulo 2^64 do not depend on the order of the additions), by the one-tensor and the many-piece paths,
  and computing it on the GPU asks nothing of the host: no synchronising operation (CUDA's sync
  debug mode), the result stays on the device.
- Live runs with the model on the GPU (tests/monitor_programs/monitor_run.py, ``MONITOR_DEVICE=cuda``):
  at world 1 over NCCL every adapter runs 200 steps fault-free with no violation and, after 30, the
  same parameters, bit for bit, as the same loop without the monitor; at world 2 (two ranks sharing
  one GPU over gloo, or NCCL where there are two GPUs) DDP and ZeroRedundancyOptimizer as well, and the
  live faults are caught at the first check at or after their step, naming rank and tensor, as on the
  CPU.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from test_monitor_live import FAULTS, _caught, _clean, _fault_free, _fault_spec, _launch  # noqa: E402

from zerosim.monitor.digest import IN_PLACE_BYTES, PieceDigests, tensor_digest  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.torchdist,
              pytest.mark.skipif(GPUS == 0, reason="needs CUDA (no GPU visible to torch)")]
WORLD1_ADAPTERS = ("ddp", "zero-redundancy", "fsdp2", "zerogpu-zero2", "zerogpu-zero3")
WORLD2_ADAPTERS = ("ddp", "zero-redundancy")
WORLD2_FAULTS = {name: f for name, f in FAULTS.items() if f[0] in WORLD2_ADAPTERS}


def _pieces(device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    cpu = [torch.randn(999, generator=gen), torch.randn(3, 5, generator=gen).to(torch.bfloat16),
           torch.randn(70000, generator=gen).to(torch.float16), torch.tensor(3.0),
           torch.randn(10, 10, generator=gen)[:, 2], torch.randn(1001, generator=gen)[1:],
           torch.ones(5, dtype=torch.bool), torch.randn(4, 4, dtype=torch.float64, generator=gen),
           torch.randn(IN_PLACE_BYTES // 4 + 17, generator=gen),  # reduced in place
           torch.arange(10**4, dtype=torch.int64) * (2**61 + 12345)]  # sums that wrap
    return [p.to(device) for p in cpu]


def test_a_digest_on_the_gpu_is_the_digest_of_the_same_bytes_on_the_cpu() -> None:
    on_cpu, on_gpu = _pieces("cpu"), _pieces("cuda")
    for c, g in zip(on_cpu, on_gpu, strict=True):
        assert tensor_digest(g).device.type == "cuda"
        assert tensor_digest(g).tolist() == tensor_digest(c).tolist(), (c.dtype, tuple(c.shape))
    together_cpu = PieceDigests(on_cpu, torch.device("cpu")).compute(on_cpu)
    plan = PieceDigests(on_gpu, torch.device("cuda"))
    together_gpu = plan.compute(on_gpu)
    assert together_gpu.device.type == "cuda"
    assert torch.equal(together_gpu.cpu(), together_cpu)
    flipped = [p.clone() for p in on_gpu]
    flipped[8].view(torch.int32)[12345] ^= 1 << 30
    changed = (plan.compute(flipped) != together_gpu).any(dim=1).tolist()
    assert changed == [i == 8 for i in range(len(on_gpu))]


def test_digesting_on_the_gpu_asks_nothing_of_the_host() -> None:
    pieces = _pieces("cuda")
    plan = PieceDigests(pieces, torch.device("cuda"))
    plan.compute(pieces)  # the first call may set up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan.compute(pieces)
            tensor_digest(pieces[8])
        with warnings.catch_warnings(record=True) as control:  # the detector sees a host read
            warnings.simplefilter("always")
            tensor_digest(pieces[8]).tolist()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    def syncs(seen: list[warnings.WarningMessage]) -> list[str]:
        return [str(w.message) for w in seen if "synchroniz" in str(w.message).lower()]

    assert syncs(caught) == [], syncs(caught)[:3]
    assert syncs(control), "CUDA's sync debug mode reported no synchronisation for a host read"


@pytest.fixture(scope="module")
def world1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return _launch(tmp_path_factory.mktemp("gpu-monitor1"), 1, _clean(WORLD1_ADAPTERS), "cuda")


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    scenarios = _clean(WORLD2_ADAPTERS) + [_fault_spec(n, f) for n, f in WORLD2_FAULTS.items()]
    return _launch(tmp_path_factory.mktemp("gpu-monitor2"), 2, scenarios, "cuda")


@pytest.mark.parametrize("adapter", WORLD1_ADAPTERS)
def test_a_fault_free_gpu_run_at_world_1_has_no_violation_and_unchanged_parameters(world1, adapter):
    _fault_free(world1, adapter)


@pytest.mark.parametrize("adapter", WORLD2_ADAPTERS)
def test_a_fault_free_gpu_run_at_world_2_has_no_violation_and_unchanged_parameters(world2, adapter):
    _fault_free(world2, adapter)


@pytest.mark.parametrize("name", sorted(WORLD2_FAULTS))
def test_each_live_fault_on_the_gpu_is_caught_naming_rank_and_tensor(world2, name):
    _caught(world2[name], WORLD2_FAULTS[name])
