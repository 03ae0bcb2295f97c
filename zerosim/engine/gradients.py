"""Gradients into one rank's state: accept a block's gradients, agree they are finite, reduce them.

Plain functions over :class:`~zerosim.engine.rank_state.RankState`, called by the schedule that runs
the micro-batches (the block model's, or the autograd hooks over a torch module) as backward produces
gradients (:func:`accept_grads`) and after each micro-batch (:func:`end_micro_batch`), and by
:func:`zerosim.engine.step.finish_step` after the last one. Per strategy (M micro-batches, ``k`` =
shard group size; :mod:`zerosim.cost.comm_model` predicts exactly this, C-ZERO-005):

* NO_SHARD: gradients accumulated locally; one ``all_reduce(avg)`` of the flat gradient over the
  world after the last micro-batch (:func:`reduce_full_grad`).
* SHARD_OPTIMIZER (ZeRO-1): the same all-reduce, as a sum, of a gradient kept in shard order
  (:mod:`zerosim.engine.grad_order`): each rank then divides only the range it owns, in place
  (:func:`owned_grad`: the same division, element for element, on 1/n of the elements), or with
  ``zero1_grad_reduce="reduce_scatter"``
  (DeepSpeed stage 1, the paper's P_os) one ``reduce_scatter(avg)`` of the packed full gradient into
  the rank's chunk after the last micro-batch.
* SHARD_GRAD_OP (ZeRO-2): after each micro-batch, ``reduce_scatter(avg)`` of the packed flat
  gradient, accumulated in the rank's gradient shard.
* FULL_SHARD (ZeRO-3): per micro-batch and block, ``reduce_scatter(avg)`` of the block's gradient.
* HYBRID_SHARD / HYBRID_SHARD_ZERO2: as ZeRO-3 / ZeRO-2 inside the shard group, then once per step
  an ``all_reduce(avg)`` of the gradient shard over the replicate group (:func:`replicate_reduce`).

Each reduction averages over its group; after the M micro-batches the accumulated gradient is
divided by M (:func:`finish_accumulation`). Non-finite gradients are detected before every
reduction: the ranks agree through one small ``all_reduce(max)`` of a per-rank flag on the
``world.control`` group and all raise :class:`~zerosim.errors.NonFiniteGradientError` naming the
first offending rank and tensor, so a NaN is never averaged into any rank's state.

Where the rank's fault acts (:meth:`RankState.corruption`), the function applies its corruption and
otherwise does what the reference engine does.
"""

from __future__ import annotations

from typing import Any

from ..errors import NonFiniteGradientError
from ..numerics.xp import divide_
from ..values.flat_buffers import FlatUnit
from . import finite_vote, wire
from .faults import Hook
from .rank_state import RankState

BEFORE_REDUCTION = "detected before the gradient reduction; no rank stepped with it"


def pack_grads(s: RankState, unit: FlatUnit, grads: dict[str, Any]) -> Any:
    """The unit's gradients in packed order, master dtype, padded with :func:`pad_value`."""
    return wire.pack_grads(s.xp, unit, grads, s.state_dtype, pad_value(s))


def grad_reduce_op(s: RankState) -> str:
    """The reduction of gradients across ranks: the mean (bug class 1: ``sum`` or a wrong divisor)."""
    return "sum" if s.corruption(Hook.GRAD_REDUCE_OP) else "avg"


def full_grad_reduce_op(s: RankState) -> str:
    """The op of the all-reduce of the full gradient (NO_SHARD, all-reduce ZeRO-1): the mean, or for
    all-reduce ZeRO-1 the sum, its division left to :func:`owned_grad`, since nothing reads the rest
    of the reduced gradient (bug class 1: no division)."""
    return "sum" if s.all_reduce_zero1 else grad_reduce_op(s)


def owned_grad(s: RankState, whole: bool = False) -> Any:
    """All-reduce ZeRO-1, after the all-reduce: this rank's owned elements of the reduced gradient,
    divided by the group size (C-ZERO-002: the mean, as an all-reduce ``avg`` gives it; bug class 1
    sums and so divides by nothing): a view of ``grad_acc``, whose shard order
    (:mod:`zerosim.engine.grad_order`) keeps them in one range, without the shard's trailing
    padding, divided in place (``whole``: the whole buffer is divided, every rank's range)."""
    n = s.comm.world_size
    divisor = n if grad_reduce_op(s) == "avg" and n > 1 else None
    lo, hi = s.grad_order.owned
    if divisor is not None:
        divide_(s.grad_acc if whole else s.grad_acc[lo:hi], divisor)
    return s.grad_acc[lo:hi]


