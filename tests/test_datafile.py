"""zerosim.files.datafile: what one process leaves for another comes back equal, as plain data, and a file
someone replaced (a pickle, a forged header, a type the reader did not name) is refused by name
without running anything."""

from __future__ import annotations

import ast
import json
import pickle
import struct
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from zerosim.files import datafile
from zerosim.files.datafile import DataFileError


@dataclass
class Item:
    name: str
    values: np.ndarray
    shards: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Frozen:
    sent: Fraction
    extra: Any = None


def _same(a: Any, b: Any) -> bool:
    """Equal in value, type and (for arrays) dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return b != b
    if isinstance(a, (Item, Frozen)):
        return all(_same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return bool(a == b)


def test_a_tree_of_arrays_dataclasses_and_numbers_comes_back_bitwise(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    value = {
        "world": 3,
        "steps": {1: [Item("a", rng.standard_normal((2, 3)), {"w": [(0, 4), (4, 6)]})],
                  2: [Item("b", np.float32(rng.standard_normal()) * np.ones(5, np.float32)[::2])]},
        "scalars": [np.float64(0.1), np.float32(1.5), np.int64(-7), np.bool_(True), np.array(2.0)],
        "floats": [0.1, float("nan"), float("inf"), -0.0, 1e308],
        "frozen": Frozen(Fraction(10**30, 3), extra=("x", None, False)),
        "$odd key": {"nested": []},
        "empty": np.zeros((0, 4), np.float16),
        "big_endian": np.arange(3, dtype=">f8"),
        "bf16": np.array([1.5, -2.0, 3e38], dtype=ml_dtypes.bfloat16),
        "fp8": np.array([0.5, -448.0], dtype=ml_dtypes.float8_e4m3fn),
    }
    path = tmp_path / "run.safetensors"
    datafile.save(path, value)
    back = datafile.load(path, types=(Item, Frozen))
    expected = dict(value, big_endian=np.arange(3, dtype="<f8"))
    assert _same(back, expected)
    assert back["scalars"][4].shape == ()  # a 0-d array stays 0-d
    assert [p.name for p in tmp_path.iterdir()] == ["run.safetensors"]  # no temporary file left


def test_the_file_is_safetensors_with_the_tree_in_its_metadata(tmp_path: Path) -> None:
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    datafile.save(path, {"w": np.arange(6.0).reshape(2, 3), "n": 4})
    tensors = safetensors_numpy.load_file(str(path))
    assert tensors["a0"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    assert json.loads(header["__metadata__"]["tree"]) == {"w": {"$array": 0}, "n": 4}


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "the pickle ran"))


def test_a_pickle_put_in_its_place_is_refused_and_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = tmp_path / "first-run.safetensors"
    path.write_bytes(pickle.dumps({"world": _RunsCode(marker)}))
    with pytest.raises(DataFileError, match="first-run.safetensors"):
        datafile.load(path, types=(Item,))
    assert not marker.exists()


def test_a_type_the_reader_did_not_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    datafile.save(path, [Frozen(Fraction(1, 2))])
    with pytest.raises(DataFileError, match=r"holds a 'Frozen', which its reader does not accept"):
        datafile.load(path, types=(Item,))
    assert datafile.load(path, types=(Frozen,)) == [Frozen(Fraction(1, 2))]


@pytest.mark.parametrize(
    ("forge", "message"),
    [
        (lambda h, d: (h, d[:-8]), "does not match its bytes"),  # tensor bytes cut short
        (lambda h, d: ({**h, "a0": {**h["a0"], "shape": [10**12]}}, d), "does not match its bytes"),
        (lambda h, d: ({**h, "a0": {**h["a0"], "dtype": "PY_OBJECT"}}, d), "missing or malformed"),
        (lambda h, d: ({**h, "__metadata__": {"tree": '{"$array": 7}'}}, d), "refers to array 7"),
        (lambda h, d: ({**h, "__metadata__": {"tree": '{"$eval": "1"}'}}, d), "unknown entry"),
        (lambda h, d: ({**h, "__metadata__": {"tree": "[" * 100000 + "]" * 100000}}, d), "not a zerosim"),
        (lambda h, d: ({"a0": h["a0"]}, d), "not a zerosim data file"),
    ],
)
def test_a_forged_file_is_refused_with_one_line(tmp_path: Path, forge: Any, message: str) -> None:
    path = tmp_path / "x.safetensors"
    datafile.save(path, {"w": np.arange(4.0)})
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header, data = forge(json.loads(raw[8 : 8 + size]), raw[8 + size :])
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    with pytest.raises(DataFileError, match=message) as info:
        datafile.load(path)
    assert "\n" not in str(info.value)


def test_a_header_length_beyond_the_file_and_a_missing_file_are_named(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 2**60) + b"{}")
    with pytest.raises(DataFileError, match="does not fit the file"):
        datafile.load(path)
    with pytest.raises(DataFileError, match="cannot read"):
        datafile.load(tmp_path / "missing.safetensors")


def _unsafe_reads(tree: ast.AST) -> list[str]:
    """Calls that can run code from the file they read: pickle loads, torch.load without
    ``weights_only=True``, numpy loads with ``allow_pickle=True``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
        if name.split(".")[-1] in ("load", "loads", "Unpickler") and name.split(".")[0] in (
                "pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"):
            found.append(name)
        elif name == "torch.load" and keywords.get("weights_only") != "True":
            found.append(name)
        elif name in ("np.load", "numpy.load") and keywords.get("allow_pickle") not in (None, "False"):
            found.append(name)
    return found


def test_the_checker_of_unsafe_reads_sees_each_kind() -> None:
    code = ("pickle.load(f)\npickle.loads(b)\ntorch.load(p)\ntorch.load(p, weights_only=False)\n"
            "np.load(p, allow_pickle=True)\ntorch.load(p, weights_only=True)\nnp.load(p)\njson.load(f)\n")
    assert _unsafe_reads(ast.parse(code)) == ["pickle.load", "pickle.loads", "torch.load", "torch.load",
                                              "np.load"]


def test_nothing_in_the_project_unpickles_what_it_reads() -> None:
    root = Path(__file__).resolve().parents[1]
    offenders = {}
    for package in ("zerosim", "zerogpu", "tests", "examples"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == Path(__file__).name:
                continue  # this file holds the checker's own examples as text only
            found = _unsafe_reads(ast.parse(path.read_text()))
            if found:
                offenders[str(path.relative_to(root))] = found
    assert offenders == {}
