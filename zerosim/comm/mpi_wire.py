"""Arrays on the MPI wire: which MPI datatype moves a numpy dtype, and how each (dtype, op) reduction runs.

Part of the MPI backend (:class:`zerosim.comm.mpi.MpiCommunicator` is its only user). Every lookup
here is worked out once per process and cached by ``id(dtype)`` (hashing a numpy dtype is slow on
the data path); a cached entry holds its dtype, so callers check ``entry.dtype is dtype``.

- ``sum`` is MPI's ``SUM`` in the buffer's dtype, ``avg`` that sum divided by the group size
  afterwards, ``max`` MPI's ``MAX``.
- ``bfloat16`` (ml_dtypes), ``float16`` and ``bool`` have no portable MPI reduction datatype: they
  are reduced as a ``float32`` copy and rounded back once.
- Anything moved without arithmetic (``all_gather``, ``broadcast``) goes as its own MPI datatype when
  MPI knows it, else as raw bits (an unsigned integer of the same size: bf16 as ``uint16``), exactly.

Importing this module imports mpi4py (a ConfigError with the install hint when it is missing); the
other MPI modules take ``MPI`` from here so that the hint is written once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

from ..errors import ConfigError, install_hint
from .base import REDUCE_OPS

try:
    from mpi4py import MPI
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ConfigError("backend", "mpi", f"needs mpi4py and an MPI library: {install_hint('mpi')}") from e

MPI_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX}

_BITS_BY_SIZE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
_VIA_FLOAT32 = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.bool_))
_REDUCE_PATH: dict[int, tuple[np.dtype, str]] = {}  # id(dtype) -> (dtype, path): np.dtype hashing is slow


def reduce_path(dtype: np.dtype) -> str:
    """``native``: MPI reduces this dtype itself; ``float32``: reduce a float32 copy, round back once;
    ``""``: cannot be reduced (still moved exactly by all_gather / broadcast)."""
    hit = _REDUCE_PATH.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    path = ""
    if dtype in _VIA_FLOAT32:
        path = "float32"
    elif dtype.kind in "iuf" and dtype.isnative:
        from mpi4py.util import dtlib

        try:
            dtlib.from_numpy_dtype(dtype)
            path = "native"
        except (TypeError, ValueError, KeyError):
            path = ""
    _REDUCE_PATH[id(dtype)] = (dtype, path)
    return path


class ReducePlan(NamedTuple):
    """How one (dtype, op) reduction runs, worked out once per process (the hot path only looks it up)."""

    dtype: np.dtype
    mpi_op: Any  # MPI.SUM / MPI.MAX
    native: bool  # MPI reduces the dtype itself (else: a float32 copy, rounded back once)
    divide: bool  # "avg": divide the sum by the group size afterwards
    mpi_type: Any  # the MPI datatype on the wire: the dtype's own, or MPI.FLOAT for the float32 copy


# op -> id(dtype) -> plan (two string / int lookups: cheaper than hashing a tuple or a dtype); the
# plan holds its dtype, so an id is never reused while cached; callers check ``plan.dtype is dtype``
REDUCE_PLANS: dict[str, dict[int, ReducePlan]] = {op: {} for op in MPI_OPS}
NO_PLANS: dict[int, ReducePlan] = {}  # what an unknown op looks up (always empty)


def reduce_plan(dtype: np.dtype, op: str) -> ReducePlan:
    """The :class:`ReducePlan` of reducing ``dtype`` with ``op``, cached; ConfigError for an op or dtype MPI
    cannot reduce. Callers look ``REDUCE_PLANS`` up first (and check ``plan.dtype is dtype``)."""
    if op not in MPI_OPS:
        raise ConfigError("op", op, f"unknown reduce op; known: {', '.join(REDUCE_OPS)}")
    if op == "avg" and dtype.kind not in "fV":
        raise ConfigError("op", op, f"avg needs a floating dtype, got {dtype}")
    path = reduce_path(dtype)
    if not path:
        raise ConfigError("dtype", str(dtype), f"cannot be reduced over MPI (op={op}); "
                          "supported: the float / int dtypes MPI knows, float16, bfloat16, bool")
    native = path == "native"
    plan = ReducePlan(dtype, MPI_OPS[op], native, op == "avg", wire_type(dtype) if native else MPI.FLOAT)
    REDUCE_PLANS[op][id(dtype)] = plan
    return plan


WIRE_TYPES: dict[int, tuple[np.dtype, Any]] = {}  # id(dtype) -> (dtype, MPI datatype): see wire_type


def wire_type(dtype: np.dtype) -> Any:
    """The MPI datatype that moves ``dtype`` exactly, cached: the dtype's own (``Datatype.fromcode``, the
    lookup mpi4py does for a plain array) when MPI knows it, else an unsigned integer of the same size
    (raw bits: bf16 as uint16), else bytes. Collectives pass ``(array, datatype)``, which spares mpi4py
    parsing the buffer's format on every call; the bytes on the wire are the same."""
    hit = WIRE_TYPES.get(id(dtype))
    if hit is not None and hit[0] is dtype:
        return hit[1]
    if dtype.hasobject:
        raise ConfigError("dtype", str(dtype), "object arrays cannot be sent over MPI")
    wire = MPI.BYTE
    if reduce_path(dtype) == "native":
        wire = MPI.Datatype.fromcode(dtype.char)
    elif dtype.itemsize in _BITS_BY_SIZE:
        wire = MPI.Datatype.fromcode(_BITS_BY_SIZE[dtype.itemsize].char)
    WIRE_TYPES[id(dtype)] = (dtype, wire)
    return wire


NDARRAY = np.ndarray  # the hot path's type check, one global lookup


def contiguous(x: Any) -> np.ndarray:
    """A C-contiguous ndarray of ``x`` (0-d stays 0-d; ``np.ascontiguousarray`` would make it 1-d)."""
    x = np.asarray(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)
