"""``zerosim bench``'s launchers ship their ranks one value: PeersRun (bench peers) and MpiBenchRun
(bench mpi), frozen, JSON both ways, checked field by field on every rank; a bad file is one line
naming the field and exit 2 on every rank.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerosim.bench.mpi import MpiBenchRun, read_mpi_bench_run
from zerosim.bench.peers import rank_run
from zerosim.bench.peers_run import PeersRun, read_peers_run, write_peers_run
from zerosim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"adapters": ["ddp", "torch-zero"], "steps": 2, "warmup": 0, "rounds": 3, "min_time_s": 0.5,
            "dtype": "float64", "device": "cpu", "optimizer": "sgd", "timeout_s": 30.0}


def test_the_launchers_value_round_trips_through_its_file_unchanged(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    run = rank_run(SETTINGS, "gpt", tmp_path / "results.jsonl", start=3, skip=["torch-zero"])
    assert dataclasses.is_dataclass(run) and run.models == ("gpt",) and run.skip == ("torch-zero",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.steps = 5  # type: ignore[misc]
    path = write_peers_run(run, tmp_path / "run.json")
    assert json.loads(path.read_text())["from_position"] == 3
    assert read_peers_run(path) == run
    assert run.settings(2) == {"device": "cpu", "world": 2, "dtype": "float64", "optimizer": "sgd",
                               "steps": 2, "warmup": 0, "rounds": 3, "min_time_s": 0.5, "timeout_s": 30.0}


@pytest.mark.parametrize(
    "change,field",
    [
        ({"steps": 0}, "steps"),
        ({"timeout_s": -1.0}, "timeout"),
        ({"dtype": "int8"}, "dtype"),
        ({"adapters": "ddp"}, "adapters"),
        ({"models": ["no-such-model"]}, "model"),
        ({"from_position": -2}, "from_position"),
        ({"results": 7}, "results"),
        ({"colour": "red"}, "bench peers run file field 'colour'"),
        ({"format": "zerosim-run/1"}, "format"),
    ],
)
def test_a_tampered_peers_run_names_the_field(change: dict, field: str) -> None:
    pytest.importorskip("torch")
    good = PeersRun(models=("gpt",), adapters=("ddp",)).to_json()
    with pytest.raises(ConfigError) as info:
        PeersRun.from_json({**good, **change})
    assert info.value.field == field, str(info.value)


def test_a_file_that_is_not_a_run_is_one_config_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "run.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="run.json"):
        read_peers_run(bad)
    with pytest.raises(ConfigError, match="cannot be read|No such file"):
        read_mpi_bench_run(str(tmp_path / "missing.json"))


def test_the_mpi_bench_value_round_trips_and_refuses_a_bad_size() -> None:
    run = MpiBenchRun((1024, 4096), 3, 5.0, "/tmp/part.json")
    assert MpiBenchRun.from_json(json.loads(json.dumps(run.to_json()))) == run
    for change, field in (({"sizes": [1024, 0]}, "sizes"), ({"sizes": []}, "sizes"),
                          ({"repeats": True}, "repeats"), ({"target_ms": "fast"}, "target_ms"),
                          ({"out": ""}, "out")):
        with pytest.raises(ConfigError) as info:
            MpiBenchRun.from_json({**run.to_json(), **change})
        assert info.value.field == field


def test_a_peers_rank_given_a_bad_run_file_exits_2_with_one_line(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({**PeersRun(models=("gpt",), adapters=("ddp",)).to_json(), "steps": 0}))
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-m", "zerosim.bench.peers_rank", "--config", str(bad)],
                         capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["error: invalid steps=0: must be a positive integer"]


@pytest.mark.mpi
def test_an_mpi_bench_worker_given_a_bad_run_file_exits_2_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({**MpiBenchRun((1024,), 1, 1.0, str(tmp_path / "p.json")).to_json(),
                               "sizes": [-1]}))
    run = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "zerosim.mpi", "bench-worker",
                          "--config", str(bad)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["error: invalid sizes=-1: must be a positive integer"]
    assert not (tmp_path / "p.json").exists()
