"""The family of run values: every run type derives from one base and makes one JSON round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerosim.bench.mpi import MpiBenchRun
from zerosim.bench.peers_run import PeersRun
from zerosim.engine.config import RunConfig
from zerosim.engine.run_file import RankRun
from zerosim.errors import ConfigError
from zerosim.report.config import ReportConfig
from zerosim.values.run_value import RunValue
from zerosim.verify.run_value import VerifyRun

#: one value of each run type (every field a non-default where the type allows it cheaply)
VALUES: dict[str, RunValue] = {
    "RunConfig": RunConfig(model="tiny", world_size=2, strategy="hybrid_shard:2", steps=2, lr=0.01),
    "RankRun": RankRun(RunConfig(world_size=2), "torch", json_output=True, save_observations="obs.npz",
                       options={"device": "cpu", "dist_backend": "gloo"}),
    "VerifyRun": VerifyRun("fsdp2-hybrid", world=4, mesh=(2, 2), steps=4, seed=3, strict=True),
    "PeersRun": PeersRun(models=("gpt",), adapters=("ddp",), skip=("fsdp2",), results="rows.jsonl"),
    "MpiBenchRun": MpiBenchRun((1024, 4096), 3, 5.0, "rows.json"),
    "ReportConfig": ReportConfig(world_sizes=(1, 2), dp_degrees=(8, 16)),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_every_run_type_round_trips_through_its_json_file(name: str, tmp_path: Path) -> None:
    value = VALUES[name]
    assert isinstance(value, RunValue)
    data = json.loads(json.dumps(value.to_json()))  # what a file holds: plain JSON
    assert type(value).from_json(data) == value
    path = value.write(tmp_path / "run.json")
    assert type(value).read(path) == value
    if type(value).FORMAT is not None:
        assert data["format"] == type(value).FORMAT


@pytest.mark.parametrize("name", sorted(VALUES))
def test_an_unknown_field_is_named_in_one_line(name: str) -> None:
    data = {**VALUES[name].to_json(), "surprise": 1}
    with pytest.raises(ConfigError, match=r"field 'surprise'=1: unknown; known: "):
        type(VALUES[name]).from_json(data)


@pytest.mark.parametrize("name", sorted(n for n, v in VALUES.items() if type(v).FORMAT is not None))
def test_a_file_of_another_run_type_is_refused_by_its_format(name: str) -> None:
    other = VALUES["MpiBenchRun" if name != "MpiBenchRun" else "PeersRun"].to_json()
    with pytest.raises(ConfigError, match=r"invalid (format|.*field)"):
        type(VALUES[name]).from_json(other)


def test_the_run_types_are_one_family() -> None:
    """Each run type says only its fields, format and field checks: the JSON round trip, the file and
    ``replace`` are the base's."""
    for value in VALUES.values():
        kind = type(value)
        for method in ("from_json", "write", "read", "replace"):
            assert getattr(kind, method).__qualname__.startswith("RunValue."), (kind, method)
        assert value.replace() == value
