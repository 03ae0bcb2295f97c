"""What the value contracts share to name a mismatch: the step contracts' collector, the first run of
differing elements, their global range and tensor, and bitwise comparison (-0.0 vs 0.0 and NaN payloads
count as different). Used by C-ZERO-002 (:mod:`zerosim.checks.equivalence`), C-ZERO-003
(:mod:`zerosim.checks.identity`), C-ZERO-001 on owned ranges (:mod:`zerosim.checks.partition_ranges`),
C-ZERO-004 (:mod:`zerosim.checks.holdings`) and C-ZERO-005 (:mod:`zerosim.checks.traffic`), so their
violations read alike.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np

from ..values.layout import ParamLayout
from ..values.observe import ShardValues
from ..values.verdict import Verdict
from .collect import ViolationCollector

MAX_PER_CLAUSE = 8

def step_clauses(contract: str, context: dict[str, Any] | None = None) -> ViolationCollector:
    """The collector of a step contract: at most MAX_PER_CLAUSE violations kept per clause."""
    return ViolationCollector(contract, context, per_clause=MAX_PER_CLAUSE)


def step_verdict(col: ViolationCollector, **details: Any) -> Verdict:
    """The collected verdict; the findings not kept are counted per clause in ``violations_not_listed``."""
    hidden = col.not_listed_by_clause()
    if hidden:
        details["violations_not_listed"] = hidden
    return col.verdict(**details)


def tensor_at(layout: ParamLayout | None, index: int) -> tuple[str | None, int]:
    """(tensor name, offset of the tensor) of a global flat index."""
    if layout is None or not layout.tensors:
        return None, 0
    offsets = layout.offsets
    i = max(bisect.bisect_right(offsets, index) - 1, 0)
    return layout.tensors[i].name, offsets[i]


def first_run(mask: np.ndarray) -> tuple[int, int]:
    """[start, end) of the first run of True values in ``mask``."""
    start = int(np.argmax(mask))
    rest = mask[start:]
    stop = int(np.argmin(rest)) if not rest.all() else len(rest)
    return start, start + stop


def values_at(sv: ShardValues) -> tuple[np.ndarray, np.ndarray]:
    """(global indices, values) of the real elements of a shard, in storage order."""
    idx = [np.arange(g0, g1, dtype=np.int64) for g0, g1, _ in sv.pieces]
    vals = [sv.values[pos:pos + g1 - g0] for g0, g1, pos in sv.pieces]
    if not idx:
        return np.zeros(0, dtype=np.int64), sv.values[:0]
    return np.concatenate(idx), np.concatenate(vals)


def element_bytes(a: np.ndarray) -> np.ndarray:
    """Each element's bytes as a row of a 1-D array (-0.0 vs 0.0 and NaN payloads differ)."""
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1) if a.size else a.view(np.uint8)


def same_bytes(got: np.ndarray, exp: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes (one comparison of their elements
    as unsigned integers of the same width; -0.0 vs 0.0 and NaN payloads differ)."""
    size = got.dtype.itemsize
    if size not in (1, 2, 4, 8):
        return bool(np.array_equal(element_bytes(got), element_bytes(exp)))
    view = np.dtype(f"u{size}")
    return bool(np.array_equal(np.ascontiguousarray(got).view(view), np.ascontiguousarray(exp).view(view)))


def bitwise_diff(got: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """Mask of elements whose bytes differ (so -0.0 vs 0.0 and NaN payloads count)."""
    if got.dtype != exp.dtype:
        return np.ones(got.shape[0], dtype=bool)
    if got.shape == exp.shape and same_bytes(got, exp):  # the common case, in one comparison
        return np.zeros(got.shape[0], dtype=bool)
    g, e = element_bytes(got), element_bytes(exp)
    return (g != e).any(axis=1) if g.ndim == 2 else g != e


def describe_mismatch(layout: ParamLayout | None, idx: np.ndarray, mask: np.ndarray, got: np.ndarray,
                      exp: np.ndarray) -> tuple[str | None, tuple[int, int], Any, Any, str]:
    """(tensor, global interval, expected, got, message) of the first run of differing elements: the
    run is cut where the global indices stop being consecutive or the tensor changes."""
    a, b = first_run(mask)
    g0 = int(idx[a])
    tensor, toff = tensor_at(layout, g0)
    # the run may cross tensors or pieces: cut it where the global indices stop being consecutive
    end = a + 1
    while end < b and idx[end] == idx[end - 1] + 1 and tensor_at(layout, int(idx[end]))[0] == tensor:
        end += 1
    interval = (g0, int(idx[end - 1]) + 1)
    diff = np.abs(got[mask].astype(np.float64) - exp[mask].astype(np.float64))
    with np.errstate(invalid="ignore"):
        maxdiff = float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else float("nan")
    where = f" (elements [{interval[0] - toff}, {interval[1] - toff}) of the tensor)" if tensor else ""
    msg = f"{int(mask.sum())} of {mask.size} elements differ{where}; max |diff| {maxdiff:.3g}"
    return tensor, interval, float(exp[a]), float(got[a]), msg




def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Every maximal [start, stop) run of True in a 1-D boolean mask."""
    padded = np.concatenate([[False], mask.astype(bool), [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
