"""``zerosim gpu-check`` as CI runs it (``--cpu``): every step, the folder it writes, its exit statuses,
and each comparison failing on a deliberately perturbed value."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from zerosim.bench.gpu_check import (  # noqa: E402
    PERTURB_ENV,
    STEP_NAMES,
    Context,
    Step,
    _tests_read,
    _verify_read,
    run_step,
)
from zerosim.processes.launching import GroupRun  # noqa: E402

pytestmark = pytest.mark.torchdist
CUDA = torch.cuda.is_available()


def _gpu_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != PERTURB_ENV}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "zerosim", "gpu-check", *args], capture_output=True,
                          text=True, timeout=600, env=full_env)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    return _gpu_check("--cpu", "--out", str(out)), out


def test_cpu_run_writes_every_step_with_finite_figures(cpu_run) -> None:
    run, out = cpu_run
    assert run.returncode == 0, run.stdout + run.stderr
    doc = json.loads((out / "gpu-check.json").read_text())
    assert [s["name"] for s in doc["steps"]] == list(STEP_NAMES)
    statuses = {s["name"]: s["status"] for s in doc["steps"]}
    assert statuses == {"tests": "pass" if CUDA else "skipped", "report": "pass", "trainer": "pass",
                        "offload": "pass", "kernel": "pass", "verify": "pass"}, doc["steps"]
    for step in doc["steps"]:
        ran = bool(step["command"])  # without CUDA the GPU tests, which would all skip, are not run
        assert ran == (step["name"] != "tests" or CUDA), step
        assert step["reason"] and (step["wall_s"] > 0 if ran else step["wall_s"] == 0)
        assert step["wall_s"] <= step["limit_s"] and (out / step["log"]).is_file()
        for name, value in step["figures"].items():
            assert isinstance(value, float) and math.isfinite(value), (step["name"], name, value)
    figures = {s["name"]: s["figures"] for s in doc["steps"]}
    engine = ("no_shard", "zero1", "zero2", "zero3", "hybrid_shard:1", "hybrid_shard_zero2:1")
    assert {f"{s}.max_abs_diff_vs_simulator" for s in engine} <= set(figures["report"])
    trainer = ("ddp", "zero1", "zero2", "zero3", "hybrid", "hybrid_zero2")
    assert {f"{s}.error_over_bound" for s in trainer} <= set(figures["trainer"])
    assert figures["offload"]["peak_over_budget"] <= 1.0
    assert figures["kernel"]["reference.fraction_of_copy"] > 0 < figures["kernel"]["copy_bandwidth_gb_s"]
    assert doc["environment"]["torch"] == torch.__version__ and doc["environment"]["device_name"]
    assert doc["device"] == "cpu" and doc["passed"] and doc["exit_status"] == 0 and doc["perturbed"] is None
    # the same kernels on both sides: the trainer's runs are bitwise equal, and each is within the bound of
    # the float64 reference without being equal to it (the bound is not vacuous)
    trainer = json.loads((out / "steps" / "trainer.json").read_text())
    assert {r["comparison"] for r in trainer["runs"]} == {"bitwise"} and len(trainer["runs"]) == 6
    assert all(r["values_unequal"] == 0 and 0 < r["host_vs_reference_over_bound"] <= 1
               for r in trainer["runs"])
    kernel = json.loads((out / "steps" / "kernel.json").read_text())
    assert {k["kernel"]: k["check"]["comparison"] for k in kernel["kernels"]}["reference"] == "bitwise"
    assert kernel["goal_judged"] is False
    digest = kernel["monitor_digest"]
    assert digest["fraction_of_copy"] > 0 < figures["kernel"]["monitor_digest.bandwidth_gb_s"]
    verified = json.loads((out / "steps" / "verify.json").read_text())
    assert [(r["case"], r["verdict"]) for r in verified["runs"]] == [("fsdp2", "pass")]
    assert verified["runs"][0]["contracts"]["C-ZERO-002"] == "pass" and figures["verify"]["fsdp2.seconds"] > 0
    md = (out / "gpu-check.md").read_text()
    assert all(f"| {name} |" in md for name in STEP_NAMES) and "Overall: **PASS**" in md
    assert (out / "gpu-check.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [line.split()[1] for line in run.stdout.splitlines()[:len(STEP_NAMES)]] == list(STEP_NAMES)


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_without_cuda_it_says_so_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _gpu_check("--out", str(out))
    assert run.returncode == 2 and run.stdout == ""
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert run.stderr.startswith("error: invalid device='cuda': gpu-check needs a CUDA device")
    assert "--cpu" in run.stderr
    assert not out.exists()


def test_an_existing_folder_with_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    run = _gpu_check("--cpu", "--out", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.strip() == (f"error: invalid out='{tmp_path}': exists and is not an empty folder; "
                                  "name a new one")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_a_perturbed_kernel_result_fails_the_step_and_the_command(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = _gpu_check("--cpu", "--only", "kernel", "--out", str(out), env={PERTURB_ENV: "kernel"})
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith("gpu-check: FAIL: step(s) kernel failed")
    doc = json.loads((out / "gpu-check.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert doc["failed"] == ["kernel"] and doc["perturbed"] == "kernel" and doc["exit_status"] == 1
    reason = steps["kernel"]["reason"]
    assert "reference kernel: 1 values differ from the host optimizer (bitwise expected): param[0]" in reason
    assert "fused kernel: beyond the one-step rounding bound" in reason
    assert all(steps[n]["status"] == "skipped" for n in STEP_NAMES if n != "kernel")
    assert "perturbed on purpose" in (out / "gpu-check.md").read_text()


def test_an_unknown_perturbation_or_step_is_bad_input(tmp_path: Path) -> None:
    run = _gpu_check("--cpu", "--only", "kernel,nope", "--out", str(tmp_path / "a"))
    assert run.returncode == 2 and run.stderr.startswith("error: invalid only='kernel,nope'")
    run = _gpu_check("--cpu", "--out", str(tmp_path / "b"), env={PERTURB_ENV: "tests"})
    assert run.returncode == 2 and run.stderr.startswith(f"error: invalid {PERTURB_ENV}='tests'")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("bitwise", [True, False], ids=["bitwise", "bounded"])
def test_the_trainer_comparison_names_a_perturbed_parameter(tmp_path: Path, bitwise: bool) -> None:
    from zerosim.bench.gpu_session import world_of_one
    from zerosim.bench.trainer_devices import compare

    with world_of_one("cpu", tmp_path):
        clean = compare("cpu", "gpt", 1, ["zero3"], perturb=False, bitwise=bitwise)
        broken = compare("cpu", "gpt", 1, ["zero3"], perturb=True, bitwise=bitwise)
    assert clean["passed"] and clean["runs"][0]["error_over_bound"] == 0
    run = broken["runs"][0]
    assert not broken["passed"] and run["comparison"] == ("bitwise" if bitwise else "bounded")
    assert run["problems"][0].startswith(
        "device and host runs differ in 1 values (bitwise expected)" if bitwise
        else "device and host runs differ beyond twice the bound")
    assert "step 1 wte.weight[0]" in run["problems"][0] and run["error_over_bound"] > 1


def test_a_step_past_its_limit_is_killed_and_reported_as_a_timeout(tmp_path: Path) -> None:
    ctx = Context(tmp_path, "cpu", None, None)
    ctx.steps_dir.mkdir()
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    sleeper = Step("sleep", "sleeps", 1.0, lambda c, limit: sleep, lambda c, r: ("pass", "", {}),
                   lambda c: c.steps_dir / "none.json")
    result = run_step(sleeper, ctx, 1.0, dict(os.environ))
    assert result.status == "timeout" and result.wall_s < 30
    assert result.reason == "did not finish within 1 s; killed it"


def test_failed_gpu_tests_are_named(tmp_path: Path) -> None:
    ctx = Context(tmp_path, "cuda", None, None)
    ctx.steps_dir.mkdir()
    (ctx.steps_dir / "tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase name="test_ok"/><testcase name="test_nccl"><failure message="boom"/></testcase>'
        '<testcase name="test_two"><skipped message="needs two GPUs"/></testcase></testsuite></testsuites>')
    status, reason, figures = _tests_read(ctx, GroupRun(1, "", "", False, 1.0))
    assert (status, reason) == ("fail", "1 failed: test_nccl")
    assert figures == {"passed": 1.0, "tests": 3.0, "failures": 1.0, "errors": 0.0, "skipped": 1.0}


def test_offload_refused_on_the_device_is_a_skipped_step_any_other_error_a_failure(tmp_path: Path) -> None:
    from zerosim.bench.gpu_check import _offload_read

    ctx = Context(tmp_path, "cuda", None, None)
    ctx.steps_dir.mkdir()
    refused = ("error: invalid offload='cuda:0': parameter offload runs on the CPU only: on a GPU the engine "
               "keeps the optimizer state on the device")
    status, reason, _ = _offload_read(ctx, GroupRun(2, "", refused, False, 1.0))
    assert (status, reason) == ("skipped", "not supported here: " + refused.removeprefix("error: "))
    status, reason, _ = _offload_read(ctx, GroupRun(2, "", "error: invalid model='nope'", False, 1.0))
    assert (status, reason) == ("fail", "no result (exit 2): error: invalid model='nope'")


def test_a_failed_or_broken_verify_case_fails_the_step_naming_it(tmp_path: Path) -> None:
    ctx = Context(tmp_path, "cuda", None, None)
    ctx.steps_dir.mkdir()
    runs = [{"case": "ddp", "verdict": "pass", "error": None, "seconds": 12.0},
            {"case": "fsdp2-bf16", "verdict": "fail", "error": None, "seconds": 14.0},
            {"case": "zerogpu-3", "verdict": "error", "error": "RankFailure: rank 0 raised", "seconds": 3.0}]
    (ctx.steps_dir / "verify.json").write_text(json.dumps({"runs": runs}))
    status, reason, figures = _verify_read(ctx, GroupRun(1, "", "", False, 1.0))
    assert (status, reason) == ("fail", "fsdp2-bf16: fail; zerogpu-3: RankFailure: rank 0 raised")
    assert figures == {"ddp.seconds": 12.0, "fsdp2-bf16.seconds": 14.0, "zerogpu-3.seconds": 3.0}


def test_the_kernel_goal_is_judged_on_a_gpu_and_names_the_kernel() -> None:
    from zerosim.bench.optimizer_bandwidth import kernel_problems

    ok = {"passed": True, "comparison": "bounded", "worst": ""}
    kernels = [{"kernel": "reference", "fraction_of_copy": 0.2, "check": dict(ok, comparison="bitwise")},
               {"kernel": "fused", "fraction_of_copy": 0.9, "check": ok}]
    assert kernel_problems(kernels, judged=False) == []
    assert kernel_problems(kernels, judged=True) == [
        "the reference kernel (ZeroTrainer's default) reaches 0.20 of the copy bandwidth, below the goal "
        "0.7; kernels that meet it: fused"]
