"""zerosim.monitor inside users' own DDP loops at world 2 (gloo), tests/monitor_programs/user_loops.py:

- it never stops or fails a run: a rank that does not call ``after_step`` at a check step (every=1 and
  every=5), or at the last step, ends with exit 0 on both ranks, the check recorded as skipped on
  both, the checks after it judged again, and ``close()`` writing summary.json;
- no false alarm in the setups people run (frozen parameters, a LoRA-style adapter, a parameter group
  added and a layer unfrozen mid-run, tied weights, gradient accumulation under ``no_sync``,
  ``model.eval()`` phases, CPU bfloat16 autocast): 200 steps each, a check at every one, zero
  violations live and from ``zerosim check trace`` on the folder;
- in each of those setups a bit flipped on rank 1 is still caught at the check of the step it is
  flipped at (at world 2 the two ranks are said to disagree: neither copy is a majority).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerogpu.launch import run_ranks, torch_unavailable_reason
from zerosim.cli import main as cli_main

PROGRAM = str(Path(__file__).parent / "monitor_programs" / "user_loops.py")
BOUND_S = 400.0  # nine 200-step setups in one launch on two shared cores (about 55 s measured)
SETUPS = ("frozen", "lora", "add-group", "unfreeze", "tied", "no-sync", "eval", "autocast")
SOAK_STEPS = 200
FLIP_STEPS, FLIP_AT = 12, 7


def _launch(tmp: Path, tag: str, setups: list[str], *options: str) -> dict[tuple[str, int], dict]:
    """One launch of PROGRAM at world 2: (setup, rank) -> that rank's record."""
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    results = tmp / tag
    run = run_ranks(2, [PROGRAM, str(results), str(tmp / f"out-{tag}"), "--setup", ",".join(setups),
                        *options], BOUND_S, env={"PYTHONWARNINGS": "ignore"})
    assert not run.timed_out and run.returncode == 0, run.stderr[-3000:]
    records = {}
    for rank in (0, 1):
        for line in Path(f"{results}.rank{rank}").read_text().splitlines():
            record = json.loads(line)
            records[(record["setup"], rank)] = record
    return records


@pytest.mark.parametrize(("every", "skip_at", "steps", "skipped_steps"),
                         [(1, 5, 20, [5, 6]), (5, 10, 31, [10, 15]), (1, 19, 20, [19, None])])
def test_a_rank_that_skips_a_check_ends_the_run_cleanly_and_the_check_is_recorded(
        tmp_path, every, skip_at, steps, skipped_steps):
    records = _launch(tmp_path, "skip", [f"skip-at-{skip_at}"], "--steps", str(steps), "--every", str(every))
    for rank in (0, 1):
        summary = records[(f"skip-at-{skip_at}", rank)]["summary"]
        assert summary["enabled"] and summary["off_reason"] is None, summary
        assert summary["skipped_count"] == 1 and summary["skipped"] == [{"steps": skipped_steps}], summary
        assert summary["passed"] and records[(f"skip-at-{skip_at}", rank)]["violations"] == []
        # every other check is judged: the ranks' rows are back in line after the skipped one
        checks = -(-steps // every)
        not_judged = len({s for s in skipped_steps if s is not None})
        assert summary["checks"] == checks - not_judged, summary
    out = tmp_path / "out-skip" / f"skip-at-{skip_at}"
    assert json.loads((out / "summary.json").read_text())["skipped"] == [{"steps": skipped_steps}]


@pytest.fixture(scope="module")
def soaked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[str, int], dict]]:
    tmp = tmp_path_factory.mktemp("setups")
    return tmp, _launch(tmp, "soak", list(SETUPS), "--steps", str(SOAK_STEPS), "--every", "1")


@pytest.mark.parametrize("setup", SETUPS)
def test_no_false_alarm_in_the_setups_people_run(soaked, setup, capsys):
    tmp, records = soaked
    for rank in (0, 1):
        record = records[(setup, rank)]
        summary = record["summary"]
        assert record["violations"] == [] and summary["passed"], record["violations"][:3]
        assert summary["checks"] == SOAK_STEPS and summary["skipped_count"] == 0, summary
        assert summary["steps_checked"] == [0, SOAK_STEPS - 1], summary
        # unfreezing adds gradient pieces to the layout: noted once, as any layout change is
        assert summary["notes"] == ([] if setup != "unfreeze" else [
            "a layout changed at step 60: that check compared the pieces its row had room for, every "
            "check after it compares them all"]), summary["notes"]
    assert records[(setup, 0)]["params"] == records[(setup, 1)]["params"]
    assert cli_main(["check", "trace", str(tmp / "out-soak" / setup)]) == 0
    assert f"PASS {SOAK_STEPS} check(s)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def flipped(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict]:
    tmp = tmp_path_factory.mktemp("flips")
    return _launch(tmp, "flip", list(SETUPS), "--steps", str(FLIP_STEPS), "--every", "1",
                   "--flip-at", str(FLIP_AT))


@pytest.mark.parametrize("setup", SETUPS)
def test_a_bit_flip_is_still_caught_in_each_setup(flipped, setup):
    """Rank 1's copy of a tensor both ranks hold (user_loops.FLIPPED: a frozen one where the setup has
    one) flipped after step FLIP_AT: caught at that step's check, the two ranks said to disagree."""
    record = flipped[(setup, 0)]
    found = record["violations"]
    assert found and min(v["step"] for v in found) == FLIP_AT, found[:3]
    first = [v for v in found if v["step"] == FLIP_AT and v["clause"] == "identical"]
    assert any(v["tensor"] == record["flipped"] and v["ranks"] == [0, 1] and "disagree" in v["text"]
               for v in first), first


def test_a_failing_hook_of_the_monitor_never_reaches_the_loop(tmp_path):
    """From step 5 the monitor's projection and update recompute raise on rank 1, inside the hooks it
    put into backward and the optimizer step: the loop trains every step to the same weights as without
    the failure, both ranks exit 0, rank 1 names the failing hook and the monitor is off on both."""
    records = _launch(tmp_path, "hooks", ["plain", "hook-error-5"], "--steps", "12", "--every", "1")
    for rank in (0, 1):
        assert records[("hook-error-5", rank)]["params"] == records[("plain", 0)]["params"]
        summary = records[("hook-error-5", rank)]["summary"]
        # off at step 5's check, on rank 1 before the check of step 4 completed there
        assert summary["off_reason"] is not None and summary["checks"] == 5 - rank, summary
    assert "hook failed: ZeroDivisionError" in records[("hook-error-5", 1)]["summary"]["off_reason"]
