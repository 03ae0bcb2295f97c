"""``zerosim bench host-adam``: every kernel timed side by side and checked against zerosim's reference;
a kernel off by more than its rounding bound is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.test_outputs import ROOT  # noqa: E402
from zerosim.bench import host_adam  # noqa: E402


def test_host_adam_bench_times_every_kernel_and_checks_it(tmp_path: Path) -> None:
    out = tmp_path / "host_adam.json"
    run = subprocess.run([sys.executable, "-m", "zerosim", "bench", "host-adam", "--elements", "50000",
                          "--rounds", "2", "--out", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert [k["kernel"] for k in report["kernels"]] == list(host_adam.KERNELS)
    for k in report["kernels"]:
        assert len(k["samples_s"]) == 2 and k["min_s"] <= k["median_s"] <= k["max_s"]
        assert k["check"]["passed"] and k["check"]["error_over_bound"] <= 1
    ref = next(k for k in report["kernels"] if k["kernel"] == "host-reference")
    assert ref["check"]["values_unequal"] == 0
    if report["fused_bitwise_expected"]:
        fused = next(k for k in report["kernels"] if k["kernel"] == "host-fused")
        assert fused["check"]["values_unequal"] == 0
    assert "host-fused" in run.stdout and "the for-loop" in run.stdout


def test_host_adam_check_catches_a_kernel_beyond_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    real = host_adam.make_kernel

    def off_by_a_little(kernel, arrays, t0):
        step = real(kernel, arrays, t0)

        def wrong() -> None:
            step()
            arrays["param"][0] += 1e-4  # far beyond a few float32 roundings of a parameter near 1
        return wrong if kernel == "host-fused" else step

    monkeypatch.setattr(host_adam, "make_kernel", off_by_a_little)
    result = host_adam.check("host-fused")
    assert not result["passed"] and result["error_over_bound"] > 1 and result["values_unequal"] >= 1
