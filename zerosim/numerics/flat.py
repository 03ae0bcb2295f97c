"""Flat views of a model's tensors in :class:`~zerosim.values.layout.ParamLayout` order.

The engine keeps parameters, gradients and optimizer state as one flat 1-D buffer per kind (the
index space every partitioner shards); the model wants named tensors. ``flatten`` and ``unflatten``
convert between the two without changing any value, on any array namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import ConfigError
from ..values.layout import ParamLayout
from .xp import ArrayNamespace, get_namespace, namespace_of


def flatten(params: Mapping[str, Any], layout: ParamLayout, xp: ArrayNamespace | str | None = None) -> Any:
    """One new 1-D array: every tensor of ``layout`` in order, raveled (C order). Keeps the arrays'
    dtype (they must share one). ``xp`` defaults to the namespace of the first array."""
    if not layout.tensors:
        raise ConfigError("layout", layout.name, "has no tensors")
    first = _get(params, layout.tensors[0].name)
    ns = namespace_of(first) if xp is None else get_namespace(xp)
    parts = []
    for t in layout.tensors:
        a = ns.ensure(_get(params, t.name))
        if tuple(a.shape) != t.shape:
            raise ConfigError(t.name, tuple(a.shape), f"shape does not match the layout's {t.shape}")
        parts.append(ns.reshape(a, (-1,)))
    return ns.concat(parts)


def unflatten(flat: Any, layout: ParamLayout, names: Iterable[str] | None = None) -> dict[str, Any]:
    """Named views (no copy) into a flat array of exactly ``layout.total_numel`` elements (strip any
    partition padding first). ``names`` restricts the result to those tensors (e.g. one block's)."""
    ns = namespace_of(flat)
    if len(flat.shape) != 1 or flat.shape[0] != layout.total_numel:
        raise ConfigError("flat", tuple(flat.shape), f"expected a 1-D array of {layout.total_numel} elements")
    wanted = None if names is None else set(names)
    out: dict[str, Any] = {}
    for t, off in zip(layout.tensors, layout.offsets, strict=True):
        if wanted is None or t.name in wanted:
            out[t.name] = ns.reshape(flat[off:off + t.numel], t.shape)
    if wanted is not None and len(out) != len(wanted):
        missing = sorted(wanted - set(out))
        raise ConfigError("names", missing[0], "no such tensor in the layout")
    return out


def _get(params: Mapping[str, Any], name: str) -> Any:
    try:
        return params[name]
    except KeyError:
        raise ConfigError("params", name, "missing tensor (the layout has it, the dict does not)") from None
