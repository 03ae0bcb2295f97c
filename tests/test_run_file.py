"""A run is one value: RunConfig <-> JSON, the run file a launcher ships, and the ranks that load it.

The round trip is checked for generated valid configs; every bad field of a tampered file is named in
one line (exit 2 on the rank side, before any rank computes anything).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from zerosim.engine.config import RunConfig
from zerosim.engine.run_file import (
    RUN_FILE_OPTIONS,
    RankRun,
    config_path_argument,
    read_rank_run,
    write_rank_run,
)
from zerosim.errors import ConfigError
from zerosim.numerics.model import SimModelConfig
from zerosim.numerics.optim import OptimizerSpec

STRATEGIES = ("no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2")


@st.composite
def run_configs(draw: st.DrawFn) -> RunConfig:
    """Valid RunConfigs as the command line and the Python API build them (names, and model / optimizer
    objects)."""
    world = draw(st.sampled_from((1, 2, 4)))
    steps = draw(st.integers(1, 3))
    strategy = draw(st.sampled_from(STRATEGIES))
    assume(not strategy.startswith("hybrid") or world % 2 == 0)
    micro = draw(st.integers(1, 2))
    model = draw(st.sampled_from(("tiny", SimModelConfig(64, 8, 1, 16, 4, 1))))
    optimizer = draw(st.sampled_from(("sgd", "adam", "adamw", OptimizerSpec("adam", lr=0.01))))
    injection = draw(st.none() | st.fixed_dictionaries({
        "rank": st.integers(0, world - 1), "step": st.integers(0, steps - 1),
        "tensor": st.just("lm_head.weight"),
    }))
    cfg = RunConfig(
        model=model, world_size=world, strategy=strategy,
        partitioner=draw(st.sampled_from(("fsdp", "deepspeed", "round-robin"))),
        optimizer=optimizer, precision=draw(st.sampled_from(("fp32", "bf16-mixed"))),
        steps=steps, micro_batches=micro, seed=draw(st.integers(0, 2**31)),
        lr=draw(st.none() | st.floats(1e-5, 1.0)), max_grad_norm=draw(st.none() | st.floats(0.1, 10.0)),
        batch_size=draw(st.none() | st.integers(1, 2)), timeout_s=draw(st.floats(1.0, 120.0)),
        schedule=draw(st.sampled_from(("serial", "threads"))),
        observe=draw(st.sampled_from(("auto", "full"))),
        inject_nan=injection, load=draw(st.sampled_from(("seed", "broadcast"))),
        reshard_at=draw(st.none() | st.integers(0, steps - 1)), xp=draw(st.sampled_from(("numpy", "torch"))),
        zero1_grad_reduce=draw(st.sampled_from(("all_reduce", "reduce_scatter"))),
    )
    try:
        cfg.validate()
    except ConfigError:
        assume(False)
    return cfg


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(run_configs())
def test_a_valid_config_survives_the_json_round_trip(cfg: RunConfig) -> None:
    again = RunConfig.from_json(json.loads(json.dumps(cfg.to_json())))
    assert again == cfg
    assert again.resolve().describe() == cfg.resolve().describe()


@pytest.mark.parametrize(("field", "value", "says"), [
    ("steps", "3", "invalid steps='3': expected an integer"),
    ("world_size", True, "invalid world_size=True: expected an integer"),
    ("offload", 1, "invalid offload=1: expected true/false"),
    ("stepz", 3, "invalid run config field 'stepz'=3: unknown"),
    ("strategy", "zero9", "invalid strategy='zero9': unknown strategy"),
    ("model", {"vocab_size": 64, "d_modl": 8}, "invalid model.d_modl=8: unknown"),
    ("inject_nan", {"rank": 5, "step": 0, "tensor": "lm_head.weight"}, "invalid inject_nan.rank=5"),
])
def test_a_bad_field_is_named_with_its_value(field: str, value: object, says: str) -> None:
    data = {**RunConfig(world_size=2).to_json(), field: value}
    with pytest.raises(ConfigError) as caught:
        RunConfig.from_json(data)
    assert str(caught.value).startswith(says) and "\n" not in str(caught.value)


def test_the_run_file_round_trips_and_refuses_a_tampered_one(tmp_path: Path) -> None:
    job = RankRun(RunConfig(world_size=2, strategy="zero2"), "torch", True, None, {"device": "cpu"})
    path = write_rank_run(job, tmp_path / "run.json")
    assert read_rank_run(path, "torch") == job
    assert job.option("device") == "cpu" and job.option("all_gather") == "auto"
    with pytest.raises(ConfigError, match="invalid backend='torch': this run file is for the torch backend"):
        read_rank_run(path, "mpi")
    for change, says in [
        ({"options": {"dist_backend": "mpi"}}, "invalid options.dist_backend='mpi': known: "),
        ({"options": {"timeout_mode": "abort"}}, "invalid options.timeout_mode='abort': not a torch setting"),
        ({"format": "zerosim-run/0"}, "invalid format='zerosim-run/0'"),
        ({"json_output": "yes"}, "invalid json_output='yes'"),
    ]:
        tampered = tmp_path / "tampered.json"
        tampered.write_text(json.dumps({**job.to_json(), **change}))
        with pytest.raises(ConfigError) as caught:
            read_rank_run(tampered, "torch")
        assert str(caught.value).startswith(says), str(caught.value)
    (tmp_path / "cut.json").write_text(path.read_text()[:40])
    with pytest.raises(ConfigError, match=r"invalid run file=.*cut.json.*not JSON"):
        read_rank_run(tmp_path / "cut.json", "torch")
    with pytest.raises(ConfigError, match=r"invalid run file=.*missing.json"):
        read_rank_run(tmp_path / "missing.json", "torch")


def test_the_rank_argument_is_one_path_and_nothing_else() -> None:
    for spelling in RUN_FILE_OPTIONS:
        assert config_path_argument([spelling, "a.json"]) == "a.json"
        assert config_path_argument([f"{spelling}=a.json"]) == "a.json"
        assert config_path_argument([spelling, "a.json", "--steps", "2"]) is None
    assert config_path_argument(["--steps", "2"]) is None
    assert config_path_argument(["--running=a.json"]) is None


def test_a_rank_given_options_becomes_the_command_line_in_the_same_process(tmp_path: Path) -> None:
    """A rank entry point given options parses nothing itself: the process becomes
    ``python -m zerosim.cli.ranks``, whose parser (the torch rank's) answers with its usage and exit 2."""
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nfrom zerosim.engine.run_file import hand_to_command_line\n"
                     "hand_to_command_line('zerogpu-simulate', sys.argv[1:])\n")
    p = subprocess.run([sys.executable, str(probe), "--no-such-option"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "RANK": "0"})
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert "torchrun --nproc-per-node N -m zerogpu simulate" in p.stderr
    assert "unrecognized arguments: --no-such-option" in p.stderr
    assert "Traceback" not in p.stderr


