"""zerosim.monitor on CUDA (skipped cleanly where there is no GPU).

- The digest of a tensor on the GPU is the digest of the same bytes on the CPU, bit for bit (integer sums
  modulo 2^64 do not depend on the order of the additions), by the one-tensor and the many-piece paths,
  and computing it on the GPU asks nothing of the host: no synchronising operation (CUDA's sync
  debug mode), the result stays on the device.
- A rank's row measured on the GPU (state finiteness by the largest magnitude, step counters a fused
  optimizer keeps on the device, the gradient's sum of squares, a logged loss and norm left as device
  tensors) holds the same summary as the row measured from the same values on the CPU, and building it
  asks nothing of the host; a whole monitored loop at world 1 over NCCL, a check at every step with the
  previous check completed in the same call, runs without one synchronising operation in the monitor:
  its step checks' values are staged to pinned host memory and each check's row posted once they have
  landed, describing the step it observed (:mod:`zerosim.monitor.staged_reads`).
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


def _sync_warnings(action) -> list[str]:
    """The synchronising operations CUDA's sync debug mode reports while ``action()`` runs."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            action()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in seen if "synchroniz" in str(w.message).lower()]


def _summary_layout(device: str):
    import math

    from zerosim.monitor.layouts import LiveLayout, OwnedState

    big = torch.finfo(torch.float32).max
    states = {"ok": torch.randn(100), "sum_overflows": torch.tensor([big, big, 1.0]),
              "half_sum_overflows": torch.full((64,), 60000.0, dtype=torch.float16),
              "negative_inf": torch.tensor([1.0, -math.inf, 2.0]), "nan": torch.tensor([0.0, math.nan]),
              "bf16_inf": torch.tensor([math.inf, 1.0], dtype=torch.bfloat16)}
    steps = {"ok": 4.0, "sum_overflows": 3.0, "half_sum_overflows": 3.0, "negative_inf": 4.0, "nan": 4.0,
             "bf16_inf": 4.0}
    return LiveLayout("ddp", numels={n: t.numel() for n, t in states.items()},
                      states=[OwnedState(n, t.numel(), {"exp_avg": t.to(device),
                                                        "step": torch.tensor(steps[n]).to(device)})
                              for n, t in states.items()],
                      grads=[torch.tensor([3.0, 4.0]).to(device), torch.tensor([12.0]).to(device)])


def test_a_row_measured_on_the_gpu_is_the_row_measured_on_the_cpu_and_asks_nothing_of_the_host() -> None:
    from zerosim.monitor.exchange import summary_values
    from zerosim.monitor.row import RowBuilder

    cpu, gpu = _summary_layout("cpu"), _summary_layout("cuda")
    loss, norm = torch.tensor(0.75), torch.tensor(13.0)
    on_cpu = RowBuilder(torch.device("cpu")).row(cpu, 0, 5, 9, loss, norm)
    builder = RowBuilder(torch.device("cuda"))
    logged = loss.cuda(), norm.cuda()
    builder.row(gpu, 0, 5, 9, *logged)  # the first call makes its index tensors
    made: list[torch.Tensor] = []
    syncs = _sync_warnings(lambda: made.append(builder.row(gpu, 0, 5, 9, *logged)))
    assert syncs == [], syncs[:3]
    on_gpu = made[0]
    assert _sync_warnings(on_gpu.tolist), "CUDA's sync debug mode reported no synchronisation for a host read"
    assert on_gpu.device.type == "cuda"
    s_cpu, s_gpu = summary_values(on_cpu, 0), summary_values(on_gpu.cpu(), 0)
    assert s_gpu == s_cpu
    assert (s_gpu["nonfinite"], s_gpu["step_min"], s_gpu["step_max"], s_gpu["grad_sq"]) == (3, 3, 4, 169.0)
    assert list(cpu.numels)[s_gpu["nonfinite_idx"]] == "negative_inf"
    assert list(cpu.numels)[s_gpu["step_min_idx"]] == "sum_overflows"


def test_a_monitored_gpu_loop_checks_every_step_without_making_the_host_wait(tmp_path) -> None:
    import torch.distributed as dist

    from zerosim.monitor import Monitor

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8)).cuda()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # step counters on the GPU
        monitor = Monitor(ddp, optimizer, every=1, max_norm=1.0, log=lambda line: None, out=tmp_path / "out")
        x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
        found: list[str] = []
        for step in range(12):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            logged = {"loss": loss.detach(), "grad_norm": norm}
            if step < 3:  # the first checks exchange the layout once
                monitor.after_step(step, **logged)
            else:
                found += _sync_warnings(lambda s=step, kw=logged: monitor.after_step(s, **kw))
        summary = monitor.close()
    finally:
        dist.destroy_process_group()
    assert found == [], found[:3]
    assert summary["violation_count"] == 0, summary["violations"][:3]
    import json

    lines = [json.loads(line) for line in (tmp_path / "out" / "rank-00000.jsonl").read_text().splitlines()]
    # the step checks ran, each row describing its own step (a check whose values had not landed by the
    # next call skips); the last step's check is posted and judged at close()
    steps = [line["step"] for line in lines]
    assert len(lines) == summary["checks"] and steps == sorted(set(steps)) and steps[-1] == 11, steps
    assert all(line["update"]["step"] == line["accounting"]["step"] == line["step"]
               for line in lines), [(line["step"], sorted(line)) for line in lines[:3]]


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
