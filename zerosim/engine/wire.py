"""A flat unit on the wire: pack, reduce-scatter, accumulate, all-gather, unpack, norm, clip, step.

A unit's elements live in two orders. *Unit space* is the unit's tensors one after another (what a
block computes with). *Packed space* is rank-major: shard-group rank ``j``'s owned pieces of the
unit, in its shard order, then padding, ``chunk`` elements per rank (what a reduce-scatter splits and
an all-gather returns). These functions move between the two for every driver of the engine (the
block model's schedule in :mod:`zerosim.engine.block_schedule`, the autograd hooks of
:mod:`zerogpu.module_engine`), with arrays touched only through the ``xp`` seam. They serve
C-ZERO-002 (each element reduced and stepped by its owner, padding never leaking: it is written
with ``pad``) and C-ZERO-003 (an all-gather unpacked to the same full parameters on every rank).

The collective steps are functions over a flat unit and a :class:`~zerosim.comm.base.Communicator`
(in the spirit of FSDP2's ``foreach_all_gather`` / ``foreach_reduce``): the averaging reduce-scatter
of a packed gradient and its accumulation into the rank's gradient shard, the all-reduce variants of
NO_SHARD, ZeRO-1 and the hybrid replicate group, the all-gather of a unit's chunks, the global norm
over owned elements (one scalar all-reduce over the shard group), clipping and the optimizer step on
the owned shard. The step functions (:mod:`zerosim.engine.gradients`, :mod:`zerosim.engine.step`)
decide which to call when and where a fault corrupts one; these functions hold no state.
"""

from __future__ import annotations

from typing import Any

from ..comm.base import Communicator
from ..numerics.optim import apply_clip_, clip_coefficient, global_norm_from_sumsq
from ..numerics.xp import ArrayNamespace
from ..values.flat_buffers import FlatUnit, UnitPlan


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


# ---- collectives over a unit ------------------------------------------------------------------------

def all_gather_unit(xp: ArrayNamespace, comm: Communicator, unit: FlatUnit, packed: Any,
                    dtype: str) -> Any:
    """Unit space of an all-gathered packed buffer (:func:`unpack`); a communicator that shares one
    result among its ranks (the simulator's ``derived``) unpacks it once for all of them."""
    derived = getattr(comm, "derived", None)
    if callable(derived) and not unit.is_identity:
        return derived(packed, ("unpacked", unit.index, dtype), lambda: unpack(xp, unit, packed, dtype))
    return unpack(xp, unit, packed, dtype)


def reduce_scatter_grads(comm: Communicator, packed: Any, op: str, *, donate: bool = True) -> Any:
    """This rank's reduced chunk of a packed gradient (C-ZERO-002: ``op`` is the average over the
    group). ``donate``: nothing reads ``packed`` afterwards, the communicator may use it as scratch."""
    return comm.reduce_scatter(packed, op, donate=donate) if donate else comm.reduce_scatter(packed, op)


def accumulate_chunk(xp: ArrayNamespace, grad_shard: Any, offset: int, part: Any, first: bool) -> None:
    """Add a unit's reduced chunk into the gradient shard at ``offset`` (the first micro-batch writes)."""
    view = grad_shard[offset:offset + int(part.shape[0])]
    if first:
        xp.assign(view, part)
    else:
        view += part


def all_reduce_grads(comm: Communicator, grads: Any, op: str) -> Any:
    """The full gradient averaged over ``comm`` (NO_SHARD, all-reduce ZeRO-1, the hybrid replicate
    group); a group of one rank already holds the average."""
    return comm.all_reduce(grads, op) if comm.world_size > 1 else grads


# ---- the rank's shard -------------------------------------------------------------------------------

def owned_sumsq(xp: ArrayNamespace, grad_shard: Any, plan: UnitPlan, local: int) -> float:
    """Sum of squares of the gradient elements shard-group rank ``local`` owns (padding excluded)."""
    total = 0.0
    for unit, off in zip(plan.units, plan.shard_offsets, strict=True):
        total += xp.sum_of_squares(grad_shard[off:off + unit.owned_numel(local)])
    return total


def all_reduce_sumsq(xp: ArrayNamespace, group: Communicator, local: float) -> float:
    """The sum over ``group`` of every rank's float64 sum of squares (one scalar all-reduce)."""
    x = xp.asarray([local], dtype=xp.dtype("float64"), device=xp.device)
    return xp.to_float(group.all_reduce(x, "sum")[0])


def clip_(xp: ArrayNamespace, grad: Any, sumsq: float, max_norm: float | None,
          dtype: str) -> tuple[float, float]:
    """Clip ``grad`` in place to the global norm ``max_norm`` given the global sum of squares (torch's
    ``clip_grad_norm_`` arithmetic); returns ``(norm, coefficient)``, 1.0 when nothing is clipped."""
    norm = global_norm_from_sumsq(sumsq)
    coef = 1.0
    if max_norm is not None:
        coef = clip_coefficient(norm, max_norm, dtype)
        apply_clip_(grad, coef, xp)
    return norm, coef


def optimizer_step(optimizer: Any, master: Any, grad: Any, state: dict[str, Any]) -> None:
    """The optimizer's full step on the owned master shard only (C-ZERO-002)."""
    optimizer.step(master, grad, state)


def padding_spans(pieces: tuple[tuple[int, int, int], ...], size: int) -> tuple[tuple[int, int], ...]:
    """The positions of a ``size``-element packed chunk that none of its owned ``(g0, g1, pos)`` pieces
    covers (the padding), as ``(start, stop)`` spans."""
    spans, at = [], 0
    for pos, length in sorted((pos, g1 - g0) for g0, g1, pos in pieces):
        if pos > at:
            spans.append((at, pos))
        at = max(at, pos + length)
    if at < size:
        spans.append((at, size))
    return tuple(spans)


def own_chunk(xp: ArrayNamespace, full: Any, pieces: tuple[tuple[int, int, int], ...],
              padding: tuple[tuple[int, int], ...], size: int, dtype: str) -> Any:
    """A rank's packed chunk of a full flat array: its owned pieces in shard order, zero padding."""
    out = xp.empty(size, dtype)
    for g0, g1, pos in pieces:
        xp.assign(out[pos:pos + g1 - g0], full[g0:g1])
    for p0, p1 in padding:
        xp.assign(out[p0:p1], xp.zeros(p1 - p0, dtype))
    return out


def assemble_full(xp: ArrayNamespace, gathered: Any, plan: UnitPlan, k: int, total: int, dtype: str,
                  chunk_index: Any = None) -> Any:
    """The full flat array from an all-gather of every shard-group rank's packed shard (padding
    dropped); ``chunk_index(j)`` says where rank ``j``'s shard sits (default: at ``j``)."""
    full = xp.zeros(total, dtype)
    size = plan.shard_numel
    for j in range(k):
        base = (j if chunk_index is None else chunk_index(j)) * size
        for g0, g1, pos in plan.owned_global(j):
            xp.assign(full[g0:g1], gathered[base + pos:base + pos + g1 - g0])
    return full
