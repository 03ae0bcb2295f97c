"""An offloaded ZeroTrainer steps its optimizer through the host tier (zerogpu.offload_step).

Two ranks on gloo (tests/zerogpu_programs/offload_host_probe.py): ZeRO-3 with offload, the master,
gradient and state shards handed to a HostOptimizer each step, against the same run without
offload. The reference kernel (and ``"compiled"``, the reference on the CPU) gives the run without
offload bit for bit; the fused kernel gives the run without offload on the same fused kernel bit for
bit, and each of its steps stays within C-ZERO-002's one-step rounding bound of the reference's step
from the same values. One-rank tests cover the kernel choice and its refusal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zerogpu.launch import run_ranks  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402

PROBE = Path(__file__).parent / "zerogpu_programs" / "offload_host_probe.py"


@pytest.mark.torchdist
def test_two_ranks_offloaded_step_through_the_host_tier_equal_the_run_without_offload() -> None:
    result = run_ranks(2, [str(PROBE)], timeout_s=300)
    assert result.returncode == 0, (result.stderr or "")[-2000:]
    rows = {r["kernel"]: r for r in (json.loads(line) for line in (result.stdout or "").splitlines()
                                     if line.startswith("{"))}
    assert set(rows) == {"reference", "compiled", "fused"}
    for kernel, row in rows.items():
        assert row["host_kernel"] == ("fused" if kernel == "fused" else "reference"), row
        assert row["host_steps"] == 3 and row["fetches"] > 0, row
        assert row["losses_equal"] and row["params_equal"] and row["state_equal"], row
        steps = row["steps"]
        assert sorted((s["rank"], s["step"]) for s in steps) == [(r, t) for r in (0, 1) for t in (1, 2, 3)]
        for s in steps:
            assert s["worst_excess"] <= 0.0, s  # every element within the one-step bound
            if kernel != "fused":
                assert s["unequal"] == 0, s  # the reference's own step: bit for bit


def _offloaded(kernel: str):
    from zerogpu.offload import OffloadConfig
    from zerogpu.trainer import ZeroTrainer
    from zerosim.verify.model import build_model

    return ZeroTrainer(build_model("gpt", "float32"), {"name": "adamw", "lr": 1e-2}, "zero3",
                       offload=OffloadConfig(device_budget_bytes=1 << 24), optimizer_kernel=kernel)


@pytest.mark.parametrize(("kernel", "host"), [("reference", "reference"), ("compiled", "reference"),
                                              ("fused", "fused"), ("torch", None)])
def test_the_optimizer_kernel_chooses_the_host_tiers_kernel(world_of_one, kernel: str,
                                                            host: str | None) -> None:
    from zerosim.verify.model import micro_batch

    trainer = _offloaded(kernel)
    try:
        trainer.step(*micro_batch(0, 1))
        if host is None:  # torch.optim's single-tensor kernel: the engine's own optimizer steps
            assert trainer.host_step is None
            return
        assert trainer.host_step is not None and trainer.state.opt is trainer.host_step
        hosted = trainer.host_step.host
        assert hosted is not None and hosted.kernel == host and trainer.host_step.steps == 1
        # the host optimizer steps the engine's own buffers: no copy of the master or the state
        assert hosted.master is trainer.state.master and hosted.state is trainer.state.opt_state
    finally:
        trainer.close()


def test_no_offload_no_host_step(world_of_one) -> None:
    from zerogpu.trainer import ZeroTrainer
    from zerosim.verify.model import build_model

    trainer = ZeroTrainer(build_model("gpt", "float32"), {"name": "sgd", "lr": 0.1}, "zero3")
    try:
        assert trainer.host_step is None
    finally:
        trainer.close()


def test_the_host_step_refuses_a_shard_off_the_cpu_and_an_unknown_kernel() -> None:
    from zerogpu.offload_step import HostTierStep
    from zerosim.numerics.optim import OptimizerSpec

    spec = OptimizerSpec.parse("adamw", lr=1e-2)
    with pytest.raises(ConfigError, match="offload.host_kernel"):
        HostTierStep(spec, "torch")
    step = HostTierStep(spec, "reference")
    state = step.init_state(4)
    meta = torch.zeros(4, device="meta")
    with pytest.raises((ConfigError, TypeError, ValueError, RuntimeError)):
        step.step(meta, meta, state)
