"""``zerosim simulate --save-checkpoint DIR``: the simulated ranks save the state they trained as a sharded
checkpoint that ``zerosim checkpoint inspect`` reads (exit 0) and ``reshard`` rewrites, holding bit for bit
what training the same run gives; a DIR that holds anything, or a launched backend, is refused in one
line with exit 2 before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerosim.checks.checkpoint import StateSnapshot
from zerosim.cli import build_parser, main
from zerosim.cli.run_options import config_from_args
from zerosim.testing.checkpoint_runs import load_and_snapshot, train_and_save

RUN = ["--strategy", "zero3", "--world-size", "4", "--steps", "3", "--precision", "fp32"]


def _config(*options: str) -> Any:
    return config_from_args(build_parser("simulate").parse_args(["simulate", *options]))


def _same_state(a: StateSnapshot, b: StateSnapshot) -> None:
    assert a.step == b.step and set(a.states) == set(b.states)
    for name in a.states:
        assert np.array_equal(a.states[name].view(np.uint8), b.states[name].view(np.uint8)), name


def test_the_saved_checkpoint_holds_the_trained_state_and_reshards(tmp_path: Path, capsys: Any) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "resharded"
    assert main(["simulate", *RUN, "--json", "--save-checkpoint", str(ckpt)]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["passed"] is True  # stdout stays one JSON document
    assert f"saved in {ckpt}" in captured.err

    assert main(["checkpoint", "inspect", str(ckpt), "--json"]) == 0
    inspection = json.loads(capsys.readouterr().out)
    assert inspection["step"] == 3 and inspection["world_size"] == 4, inspection

    trained = train_and_save(_config(*RUN), 3, None)[0]
    _same_state(load_and_snapshot(_config(*RUN), ckpt)[0][0], trained)

    reshard = ["checkpoint", "reshard", str(ckpt), str(out), "--world-size", "3", "--strategy", "zero3"]
    assert main(reshard) == 0
    capsys.readouterr()
    three = [*RUN[:2], "--world-size", "3", *RUN[4:]]
    _same_state(load_and_snapshot(_config(*three), out)[0][0], trained)


@pytest.mark.parametrize("occupant", ["file-inside", "a-file"])
def test_a_directory_that_is_not_new_and_empty_is_refused_before_training(
    tmp_path: Path, occupant: str, capsys: Any
) -> None:
    target = tmp_path / "ckpt"
    if occupant == "file-inside":
        target.mkdir()
        (target / "notes.txt").write_text("mine")
    else:
        target.write_text("not a directory")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["simulate", *RUN, "--save-checkpoint", str(target)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: invalid save_checkpoint='{target}': "), lines
    assert captured.out == "" and sorted(p.name for p in tmp_path.rglob("*")) == before


def test_an_empty_directory_is_used(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "ckpt").mkdir()
    assert main(["simulate", *RUN, "--save-checkpoint", str(tmp_path / "ckpt")]) == 0
    assert "saved in" in capsys.readouterr().out
    assert main(["checkpoint", "inspect", str(tmp_path / "ckpt")]) == 0


def test_a_launched_backend_is_refused(tmp_path: Path, capsys: Any) -> None:
    assert main(["simulate", "--backend", "mpi", "--save-checkpoint", str(tmp_path / "c")]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: invalid save_checkpoint=") and "--backend mpi" in line, line
    assert not (tmp_path / "c").exists()
