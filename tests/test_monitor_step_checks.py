"""C-ZERO-002's step clauses on a user's own DDP loop at world 2 (tests/monitor_programs/step_faults.py):
each fault the replicas agree on is caught by the clause that sees it, naming rank and tensor, live and
by ``zerosim check trace``; a fault-free run with replay on passes; the pure checks on hand-made data."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason
from zerosim.checks.replay import classify
from zerosim.checks.update_formula import recompute_update

PROGRAM = str(Path(__file__).parent / "monitor_programs" / "step_faults.py")


def _run(tmp: Path, fault: str) -> tuple[list[str], str]:
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp / fault
    run = run_ranks(2, [PROGRAM, fault, str(out), "14", "replay"], 240.0, env={"PYTHONWARNINGS": "ignore"})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("VIOL ")]
    judged = subprocess.run([sys.executable, "-m", "zerosim", "check", "trace", str(out)],
                            capture_output=True, text=True, timeout=120)
    return lines, judged.stdout


@pytest.mark.parametrize(("fault", "needle", "count"), [
    ("none", None, 0),
    ("lr3", "C-ZERO-002 update step=8 rank=0 tensor=embed.weight", 2),
    ("gradflip", "C-ZERO-002 replay replay=transient replayed_step=11 step=11 rank=1 "
                 "tensor=blocks.0.weight", 1),
    ("halve", "C-ZERO-002 grad_accounting step=7 rank=0 tensor=head.weight", None),
    ("lr3-rank0", "C-ZERO-003 identical step=8 rank=0 tensor=embed.weight", None),
])
def test_each_step_fault_is_caught_by_its_clause_live_and_offline(tmp_path, fault, needle, count):
    lines, offline = _run(tmp_path, fault)
    if needle is None:
        assert lines == [] and offline.strip().splitlines()[-1].startswith("PASS"), (lines, offline)
        return
    assert any(line.startswith(f"VIOL {needle}") for line in lines), lines
    assert needle in offline and offline.strip().splitlines()[-1].startswith("FAIL"), offline
    if count is not None:
        assert len(lines) == count, lines
    if fault == "halve":  # the tensor is named; the other tensors hold the clip coefficient
        assert not any("grad_accounting" in line and "head.weight" not in line for line in lines), lines


def test_a_corruption_outside_the_step_at_world_2_names_both_ranks(tmp_path):
    lines, _ = _run(tmp_path, "corrupt0")
    identical = [line for line in lines if "identical" in line]
    assert identical and all("rank=0,1" in line and "disagree" in line for line in identical), lines
    assert not any("update" in line for line in lines), lines


def _adamw_sample(lr: float, scale: float) -> dict:
    import torch

    p = torch.tensor([0.5, -0.25, 1e-3, 2.0])
    g = torch.tensor([0.1, -0.2, 3e-4, 0.0])
    opt = torch.optim.AdamW([torch.nn.Parameter(p.clone())], lr=lr * scale, weight_decay=0.01)
    param = opt.param_groups[0]["params"][0]
    param.grad = g.clone()
    opt.step()
    state = opt.state[param]
    return {"tensor": "w", "step": 0.0, "grad": g.double().tolist(),
            "hp": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
            "pre": {"param": p.double().tolist()},
            "post": {"param": param.detach().double().tolist(), "exp_avg": state["exp_avg"].double().tolist(),
                     "exp_avg_sq": state["exp_avg_sq"].double().tolist()}}


def test_the_update_formula_holds_torchs_adamw_and_names_a_scaled_learning_rate():
    healthy = recompute_update("AdamW", [_adamw_sample(1e-2, 1.0)])
    assert healthy["bad"] == 0 and 0 <= healthy["worst_ratio"] < 1, healthy
    wrong = recompute_update("AdamW", [_adamw_sample(1e-2, 3.0)])
    assert wrong["bad"] and wrong["tensor"] == "w" and wrong["entry"] == "param", wrong


def test_replay_classification():
    base = {"tensor": "w", "contributed": 1.0, "bound": 0.0}
    assert classify({**base, "first": 1.0, "second": None}) is None
    assert classify({**base, "first": 2.0, "second": 2.0}) == "transient"
    assert classify({**base, "first": 2.0, "second": 3.0}) == "persistent"