def pad_value(s: RankState) -> float:
    """What packed gradient padding is filled with: zero (bug class 8: padding leaking into values)."""
    return 1.0 if s.corruption(Hook.PADDING) else 0.0


def check_finite(s: RankState, step: int, named: dict[str, Any], flat: Any | None = None) -> None:
    """Before a reduction: all ranks agree whether any rank holds a non-finite gradient."""
    agree_finite(s, step, first_nonfinite(s, named, flat), BEFORE_REDUCTION)


def first_nonfinite(s: RankState, named: dict[str, Any], flat: Any | None = None) -> int:
    """This rank's first non-finite gradient among ``named`` (layout index + 1; 0: none)."""
    return finite_vote.first_nonfinite(s.xp, s.layout, named, flat)


def first_nonfinite_accumulated(s: RankState, names: list[str],
                                runs: list[tuple[int, int]] | None = None) -> int:
    """This rank's non-finite gradient of lowest layout index among ``names`` in the full flat
    gradient ``grad_acc`` (NO_SHARD, ZeRO-1), wherever :attr:`RankState.grad_order` placed each one
    (layout index + 1; 0: none). ``runs``, the buffer ranges ``names`` occupy, are checked first, one
    pass each; only when one of them is not finite is each tensor searched."""
    xp, acc = s.xp, s.grad_acc
    if runs is not None and all(xp.isfinite_all(acc[lo:hi]) for lo, hi in runs):
        return 0
    bad = [finite_vote.tensor_index(s.layout, s.layout.aliases.get(name, name)) for name in names
           if not all(xp.isfinite_all(view) for view, _, _ in s.grad_order.views(acc, name))]
    return min(bad) + 1 if bad else 0


def agree_finite(s: RankState, step: int, bad: int, when: str) -> None:
    """All ranks agree whether any rank found a non-finite gradient (``bad``: layout index + 1, or
    0) with one scalar all-reduce (:mod:`zerosim.engine.finite_vote`). Raises
    :class:`NonFiniteGradientError` naming the lowest offending (rank, tensor)."""
    raise_if_flagged(s, step, s.control.all_reduce(finite_flag(s, bad), "max"), when)


def finite_flag(s: RankState, bad: int) -> Any:
    """This rank's vote for :func:`agree_finite`."""
    return finite_vote.vote(s.xp, bad, s.rank, s.comm.world_size, len(s.layout.tensors))


def raise_if_flagged(s: RankState, step: int, agreed: Any, when: str) -> None:
    """Raise :class:`NonFiniteGradientError` naming the (rank, tensor) the all-reduced vote encodes."""
    world, tensors = s.comm.world_size, len(s.layout.tensors)
    named = finite_vote.offender(s.xp.to_float(agreed[0]), world, tensors)
    if named is not None:
        raise NonFiniteGradientError(named[0], s.layout.tensors[named[1]].name, step, when)


def accept_grads(s: RankState, step: int, micro: int, block: str, grads: dict[str, Any],
                 defer: Any = None) -> None:
    """C-ZERO-002/005: where a block's fresh gradients go: reduce-scatter (ZeRO-3), the micro-batch
    buffer (ZeRO-2), or the local accumulator (NO_SHARD, ZeRO-1). ``defer(unit, grads, packed)``,
    when given, takes a ZeRO-3 unit's packed gradient instead of the finite vote and reduce-scatter
    here (a schedule that starts them and waits later)."""
    xp = s.xp
    grads = finite_vote.inject(xp, s.run.inject_nan, s.rank, step, micro, grads)
    if s.sharded_params:
        unit = s.unit_by_block[block]
        packed = pack_grads(s, unit, grads)
        s.tracker.alloc(f"gradbuf:{block}", "grad_buffers", xp.nbytes(packed))
        if defer is not None:
            defer(unit, grads, packed)
        else:
            check_finite(s, step, grads, packed)
            _reduce_scatter_into_acc(s, unit, packed, micro)
        s.tracker.free(f"gradbuf:{block}")
    elif s.sharded_grads:
        s.micro_grads.update(grads)
        s.tracker.alloc("gradbuf:micro", "grad_buffers",
                           sum(xp.nbytes(g) for g in s.micro_grads.values()))
    else:  # the full flat gradient, each tensor where grad_order places it
        for name, g in grads.items():
            flat = xp.reshape(g, (-1,))
            for view, a, b in s.grad_order.views(s.grad_acc, name):
                if micro == 0:
                    xp.assign(view, flat[a:b])
                else:
                    view += xp.astype(flat[a:b], s.state_dtype)


