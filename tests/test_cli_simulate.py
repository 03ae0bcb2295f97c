"""``zerosim simulate``: default run, JSON, exit codes, one-line errors, shared argument helpers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from zerosim.cli import main
from zerosim.cli.run_options import add_run_arguments, config_from_args


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zerosim", *argv], capture_output=True, text=True, timeout=120
    )


def test_no_arguments_runs_a_meaningful_default_and_passes():
    p = run_cli("simulate")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for cid in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005"):
        assert cid in out
    assert "PASS" in out and "FAIL" not in out
    assert "full_shard on 4 ranks" in out


def test_json_output(capsys):
    code = main(["simulate", "--json", "--strategy", "hybrid_shard:2", "--world-size", "4", "--steps", "2",
                 "--precision", "bf16", "--micro-batches", "2"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["passed"] is True
    assert set(data["verdicts"]) == {"C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005"}
    assert data["config"]["strategy"] == "hybrid_shard:2" and len(data["steps"]) == 2
    assert data["comm_model"]["per_rank"]["by_group_kind"]["replicate"] > 0


def test_a_broken_engine_exits_1_and_names_the_violation(capsys):
    code = main(["simulate", "--fault", "stale-params", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "C-ZERO-003" in out and "rank=" in out and "tensor=" in out


def test_bad_input_is_one_line_and_exit_2():
    for argv in (["--strategy", "hybrid_shard:3"], ["--optimizer", "lamb"], ["--partitioner", "x"],
                 ["--max-grad-norm", "-1"], ["--inject-nan", "1:0"], ["--model", "nope"]):
        p = run_cli("simulate", *argv)
        assert p.returncode == 2, (argv, p.stderr)
        assert p.stderr.startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "Traceback" not in p.stderr


def test_non_finite_gradient_is_reported_with_rank_and_tensor():
    p = run_cli("simulate", "--inject-nan", "2:1:lm_head.weight", "--steps", "2")
    assert p.returncode == 3
    assert (
        "non-finite gradient on rank 2" in p.stderr and "lm_head.weight" in p.stderr and "step 1" in p.stderr
    )


def test_shared_argument_helpers_build_the_same_config():
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args(
        [
            "--strategy",
            "zero2",
            "--max-grad-norm",
            "none",
            "--inject-nan",
            "1:0:embedding.weight",
            "--world-size",
            "2",
            "--steps",
            "1",
        ]
    )
    cfg = config_from_args(args)
    assert cfg.max_grad_norm is None and cfg.inject_nan == {
        "rank": 1,
        "step": 0,
        "tensor": "embedding.weight",
    }
    run = cfg.validate()
    assert run.strategy.name == "shard_grad_op" and run.spec.max_grad_norm is None


@pytest.mark.mpi
def test_backend_mpi_validates_before_launching(capsys):
    code = main(["simulate", "--backend", "mpi", "--strategy", "hybrid_shard:3", "--world-size", "4"])
    assert code == 2
    assert "does not divide world_size=4" in capsys.readouterr().err


def test_progress_reports_every_step_and_every_contract_then_the_rich_bar_renders():
    from zerosim.cli.simulate import _run_with_progress
    from zerosim.engine.spmd import RunConfig, run_simulated

    seen = []
    result = run_simulated(RunConfig(steps=3, world_size=2), progress=lambda *a: seen.append(a))
    assert result.passed
    assert [a for a in seen if a[0] == "train"] == [("train", 1, 3), ("train", 2, 3), ("train", 3, 3)]
    assert [a[0] for a in seen if a[0] != "train"] == [
        "C-ZERO-002",
        "C-ZERO-003",
        "C-ZERO-004",
        "C-ZERO-005",
        "done",
    ]
    # the rich progress bar (what a terminal shows) drives the same run and returns the same verdicts
    shown = _run_with_progress(RunConfig(steps=3, world_size=2).validate())
    assert shown.passed and {k: v.to_json() for k, v in shown.verdicts.items()} == \
        {k: v.to_json() for k, v in result.verdicts.items()}


def test_violations_print_once_each_with_their_contract(capsys):
    assert main(["simulate", "--fault", "extra-all-gather", "--steps", "1"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ring_model" in ln]
    assert lines and all(ln.startswith("C-ZERO-005 ring_model") for ln in lines), lines


def test_json_into_a_closed_pipe_is_not_a_traceback():
    p = subprocess.run(f"{sys.executable} -m zerosim simulate --json --steps 1 | head -c 10", shell=True,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
