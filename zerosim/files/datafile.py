"""Plain data to and from one safetensors file, so that reading a file back never runs code.

What one process leaves for another (the first launch of a resumed ``zerosim verify`` for the second,
a launched worker for the command that started it, ``--save-observations``) is a tree of dicts,
lists, tuples, numbers, strings, fractions, numpy arrays and the dataclasses the reader names. It is
written as a safetensors file (an 8-byte header length, a JSON header, raw little-endian tensor
bytes): every array becomes a tensor ``a<i>``, and the tree itself, with each array replaced by its
index, is JSON in the header's ``__metadata__`` under ``"tree"``.

Reading parses JSON and copies bytes; a dataclass is rebuilt only when its name is one of the types
the reader passes (:func:`load`'s ``types``), anything else in the file is refused with a
:class:`DataFileError` naming the file. Unlike pickle, a file someone replaced can at worst hold
wrong values, never make the reader execute anything. Files are written to a temporary name in the
same folder and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterable
from fractions import Fraction
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ..errors import ZeroSimError

#: safetensors dtype names <-> numpy dtypes (little-endian; bfloat16 and float8 as ml_dtypes defines them)
DTYPES: dict[str, np.dtype] = {
    **{k: np.dtype(v) for k, v in {
        "F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
        "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?",
    }.items()},
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAME_OF = {v: k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 256 << 20  # the tree of a 1,000-step verify run is a few MB; a bigger header is not ours


class DataFileError(ZeroSimError):
    """A data file is missing, unreadable, not in this format, or holds something its reader did not allow."""


def _encode(value: Any, arrays: list[np.ndarray]) -> Any:
    """The JSON form of ``value``; arrays are appended to ``arrays`` and referenced by index."""
    if isinstance(value, np.generic):  # before float: np.float64 is a float too
        arrays.append(np.asarray(value))
        return {"$scalar": len(arrays) - 1}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):  # bool is handled above
        return value
    if isinstance(value, float):
        return value if np.isfinite(value) else {"$float": repr(value)}
    if isinstance(value, Fraction):
        return {"$fraction": [str(value.numerator), str(value.denominator)]}
    if isinstance(value, np.ndarray):
        if np.dtype(value.dtype).newbyteorder("<") not in _NAME_OF:
            raise TypeError(f"cannot store an array of dtype {value.dtype}")
        arrays.append(value)
        return {"$array": len(arrays) - 1}
    if isinstance(value, tuple):
        return {"$tuple": [_encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, arrays) for k, v in value.items()}
        return {"$items": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _encode(getattr(value, f.name), arrays) for f in dataclasses.fields(value)}
        return {"$type": type(value).__name__, "fields": fields}
    raise TypeError(f"cannot store a {type(value).__name__}")


def save(path: str | Path, value: Any) -> None:
    """Write ``value`` (see the module docstring for what it may hold) to ``path``, atomically."""
    arrays: list[np.ndarray] = []
    tree = json.dumps(_encode(value, arrays), separators=(",", ":"))
    header: dict[str, Any] = {"__metadata__": {"tree": tree}}
    chunks: list[bytes] = []
    offset = 0
    for i, array in enumerate(arrays):
        little = np.asarray(array, dtype=np.dtype(array.dtype).newbyteorder("<"))  # keeps a 0-d shape
        data = little.tobytes(order="C")
        header[f"a{i}"] = {
            "dtype": _NAME_OF[little.dtype],
            "shape": list(little.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the tensor bytes to 8
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for data in chunks:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Decoder:
    def __init__(self, path: Path, arrays: list[np.ndarray], types: dict[str, type]):
        self.path = path
        self.arrays = arrays
        self.types = types

    def fail(self, what: str) -> DataFileError:
        return DataFileError(f"{self.path}: {what}")

    def array(self, index: Any) -> np.ndarray:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.arrays):
            raise self.fail(f"refers to array {index!r}, which the file does not hold")
        return self.arrays[index]

    def decode(self, node: Any) -> Any:
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, list):
            return [self.decode(v) for v in node]
        if not isinstance(node, dict):
            raise self.fail(f"holds a {type(node).__name__}")
        tags = [k for k in node if k.startswith("$")]
        if not tags:
            return {k: self.decode(v) for k, v in node.items()}
        tag = tags[0]
        body = node[tag]
        if tag == "$array":
            return self.array(body)
        if tag == "$scalar":
            return self.array(body)[()]
        if tag == "$float" and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag == "$fraction" and isinstance(body, list) and len(body) == 2:
            try:
                return Fraction(int(body[0]), int(body[1]))
            except (TypeError, ValueError, ZeroDivisionError):
                raise self.fail(f"holds a malformed fraction {body!r}") from None
        if tag == "$tuple" and isinstance(body, list):
            return tuple(self.decode(v) for v in body)
        if tag == "$items" and isinstance(body, list):
            out = {}
            for item in body:
                if not isinstance(item, list) or len(item) != 2:
                    raise self.fail("holds a malformed mapping")
                key = self.decode(item[0])
                try:
                    out[key] = self.decode(item[1])
                except TypeError:  # an unhashable key
                    raise self.fail(f"holds a mapping key of type {type(key).__name__}") from None
            return out
        if tag == "$type":
            return self.dataclass(node)
        raise self.fail(f"holds an unknown entry {tag!r}")

    def dataclass(self, node: dict[str, Any]) -> Any:
        name, fields = node.get("$type"), node.get("fields")
        cls = self.types.get(name) if isinstance(name, str) else None
        if cls is None:
            raise self.fail(f"holds a {name!r}, which its reader does not accept")
        declared = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != set(declared):
            raise self.fail(f"holds a {name} whose fields are not {sorted(declared)}")
        values = {k: self.decode(v) for k, v in fields.items()}
        obj = cls(**{k: v for k, v in values.items() if declared[k].init})
        for k, v in values.items():
            if not declared[k].init:
                object.__setattr__(obj, k, v)
        return obj


def _read_arrays(path: Path, blob: bytearray) -> tuple[dict[str, Any], list[np.ndarray]]:
    if len(blob) < 8:
        raise DataFileError(f"{path}: too short for a safetensors header")
    (size,) = struct.unpack("<Q", bytes(blob[:8]))
    if size > min(MAX_HEADER_BYTES, len(blob) - 8):
        raise DataFileError(f"{path}: header length {size} does not fit the file ({len(blob)} bytes)")
    try:
        header = json.loads(bytes(blob[8 : 8 + size]))
        tree = json.loads(header["__metadata__"]["tree"])
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise DataFileError(f"{path}: not a zerosim data file ({type(e).__name__})") from None
    data = memoryview(blob)[8 + size :]
    arrays: list[np.ndarray] = []
    for i in range(len(header) - 1):
        entry = header.get(f"a{i}")
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            start, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DataFileError(f"{path}: tensor a{i} is missing or malformed") from None
        count = int(np.prod(shape, dtype=object)) if shape else 1
        fits = 0 <= start <= stop <= len(data) and stop - start == count * dtype.itemsize
        if min(shape, default=0) < 0 or not fits:
            what = f"{entry['dtype']} {list(shape)}"
            raise DataFileError(f"{path}: tensor a{i} ({what}) does not match its bytes")
        arrays.append(np.frombuffer(data[start:stop], dtype=dtype).reshape(shape))
    return tree, arrays


def _by_name(types: Iterable[type]) -> dict[str, type]:
    named: dict[str, type] = {}
    for t in types:
        if named.setdefault(t.__name__, t) is not t:
            raise ValueError(f"two types named {t.__name__} cannot be told apart in a data file")
    return named


def load(path: str | Path, types: Iterable[type] = ()) -> Any:
    """The value :func:`save` wrote to ``path``; dataclasses only of ``types`` (DataFileError otherwise)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            blob = bytearray(f.read())
    except OSError as e:
        raise DataFileError(f"{path}: cannot read ({e.strerror or e})") from None
    tree, arrays = _read_arrays(path, blob)
    try:
        return _Decoder(path, arrays, _by_name(types)).decode(tree)
    except RecursionError:
        raise DataFileError(f"{path}: nested too deeply") from None
