"""A flat unit on the wire: packing gradients for a reduce-scatter, unpacking an all-gather.

A unit's elements live in two orders. *Unit space* is the unit's tensors one after another (what a
block computes with). *Packed space* is rank-major: shard-group rank ``j``'s owned pieces of the
unit, in its shard order, then padding, ``chunk`` elements per rank (what a reduce-scatter splits and
an all-gather returns). These functions move between the two for every driver of the engine (the
block model's schedule in :mod:`zerosim.engine.zero`, the autograd hooks of
:mod:`zerogpu.module_engine`), with arrays touched only through the ``xp`` seam. They serve
C-ZERO-002 (each element reduced and stepped by its owner, padding never leaking: it is written
with ``pad``) and C-ZERO-003 (an all-gather unpacked to the same full parameters on every rank).
"""

from __future__ import annotations

from typing import Any

from ..flat_buffers import FlatUnit
from ..xp import ArrayNamespace


def pack_grads(xp: ArrayNamespace, unit: FlatUnit, grads: dict[str, Any], dtype: str, pad: float) -> Any:
    """The unit's gradients, cast to ``dtype``, in packed order with padding ``pad`` (a new array): one
    copy per (rank, tensor) piece, padding written once, nothing else written twice."""
    packed = xp.empty(unit.packed_numel, dtype)
    flat = [xp.reshape(grads[name], (-1,)) for name in unit.tensor_names]
    if xp.backend == "numpy" and unit.short_pieces:
        # padding everywhere, then one fancy-indexed copy of the owned elements, instead of a
        # copy per (rank, tensor) piece and per padding run
        unit_pos, packed_pos = unit.pack_indices(xp)
        xp.assign(packed, pad)
        packed[packed_pos] = xp.concat(flat)[unit_pos]
        return packed
    for start, length in unit.padding_runs:
        xp.assign(packed[start:start + length], pad)
    for t, t_start, p_start, length in unit.tensor_pieces:
        xp.assign(packed[p_start:p_start + length], flat[t][t_start:t_start + length])
    return packed


def unpack(xp: ArrayNamespace, unit: FlatUnit, packed: Any, dtype: str) -> Any:
    """Unit space from an all-gathered packed buffer: a view (identity packing) or a new ``dtype`` array."""
    if unit.is_identity:
        return packed[:unit.numel]
    flat = xp.empty(unit.numel, dtype)
    unpack_into(xp, flat, packed, unit)
    return flat


def unpack_into(xp: ArrayNamespace, dst: Any, packed: Any, unit: FlatUnit) -> None:
    """Write an all-gathered packed buffer into ``dst`` in unit space (padding dropped)."""
    if unit.is_identity:
        xp.assign(dst, packed[:unit.numel])
        return
    if xp.backend == "numpy" and unit.short_pieces:
        # one fancy-indexed copy instead of a copy per (rank, segment)
        unit_pos, packed_pos = unit.pack_indices(xp)
        dst[unit_pos] = packed[packed_pos]
        return
    for segs in unit.segments:
        for s in segs:
            xp.assign(dst[s.unit_start:s.unit_start + s.length],
                      packed[s.packed_start:s.packed_start + s.length])


def tensor_views(xp: ArrayNamespace, unit: FlatUnit, flat: Any) -> dict[str, Any]:
    """Each tensor of the unit as a view of its unit-space array, in its own shape."""
    out = {}
    for name, off, shape in zip(unit.tensor_names, unit.tensor_offsets, unit.tensor_shapes, strict=True):
        n = 1
        for d in shape:
            n *= d
        out[name] = xp.reshape(flat[off:off + n], shape)
    return out
