"""The ranks' agreement that every gradient is finite before it is reduced, as functions of values.

Before a reduction each rank names its first non-finite gradient (layout index + 1, 0: none). One
scalar ``all_reduce(max)`` over the control group makes every rank agree: a rank's vote is
``span - key`` with ``key = rank * tensors + index`` and ``span`` one more than the number of keys,
so the maximum is the lowest offending (rank, tensor), exact in float64. Every rank then raises the
same :class:`~zerosim.errors.NonFiniteGradientError`, so a NaN is never averaged into any rank's state.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..numerics.xp import ArrayNamespace
from ..values.layout import ParamLayout


def tensor_index(layout: ParamLayout, name: str) -> int:
    """The layout index of tensor ``name``."""
    for i, t in enumerate(layout.tensors):
        if t.name == name:
            return i
    raise ConfigError("tensor", name, "no such tensor in the layout")


def first_nonfinite(xp: ArrayNamespace, layout: ParamLayout, named: dict[str, Any], flat: Any = None) -> int:
    """The first non-finite gradient among ``named``, as its layout index + 1 (0: none); ``flat``,
    when given, holds the same elements and is checked first in one pass."""
    if flat is not None and xp.isfinite_all(flat):
        return 0
    for name, g in named.items():
        if not xp.isfinite_all(g):
            return tensor_index(layout, name) + 1
    return 0


def vote_span(world_size: int, tensors: int) -> int:
    """One more than the number of (rank, tensor) keys a vote can name."""
    return world_size * tensors + 1


def vote(xp: ArrayNamespace, bad: int, rank: int, world_size: int, tensors: int) -> Any:
    """Rank ``rank``'s vote: ``span - key`` (0: all finite) in a one-element float64 array."""
    flag = xp.zeros(1, "float64")
    if bad:
        xp.assign(flag, float(vote_span(world_size, tensors) - (rank * tensors + bad - 1)))
    return flag


def offender(worst: float, world_size: int, tensors: int) -> tuple[int, int] | None:
    """The (rank, tensor index) the all-reduced maximum vote ``worst`` names; None when all finite."""
    if worst > 0:
        r, t = divmod(int(vote_span(world_size, tensors) - worst), tensors)
        return r, t
    return None


def inject(xp: ArrayNamespace, inj: Any, rank: int, step: int, micro: int,
           grads: dict[str, Any]) -> dict[str, Any]:
    """The gradients with the run's injected non-finite value (``inject_nan``) written into the first
    element of its tensor, when this rank, step and micro-batch are the injection's (a new dict)."""
    if inj is None or (inj.rank, inj.step, inj.micro) != (rank, step, micro) or inj.tensor not in grads:
        return grads
    g = xp.copy(grads[inj.tensor])
    xp.assign(xp.reshape(g, (-1,))[0:1], float(inj.value))  # "nan", "inf" or "-inf"
    return {**grads, inj.tensor: g}
