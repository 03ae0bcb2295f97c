"""``zerosim zoo``: the catalogue's shape, a fast subset of real runs, and what breaks an expectation.

The subset runs through the command line as CI runs the whole zoo: a bug verify and the monitor both
catch (a flipped bit in one rank's weights, at the step it flips; expert gradients EP times too large
on the MoE, at the first step, named by verify as a gradient scale), an expert-parallel MoE bug verify
catches and the monitor is known to miss (the token all-gather's backward without its reduce-scatter),
one out of the monitor's reach (K gradient reductions a step: right values, a traffic finding), each
twin passing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerogpu.launch import torch_unavailable_reason
from zerosim.cli import main as cli_main
from zerosim.zoo import bugs, runner
from zerosim.zoo.catalogue import BY_ID, CATCH, ENTRIES, FINDING, MISS, OUTCOMES

SUBSET = ("sdc-weight-bitflip", "pytorch-160285", "nemo-automodel-1260", "cosmos-161")


def test_catalogue_entries_are_complete():
    assert len(ENTRIES) >= 24 and len(BY_ID) == len(ENTRIES)
    for entry in ENTRIES:
        assert entry.report and entry.framework and entry.regime and entry.mechanism.endswith(".")
        for plan, reason in ((entry.verify, entry.verify_reason), (entry.live, entry.live_reason)):
            if plan is None:
                assert reason, f"{entry.id}: a judge out of reach needs its reason"
                continue
            assert plan.mechanism in bugs.MECHANISMS and plan.expect in OUTCOMES
            if plan.expect == MISS:
                assert entry.gap, f"{entry.id}: an expected miss names the check that would see it"


def test_fused_chunk_layout_round_trips_only_at_the_saving_rank_count():
    rows = torch.arange(75 * 2, dtype=torch.float64).reshape(75, 2)
    saved = bugs._interleave(rows, 2)
    assert torch.equal(bugs._deinterleave(saved, 2, 75), rows)
    assert not torch.equal(bugs._deinterleave(saved, 3, 75), rows)


def test_a_lost_catch_or_a_false_alarm_breaks_the_expectation():
    entry = BY_ID["sdc-weight-bitflip"]
    caught = {"outcome": CATCH, "first_step": 2}
    quiet = {"outcome": MISS, "first_step": None}
    for bug, twin, holds in ((caught, quiet, True), (quiet, quiet, False), (caught, caught, False)):
        # the monitor's plan expects a catch here: a lost catch, or a false alarm, fails it too
        row = {"verify_run": {"broken": bug, "fixed": twin}, "live_run": {"broken": caught, "fixed": quiet}}
        verdicts = runner._verdicts(row, entry)
        assert verdicts["verify"]["holds"] is holds
        matrix = runner._matrix([{"id": entry.id, "verdicts": verdicts}], 0.0)
        assert runner.exit_code(matrix) == (0 if holds else 1)


def test_a_known_miss_now_caught_holds_and_is_listed():
    entry = BY_ID["deepspeed-6550"]  # the monitor is expected to miss it
    caught = {"outcome": CATCH, "first_step": 1}
    quiet = {"outcome": MISS, "first_step": None}
    row = {"verify_run": {"broken": caught, "fixed": quiet}, "live_run": {"broken": caught, "fixed": quiet}}
    verdicts = runner._verdicts(row, entry)
    assert verdicts["monitor"]["holds"] and verdicts["monitor"]["gained"]
    matrix = runner._matrix([{"id": entry.id, "verdicts": verdicts}], 0.0)
    assert runner.exit_code(matrix) == 0 and matrix["catches_gained"] == [entry.id]


def test_unknown_entry_is_one_line_naming_it(capsys, tmp_path):
    assert cli_main(["zoo", "--only", "sdc-weight-bitflip,no-such-bug", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no-such-bug" in err[0] and "only" in err[0]


def test_fast_subset_runs_and_every_expectation_holds(capsys, tmp_path):
    reason = torch_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "zoo"
    assert cli_main(["zoo", "--only", ",".join(SUBSET), "--out", str(out), "--json"]) == 0
    matrix = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r["verdicts"] for r in matrix["entries"]}
    flip = rows["sdc-weight-bitflip"]
    assert flip["verify"]["bug"] == CATCH and flip["verify"]["first_step"] == bugs.FAULT_STEP
    assert flip["monitor"]["bug"] == CATCH and flip["monitor"]["first_step"] == bugs.FAULT_STEP
    doubled = rows["pytorch-160285"]
    assert doubled["verify"]["bug"] == CATCH and doubled["monitor"]["bug"] == CATCH
    assert doubled["verify"]["first_step"] == doubled["monitor"]["first_step"] == 1
    runs = {r["id"]: r for r in matrix["entries"]}["pytorch-160285"]
    assert runs["verify_run"]["broken"]["bug_classes"][0] == "gradient-scale"
    assert runs["live_run"]["broken"]["contracts"] == ["C-ZERO-002 grad_accounting"]
    gather = rows["nemo-automodel-1260"]
    assert gather["verify"]["bug"] == CATCH and gather["verify"]["first_step"] == 1
    assert gather["monitor"]["expected"] == MISS
    # a known miss holds as a miss, or as a catch a new monitor check gained (then listed as such)
    gained = gather["monitor"]["bug"] == CATCH
    assert gather["monitor"]["gained"] is gained
    assert (matrix["catches_gained"] == ["nemo-automodel-1260"]) is gained
    assert all(v["twin"] == "pass" for e in ("sdc-weight-bitflip", "pytorch-160285", "nemo-automodel-1260")
               for v in rows[e].values())
    traffic = rows["cosmos-161"]
    assert traffic["verify"]["bug"] == FINDING and traffic["verify"]["twin"] == "pass"
    assert traffic["monitor"]["expected"] is None  # out of the monitor's reach: skipped, not run
    assert matrix["verify"] == {**matrix["verify"], "reach": 4, "caught": 4, "false_alarms": 0}
    assert matrix["monitor"] == {**matrix["monitor"], "reach": 3, "caught": 2 + gained, "false_alarms": 0}
    assert {p.name for p in Path(out).iterdir()} >= {"zoo.json", "zoo.md", "zoo.png"}

