"""The bug-detection matrix: every catalogued mutant is killed, by the contracts it claims, with a
diagnostic that names what it broke; a mutant that breaks nothing survives and fails the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerosim.cli import main
from zerosim.engine.config import RunConfig
from zerosim.engine.fault_catalog import FAULTS, Fault, Touched
from zerosim.errors import ConfigError
from zerosim.report import mutants
from zerosim.values.strategy import StrategyKind

#: the bug classes a verification harness must catch, each by a named mutant
REQUIRED = {
    "off-by-one shard boundary": "shard-off-by-one",
    "overlapping shards": "overlapping-shards",
    "dropped remainder": "dropped-remainder",
    "trailing shard owned by no rank": "trailing-shard-unowned",
    "sum instead of mean": "sum-instead-of-avg",
    "wrong group size as divisor": "wrong-group-divisor",
    "accumulation mis-averaged": "no-accum-average",
    "clipping with a rank-local norm": "local-norm-clip",
    "hybrid norm over-counting replicas": "norm-over-replicas",
    "hybrid without the replicate all-reduce": "skip-replicate-allreduce",
    "missing all-gather (stale parameters)": "stale-params",
    "partial all-gather": "partial-all-gather",
    "padding leaking into values": "padding-leak",
    "per-shard step counter drift": "step-counter-drift",
    "offload copy-back skipped": "offload-copy-back-skipped",
    "load broadcast that misses a group": "load-broadcast-misses-group",
    "reshard in the wrong order": "reshard-wrong-order",
}


@pytest.fixture(scope="module")
def matrix() -> dict:
    return mutants.run_matrix(list(FAULTS.values()))


def test_the_catalogue_covers_every_required_bug_class_with_at_least_15_mutants() -> None:
    assert len(FAULTS) >= 15
    missing = {cls: name for cls, name in REQUIRED.items() if name not in FAULTS}
    assert not missing
    assert {f.where for f in FAULTS.values()} == {"engine", "partitioner", "state-dict"}


def test_every_mutant_is_killed_by_exactly_the_contracts_it_claims(matrix: dict) -> None:
    assert matrix["survived"] == [] and matrix["killed"] == matrix["total"] == len(FAULTS)
    wrong = {r["name"]: (sorted(r["contracts"]), r["expected_contracts"])
             for r in matrix["mutants"] if not r["matches_catalogue"]}
    assert not wrong
    assert mutants.exit_code(matrix) == 0


def test_the_first_failing_contract_names_the_rank_and_range_the_fault_touched(matrix: dict) -> None:
    vague = {r["name"]: r["diagnostic"] for r in matrix["mutants"] if not r["names_touched"]}
    assert not vague
    by_name = {r["name"]: r for r in matrix["mutants"]}
    # the targeted ones say exactly where
    assert by_name["stale-params"]["first_contract"] == "C-ZERO-003"
    assert "rank 1's gathered weights differ" in by_name["stale-params"]["diagnostic"]
    assert by_name["shard-off-by-one"]["first_step"] == mutants.PLAN_STAGE
    assert "owned by no rank" in by_name["shard-off-by-one"]["diagnostic"]
    assert "owned by ranks" in by_name["overlapping-shards"]["diagnostic"]
    assert by_name["reshard-wrong-order"]["first_step"] == 1  # the round trip follows step 0


def test_partitioner_faults_stop_the_run_before_training() -> None:
    from zerosim.engine.spmd import run_simulated

    r = run_simulated(RunConfig(fault="dropped-remainder", strategy="zero3", world_size=5))
    assert not r.verdicts["C-ZERO-001"].passed and r.observations == [] and r.steps == []
    v = r.verdicts["C-ZERO-001"].violations[0]
    assert v.clause == "coverage" and v.interval == (6190, 6192) and v.ranks == (4,)
    assert all(r.verdicts[c].details.get("skipped") for c in ("C-ZERO-002", "C-ZERO-003"))


def test_names_touched_rejects_a_diagnostic_that_points_elsewhere() -> None:
    v = {"contract": "C-ZERO-002", "clause": "allclose", "step": 0, "ranks": [0], "start": 10, "stop": 20}
    assert mutants.names_touched([v], Touched((0,), ((15, 30),)))
    assert not mutants.names_touched([v], Touched((1,), ((15, 30),)))      # another rank
    assert not mutants.names_touched([v], Touched((0,), ((20, 30),)))      # another range
    assert not mutants.names_touched([{**v, "ranks": []}], Touched())      # names no rank at all
    assert mutants.names_touched([v], Touched())


def test_a_mutant_that_breaks_nothing_survives_and_the_command_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The matrix is not vacuous: the reference engine dressed up as a mutant (it hands the engine no
    corruption) is not 'killed'."""
    harmless = Fault("harmless", "engine", "", "the reference engine", ("C-ZERO-002",),
                     lambda run: None, {"strategy": "zero3", "world_size": 2, "steps": 1})
    monkeypatch.setitem(FAULTS, "harmless", harmless)
    m = mutants.run_matrix([harmless])
    assert m["survived"] == ["harmless"] and mutants.exit_code(m) == 1
    assert m["mutants"][0]["first_contract"] is None and not m["mutants"][0]["matches_catalogue"]