def reduce_full_grad(s: RankState, step: int) -> Any | None:
    """NO_SHARD / ZeRO-1, after the last micro-batch: every rank agrees the accumulated full gradient
    is finite, then it is averaged over the world (all-reduce, in ``grad_acc``), or reduce-scattered
    into this rank's chunk (``zero1_reduce_scatter``: the chunk is returned; otherwise None)."""
    names = [t.name for t in s.layout.tensors]
    whole = [(0, s.total)]
    agree_finite(s, step, first_nonfinite_accumulated(s, names, whole), BEFORE_REDUCTION)
    if s.zero1_reduce_scatter:
        return _reduce_scatter_full_grad(s)
    s.grad_acc = wire.all_reduce_grads(s.comm, s.grad_acc, full_grad_reduce_op(s))
    return None


def _reduce_scatter_into_acc(s: RankState, unit: FlatUnit, packed: Any, micro: int) -> None:
    """C-ZERO-005: reduce-scatter a unit's packed gradient into the rank's gradient shard."""
    assert s.shard_comm is not None
    # the packed buffer is read by nothing after this: the communicator may use it as scratch
    accumulate_chunk(s, unit, wire.reduce_scatter_grads(s.shard_comm, packed, grad_reduce_op(s)), micro)


def accumulate_chunk(s: RankState, unit: FlatUnit, part: Any, micro: int) -> None:
    """Add the unit's reduced gradient chunk into this rank's gradient shard (micro-batch 0: write)."""
    if s.offload:  # the reduced shard goes to the host accumulator right away
        s.moved["device_to_host"] += s.xp.nbytes(part)
    wire.accumulate_chunk(s.xp, s.grad_acc, s.units.shard_offsets[unit.index], part, micro == 0)


def _reduce_scatter_full_grad(s: RankState) -> Any:
    """ZeRO-1 with ``zero1_grad_reduce="reduce_scatter"`` (DeepSpeed stage 1, the paper's P_os): after
    the last micro-batch, ``reduce_scatter(avg)`` of the packed (padded) full gradient over the shard
    group into this rank's float32 chunk. The full accumulation buffer stays (ZeRO-1 shards only the
    optimizer state); the packed copy is transient, the chunk lives until the params are refreshed."""
    assert s.shard_comm is not None
    unit = s.units.units[0]
    named = {
        t.name: s.grad_acc[g0 : g0 + t.numel]
        for t, g0 in zip(s.layout.tensors, s.layout.offsets, strict=True)
    }
    packed = pack_grads(s, unit, named)
    s.tracker.alloc("gradbuf:packed", "grad_buffers", s.xp.nbytes(packed))
    part = wire.reduce_scatter_grads(s.shard_comm, packed, grad_reduce_op(s), donate=False)
    del packed
    s.tracker.alloc("grad_chunk", "grad_buffers", s.xp.nbytes(part))
    s.tracker.free("gradbuf:packed")
    return part


def end_micro_batch(s: RankState, step: int, micro: int) -> None:
    """C-ZERO-005: the end of micro-batch ``micro``; ZeRO-2 reduce-scatters the micro-batch's packed
    gradient into the gradient shard once every rank agreed it is finite (nothing for the others)."""
    if s.sharded_grads and not s.sharded_params:
        unit = s.units.units[0]
        packed = pack_grads(s, unit, s.micro_grads)
        s.tracker.alloc("gradbuf:packed", "grad_buffers", s.xp.nbytes(packed))
        check_finite(s, step, s.micro_grads, packed)
        s.micro_grads = {}
        s.tracker.free("gradbuf:micro")
        _reduce_scatter_into_acc(s, unit, packed, micro)
        s.tracker.free("gradbuf:packed")


def replicate_reduce(s: RankState, acc: Any) -> Any:
    """Hybrid: average the accumulated gradient shard over the replicate group (bug class 5 skips it;
    bug class 1's hybrid form sums it, leaving the divisor the shard group size)."""
    how = s.corruption(Hook.REPLICATE_REDUCE)
    if how == "skip":
        return acc
    assert s.replicate_comm is not None
    return s.replicate_comm.all_reduce(acc, "sum" if how == "sum" else grad_reduce_op(s))


def finish_accumulation(s: RankState, acc: Any) -> None:
    """Divide the accumulated gradient by the number of micro-batches (bug class 2 forgets)."""
    if s.run.micro_batches > 1 and not s.corruption(Hook.ACCUMULATION_AVERAGE):
        divide_(acc, s.run.micro_batches)
