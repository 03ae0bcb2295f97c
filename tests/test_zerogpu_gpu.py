"""The torch.distributed backend on CUDA with NCCL (skipped cleanly where there is no GPU).

One GPU is enough for a world of 1 (NCCL needs a distinct GPU per rank): the engine's arrays on the
GPU (TF32 off) against the ground truth, NCCL's communicator initialised and used (``split``), and
the GPU report written. With two or more GPUs, every strategy at world 2 over NCCL as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zerogpu.launch import run_ranks  # noqa: E402

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.torchdist,
              pytest.mark.skipif(GPUS == 0, reason="needs CUDA (no GPU visible to torch)")]
BOUND_S = 300.0
CONTRACTS = ("C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005")
QUIET = {"PYTHONWARNINGS": "ignore"}


def test_the_communicator_selftest_passes_on_nccl() -> None:
    result = run_ranks(
        1, ["-m", "zerogpu", "selftest-comm", "--device", "cuda", "--json"], BOUND_S, env=QUIET
    )
    assert result.returncode == 0, (result.stdout or "") + (result.stderr or "")
    doc = json.loads(result.stdout)
    assert doc["passed"] and doc["backend"] == "nccl" and doc["device"].startswith("cuda")


def test_simulate_on_one_gpu_passes_every_contract() -> None:
    result = run_ranks(
        1,
        [
            "-m",
            "zerogpu",
            "simulate",
            "--device",
            "cuda",
            "--strategy",
            "zero3",
            "--steps",
            "2",
            "--observe",
            "full",
            "--json",
        ],
        BOUND_S,
        env=QUIET,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["passed"] and all(doc["verdicts"][c]["passed"] for c in CONTRACTS)


def test_a_broken_engine_on_the_gpu_fails_its_contract() -> None:
    result = run_ranks(
        1,
        [
            "-m",
            "zerogpu",
            "simulate",
            "--device",
            "cuda",
            "--strategy",
            "zero3",
            "--steps",
            "1",
            "--micro-batches",
            "2",
            "--fault",
            "no-accum-average",
            "--json",
        ],
        BOUND_S,
        env=QUIET,
    )
    assert result.returncode == 1, result.stderr
    assert json.loads(result.stdout)["verdicts"]["C-ZERO-002"]["passed"] is False


def test_the_gpu_report_writes_json_and_markdown(tmp_path: Path) -> None:
    from zerogpu.gpu_report import report
    from zerosim.cli.gpu import report_parser

    def main(argv: list[str]) -> int:
        return report(report_parser().parse_args(argv))

    assert main(["--out", str(tmp_path), "--world-size", str(min(GPUS, 2))]) == 0
    doc = json.loads((tmp_path / "equivalence.json").read_text())
    assert doc["environment"]["dist_backend"] == "nccl" and doc["environment"]["tf32"]["matmul"] is False
    assert len(doc["runs"]) == 6 and all(r["contracts_passed"] for r in doc["runs"])
    assert all(r["max_abs_error_vs_ground_truth"] is not None for r in doc["runs"])
    assert "| zero3 |" in (tmp_path / "equivalence.md").read_text()


@pytest.mark.skipif(GPUS < 2, reason="NCCL across ranks needs two GPUs")
def test_every_strategy_over_nccl_at_world_2(tmp_path: Path) -> None:
    out = tmp_path / "eq.json"
    result = run_ranks(
        2,
        ["-m", "zerogpu", "equivalence", "--device", "cuda", "--xp", "numpy", "--out", str(out)],
        BOUND_S,
        env=QUIET,
    )
    doc = json.loads(out.read_text())
    assert result.returncode == 0 and doc["passed"], result.stdout
    # numpy arrays, two ranks: NCCL's sum of two is the simulator's, bit for bit
    assert all(r["vs_simulator"]["bitwise_equal"] for r in doc["runs"])


def test_division_by_a_number_is_correctly_rounded_on_the_gpu() -> None:
    """``zerosim.numerics.xp.divide_`` on the GPU gives the CPU's (IEEE) quotient bit for bit, for float32 and
    float64, by divisors whose reciprocal is inexact: what keeps the reference optimizer's denominator,
    the micro-batch mean and the communicator's average the same bits on every device."""
    from zerosim.numerics.xp import divide_

    for dtype in (torch.float32, torch.float64):
        x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(5), dtype=dtype)
        for divisor in (3, 7, 10, 0.9994998749374609):
            on_gpu = divide_(x.cuda(), divisor).cpu()
            assert torch.equal(on_gpu, divide_(x.clone(), divisor)), (dtype, divisor)


def test_offload_on_the_gpu_is_refused_in_one_line(tmp_path: Path) -> None:
    """ZeroTrainer keeps the optimizer state on the model's device; offload's host tier cannot hold it
    there, so a GPU model with offload is refused before anything is built."""
    import torch.distributed as dist

    from zerogpu.offload import OffloadConfig
    from zerogpu.trainer import ZeroTrainer
    from zerosim.errors import ConfigError

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)).cuda()
    refusal = r"invalid offload='cuda:0': parameter offload runs on the CPU only"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ConfigError, match=refusal):
            ZeroTrainer(model, {"name": "adamw", "lr": 1e-3}, "zero3",
                        offload=OffloadConfig(device_budget_bytes=1 << 20))
    finally:
        dist.destroy_process_group()