def _tamper(path: Path, **run_fields: object) -> None:
    data = json.loads(path.read_text())
    data["run"].update(run_fields)
    path.write_text(json.dumps(data))


def test_a_torch_rank_given_a_tampered_file_says_one_line_and_exits_2(tmp_path: Path) -> None:
    """The torch rank entry point loads the file before it looks for torchrun: no launch needed."""
    pytest.importorskip("torch")
    path = tmp_path / "run.json"
    write_rank_run(RankRun(RunConfig(world_size=2), "torch"), path)
    _tamper(path, micro_batches=-1)
    p = subprocess.run([sys.executable, "-m", "zerogpu", "simulate", "--config", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == ["error: invalid micro_batches=-1: must be a positive integer"], p.stderr


@pytest.mark.mpi
def test_mpi_ranks_run_the_written_file_and_refuse_a_tampered_one(tmp_path: Path) -> None:
    """``zerosim simulate --write-config`` writes what ranks a user starts load; a tampered file: one
    line naming the field, exit 2 on every rank."""
    from zerosim.mpi.launch import mpi_unavailable_reason, run_mpiexec

    reason = mpi_unavailable_reason()
    if reason:
        pytest.skip(reason)
    path = tmp_path / "run.json"
    made = subprocess.run([sys.executable, "-m", "zerosim", "simulate", "--backend", "mpi",
                           "--world-size", "2", "--steps", "1", "--json", "--write-config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "-m zerosim.mpi simulate --config" in made.stdout
    ran = run_mpiexec(2, ["-m", "zerosim.mpi", "simulate", "--config", str(path)], 120)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout or "")["passed"] is True
    _tamper(path, strategy="hybrid_shard:3")
    bad = run_mpiexec(2, ["-m", "zerosim.mpi", "simulate", "--config", str(path)], 120)
    assert bad.returncode == 2, bad.stderr
    lines = [line for line in (bad.stderr or "").splitlines() if line.strip()]
    assert lines == ["error: invalid strategy='hybrid_shard:3': the shard group size 3 does not divide "
                     "world_size=2"], bad.stderr


# ---- zerosim verify's run value ------------------------------------------------------------------------


def test_a_verify_run_survives_the_file_round_trip(tmp_path: Path) -> None:
    from zerosim.verify.run_value import VerifyRun, read_verify_run, write_verify_run

    run = VerifyRun("fsdp2", world=3, steps=6, dtype="float32", model="gpt-tied", optimizers="adamw",
                    seed=5, timeout_s=30.0, out=str(tmp_path), quiet=True, resume_at=1,
                    resume_dir=str(tmp_path / "r"), resume_stage="save")
    assert read_verify_run(write_verify_run(run, tmp_path / "run.json")) == run


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("dtype", "float16", "invalid dtype='float16': must be one of float64, float32"),
        ("steps", "4", "invalid steps='4': expected an integer"),
        ("quiet", 1, "invalid quiet=1: expected true/false"),
        ("resume_stage", "both", "invalid resume_stage='both': must be one of save, load"),
        ("timeout_s", -1, "invalid timeout_s=-1.0: must be a positive number of seconds"),
        ("colour", "red", "invalid run file field 'colour'='red': unknown; known: format, target"),
        ("format", "zerosim-verify-run/0", "invalid format='zerosim-verify-run/0': expected"),
    ],
)
def test_a_tampered_verify_run_names_the_field_and_value(tmp_path: Path, field: str, value: object,
                                                         says: str) -> None:
    from zerosim.verify.run_value import VerifyRun, read_verify_run, write_verify_run

    path = write_verify_run(VerifyRun("ddp", world=2), tmp_path / "run.json")
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        read_verify_run(path)
    assert str(caught.value).startswith(says), str(caught.value)


def test_a_verify_run_file_that_is_not_one_is_refused(tmp_path: Path) -> None:
    from zerosim.files.json_file import MAX_SETTINGS_BYTES
    from zerosim.verify.run_value import read_verify_run

    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (MAX_SETTINGS_BYTES + 1))
    for path, says in ((tmp_path / "absent.json", "No such file"), (huge, "larger than"),
                       (tmp_path / "list.json", "expected a JSON object")):
        if path.name == "list.json":
            path.write_text("[1, 2]")
        with pytest.raises(ConfigError, match=says):
            read_verify_run(path)


def test_a_verify_rank_given_a_tampered_file_says_one_line_and_exits_2(tmp_path: Path) -> None:
    """The verify rank entry point reads its run file before it touches torch.distributed; an option
    beside ``--run-file`` is refused too (the file holds every option)."""
    pytest.importorskip("torch")
    from zerosim.verify.run_value import VerifyRun, write_verify_run

    path = write_verify_run(VerifyRun("ddp", world=1), tmp_path / "run.json")
    data = json.loads(path.read_text())
    data["optimizers"] = "lion"
    path.write_text(json.dumps(data))
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for argv, says in ((["--run-file", str(path)], "error: invalid optimizers="),
                       (["--run-file", str(path), "--steps", "3"], "error: invalid run_file=")):
        p = subprocess.run([sys.executable, "-m", "zerosim.verify", *argv], capture_output=True, text=True,
                           timeout=120, env={**os.environ, **env})
        assert p.returncode == 2, p.stderr
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(says), p.stderr
