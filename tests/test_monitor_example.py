"""``examples/monitored_training.py`` as its docstring runs it (two ranks, what torchrun starts): a clean
FSDP2 run passes live and offline; a bit flipped on rank 1 of a DDP run is found by the first check at
or after the flip and by ``zerosim check trace`` (two copies: both ranks named as disagreeing), and
training still ends with status 0; each ``--fault`` is named by its step check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason
from zerosim.cli import main as cli_main

pytestmark = pytest.mark.torchdist

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "monitored_training.py")
BOUND_S = 180.0  # one launch on two shared cores; reaching it is a hang


def _run(*args: str) -> tuple[str, str]:
    """The example's standard output and error (the monitor logs a line per check on rank 0's)."""
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    run = run_ranks(2, [EXAMPLE, *args], BOUND_S, env={"PYTHONWARNINGS": "ignore"})
    assert not run.timed_out and run.returncode == 0, (run.stdout or "")[-2000:] + (run.stderr or "")[-2000:]
    return run.stdout or "", run.stderr or ""


def _violations(capsys: pytest.CaptureFixture[str], out: Path, code: int) -> list[tuple]:
    assert cli_main(["check", "trace", str(out), "--json"]) == code
    doc = json.loads(capsys.readouterr().out)
    return [(v["step"], v["contract"], v["clause"], v["ranks"], v["tensor"])
            for verdict in doc["verdicts"] for v in verdict["violations"]]


def test_a_clean_fsdp2_run_passes_live_and_offline(tmp_path, capsys) -> None:
    stdout, _ = _run("--fsdp2", "--steps", "12", "--every", "5", "--out", str(tmp_path / "fsdp2"))
    assert "3 checks, 0 violation(s)" in stdout, stdout
    assert _violations(capsys, tmp_path / "fsdp2", 0) == []


def test_a_flipped_bit_is_named_at_the_first_check_after_it_and_training_goes_on(tmp_path, capsys) -> None:
    stdout, log = _run("--corrupt-at", "7", "--steps", "16", "--every", "5", "--out", str(tmp_path / "ddp"))
    assert "4 checks, 2 violation(s)" in stdout, stdout  # the checks at steps 10 and 15
    # two copies and no majority: the check says the ranks disagree instead of guessing which one is off
    assert "violation: C-ZERO-003 identical step=10 rank=0,1 tensor=blocks.0.weight" in log, log
    assert "ranks 0 and 1 disagree on blocks.0.weight" in log, log
    found = _violations(capsys, tmp_path / "ddp", 1)
    assert found == [(10, "C-ZERO-003", "identical", [0, 1], "blocks.0.weight"),
                     (15, "C-ZERO-003", "identical", [0, 1], "blocks.0.weight")], found


@pytest.mark.parametrize(("fault", "clause", "ranks", "tensor"), [
    (["--fault", "lr-spike"], "update", [0, 1], "embed.weight"),
    (["--fault", "halve-head-grad"], "grad_accounting", [0, 1], "head.weight"),
    (["--fault", "grad-bitflip", "--replay-every", "1"], "replay", [1], "blocks.0.weight"),
], ids=["lr-spike", "halve-head-grad", "grad-bitflip"])
def test_a_fault_every_replica_agrees_on_is_named_by_its_step_check(tmp_path, capsys, fault, clause, ranks,
                                                                     tensor) -> None:
    """The example's --fault choices: every replica holds the same bytes after each of them, so only the
    step checks see them, at the fault's step (7), naming the tensor, live and offline alike."""
    out = tmp_path / "fault"
    stdout, _ = _run(*fault, "--steps", "9", "--every", "1", "--out", str(out))
    assert "9 checks" in stdout, stdout
    found = _violations(capsys, out, 1)
    named = sorted({r for step, contract, kind, rs, t in found if (step, contract, kind, t)
                    == (7, "C-ZERO-002", clause, tensor) for r in rs})
    assert named == ranks, found
    assert {step for step, *_ in found} == {7}, found