def test_cli_json_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["mutants", "--only", "stale-params,shard-off-by-one", "--json", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["mutants"]}
    assert set(rows) == {"stale-params", "shard-off-by-one"}
    for r in rows.values():
        assert {"name", "killed", "first_contract", "first_step"} <= set(r) and r["killed"] is True
    assert rows["stale-params"]["first_step"] == 0
    assert {p.name for p in tmp_path.iterdir()} == {"mutants.json", "mutants.md", "mutants.png"}
    assert (tmp_path / "mutants.png").read_bytes()[:4] == b"\x89PNG"
    assert "| `stale-params` |" in (tmp_path / "mutants.md").read_text()


def test_cli_bad_input_is_one_line() -> None:
    with pytest.raises(ConfigError, match="only"):
        mutants.select("stale-params,nope")
    p = subprocess.run([sys.executable, "-m", "zerosim", "mutants", "--only", "nope", "--no-report"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "nope" in p.stderr


@pytest.mark.parametrize(("argv", "where"), [
    (["--fault", "padding-leak"], "--world-size 5"),  # the default plan has no padding
    (["--fault", "local-norm-clip", "--strategy", "hybrid_shard:1", "--world-size", "3"], "--max-grad-norm"),
    (["--fault", "no-accum-average"], "--micro-batches 2"),
    (["--fault", "reshard-wrong-order"], "--reshard-at 0"),
])
def test_a_fault_that_cannot_act_is_refused_naming_a_configuration_where_it_does(argv: list[str],
                                                                                 where: str) -> None:
    p = subprocess.run([sys.executable, "-m", "zerosim", "simulate", *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stdout + p.stderr
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "cannot act here" in line and where in line


def test_every_example_configuration_is_one_where_its_fault_acts() -> None:
    for fault in FAULTS.values():
        run = RunConfig(**fault.example).resolve()
        assert fault.cannot_act(run) is None, fault.name
        assert run.strategy.kind in StrategyKind


@pytest.mark.mpi
def test_mutants_under_mpi_are_killed_the_same_way() -> None:
    m = mutants.run_matrix([FAULTS["stale-params"], FAULTS["overlapping-shards"]], backend="mpi",
                           timeout_s=240)
    assert m["survived"] == [], [r.get("error") for r in m["mutants"]]
    rows = {r["name"]: r for r in m["mutants"]}
    assert rows["stale-params"]["first_contract"] == "C-ZERO-003" and rows["stale-params"]["names_touched"]
    assert rows["overlapping-shards"]["first_step"] == mutants.PLAN_STAGE


@pytest.mark.parametrize("strategy", ["no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2",
                                      "hybrid_shard_zero2:2"])
def test_the_correct_load_broadcast_and_state_dict_round_trip_pass_every_contract(strategy: str) -> None:
    """The code paths the state-dict mutants break are correct when not broken: bitwise equal to the
    same-order reference, with the rank-0 broadcast load and a round trip after step 0."""
    from zerosim.engine.spmd import run_simulated

    r = run_simulated(RunConfig(strategy=strategy, world_size=4, steps=2, load="broadcast", reshard_at=0))
    assert r.passed, [str(v) for vd in r.verdicts.values() for v in vd.violations[:2]]
    assert r.verdicts["C-ZERO-002"].details["bitwise_required"]


def test_load_and_reshard_at_are_validated() -> None:
    with pytest.raises(ConfigError, match="load"):
        RunConfig(load="disk").resolve()
    with pytest.raises(ConfigError, match="reshard_at"):
        RunConfig(steps=2, reshard_at=2).resolve()


@pytest.mark.torchdist
@pytest.mark.slow
def test_broken_trainers_join_the_matrix_and_a_correct_one_survives(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["mutants", "--only", "stale-params", "--trainers", "tests.verify_trainers.mutant_sample",
               "--json", "--no-report"])
    data = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in data["mutants"]}
    broken = rows["tests.verify_trainers.mutant_sample:summed_gradient"]
    assert broken["killed"] and broken["where"] == "trainer" and broken["first_contract"] == "C-ZERO-002"
    assert data["survived"] == ["tests.verify_trainers.mutant_sample:correct"] and rc == 1


def test_a_trainer_module_without_mutants_is_one_line() -> None:
    from zerosim.errors import ImplementationError

    with pytest.raises(ImplementationError, match="MUTANTS"):
        mutants.trainer_mutants("tests.verify_trainers.bad")
