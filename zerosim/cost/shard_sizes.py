"""How many elements each rank of a shard group stores, per partitioner, in closed form.

Ranks that store the same amount form one :class:`ShardClass`, so a 10^12-parameter model over
1024 ranks is O(tensors + classes), never O(ranks). :func:`shard_sizes` is exact for every
partitioner the package ships (the closed forms follow each partitioner's rule; any other
partitioner is measured from its plan).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..values.layout import ParamLayout


@dataclass(frozen=True)
class ShardClass:
    """``count`` local ranks of a shard group (listed in ``local_ranks`` as ``[start, end)`` runs)
    that each store ``stored_numel`` elements of a sharded state (real data + padding)."""

    stored_numel: int
    count: int
    local_ranks: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardSizes:
    """How one shard group of ``k`` ranks splits ``total`` elements: classes + total padding."""

    partitioner: str
    k: int
    total: int
    classes: tuple[ShardClass, ...]
    padding: int  # elements stored in the group beyond ``total``
    rule: str

    @property
    def max_stored(self) -> int:
        return max(c.stored_numel for c in self.classes)


def _runs(ranks: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return tuple((a, b) for a, b in out)


def _classes_from_sizes(sizes: Sequence[int]) -> tuple[ShardClass, ...]:
    by: dict[int, list[int]] = {}
    for r, s in enumerate(sizes):
        by.setdefault(s, []).append(r)
    return tuple(ShardClass(s, len(rs), _runs(rs)) for s, rs in sorted(by.items(), reverse=True))


def uniform_shard_sizes(partitioner: str, k: int, total: int, per: int, rule: str) -> ShardSizes:
    return ShardSizes(partitioner, k, total, (ShardClass(per, k, ((0, k),)),), per * k - total, rule)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ModelTensors:
    """What the closed forms need of a model: tensor numels, dim-0 sizes, block numels."""

    name: str
    numels: tuple[int, ...]
    dim0: tuple[int, ...]
    block_numels: tuple[int, ...]
    module_numels: tuple[int, ...]
    layout: ParamLayout | None

    @property
    def total(self) -> int:
        return sum(self.numels)


def model_tensors(layout_or_numel: ParamLayout | int | float) -> ModelTensors:
    if isinstance(layout_or_numel, ParamLayout):
        lay = layout_or_numel
        numels = tuple(t.numel for t in lay.tensors)
        dim0 = tuple(t.shape[0] if t.shape else 1 for t in lay.tensors)
        modules: dict[str, int] = {}
        for t in lay.tensors:  # DeepSpeed's "layer": one module's own params (weight + bias)
            mod = t.name.rsplit(".", 1)[0] if "." in t.name else t.name
            modules[mod] = modules.get(mod, 0) + t.numel
        return ModelTensors(lay.name, numels, dim0, tuple(lay.block_numel(b) for b in lay.blocks),
                        tuple(modules.values()), lay)
    n = parse_param_count(layout_or_numel)
    return ModelTensors(f"{n} params", (n,), (n,), (), (), None)


def parse_param_count(value: Any, field: str = "params") -> int:
    """A positive integer parameter count from ``7.5e9``, ``"7.5e9"``, ``"7.5B"``, ``124439808``."""
    if isinstance(value, bool):
        raise ConfigError(field, value, "must be a positive number of parameters")
    if isinstance(value, str):
        text = value.strip().replace("_", "").replace(",", "")
        scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}.get(text[-1:].lower(), 1)
        if scale != 1:
            text = text[:-1]
        try:
            exact = Decimal(text) * scale  # decimal, not float: 1e30 stays 10**30 exactly
        except InvalidOperation:
            raise ConfigError(field, value, "must be a number such as 7.5e9 or 7.5B") from None
        if not exact.is_finite() or exact != exact.to_integral_value():
            raise ConfigError(field, value, "must be a finite whole number of parameters")
        value = int(exact)
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise ConfigError(field, value, "must be a finite whole number of parameters")
        value = int(value)
    if not isinstance(value, int):
        raise ConfigError(field, value, "must be a positive number of parameters")
    if value <= 0:
        raise ConfigError(field, value, "must be positive")
    return value


def shard_sizes(model: ParamLayout | int | float, k: int, partitioner: str | None = None) -> ShardSizes:
    """Per-rank stored elements of one sharded state over a shard group of ``k`` ranks.

    Closed forms (documented with each partitioner in docs/references.md), O(tensors + classes):

    * ``None`` / ``"paper"``: the ZeRO paper's ``Psi / N_d`` (rounded up): one flat buffer padded to
      a multiple of ``k``, ``ceil(P/k)`` per rank. Also the reference engine's flat padding rule.
    * ``"seed"``: ``P // k`` per rank, the first ``P % k`` ranks one more; no padding.
    * ``"deepspeed"`` (stage 1/2): flat group padded to a multiple of ``2k``; ``padded / k`` each.
    * ``"deepspeed-zero3"``: every tensor padded to a multiple of ``k``: ``sum ceil(n_i / k)`` each.
    * ``"fsdp"``: torch.chunk on dim 0 per tensor, shards padded to chunk 0: ``sum ceil(d0/k)*rest``.
    * ``"zero-redundancy"``: whole tensors, sorted by size, each to the least-loaded rank (no padding).
    * any other registered name: the partitioner is run on the layout and its ShardPlan measured.
    """
    require_positive_int("k", k)
    t = model_tensors(model)
    P = t.total
    name = (partitioner or "paper").strip().lower().replace("_", "-")
    if k == 1:
        return uniform_shard_sizes(name, 1, P, P, "one rank holds everything")
    if name in ("paper", "flat", "even"):
        return uniform_shard_sizes(
            name, k, P, ceil_div(P, k), "one flat buffer padded to a multiple of k: ceil(P/k) per rank"
        )
    if name == "seed":
        base, rem = divmod(P, k)
        classes = [ShardClass(base + 1, rem, ((0, rem),))] if rem else []
        classes.append(ShardClass(base, k - rem, ((rem, k),)))
        return ShardSizes(
            name,
            k,
            P,
            tuple(c for c in classes if c.count),
            0,
            "P // k per rank, the first P % k ranks one more (entrenar OptimizerShard.for_rank)",
        )
    if name in ("deepspeed", "deepspeed-zero12"):
        padded = ceil_div(P, 2 * k) * 2 * k
        return uniform_shard_sizes(
            name, k, P, padded // k, "flat group padded to a multiple of 2k (DeepSpeed stage 1/2)"
        )
    if name == "deepspeed-zero3":
        per = sum(ceil_div(n, k) for n in t.numels)
        return uniform_shard_sizes(
            name, k, P, per, "each tensor padded to a multiple of k (DeepSpeed stage 3)"
        )
    if name in ("fsdp", "fsdp2"):
        per = sum(ceil_div(d0, k) * (n // d0) if d0 else 0 for n, d0 in zip(t.numels, t.dim0, strict=True))
        return uniform_shard_sizes(
            name, k, P, per, "torch.chunk on dim 0 per tensor, padded to chunk 0 (FSDP2)"
        )
    if name in ("zero-redundancy", "zero-redundancy-optimizer"):
        loads = [(0, r) for r in range(k)]
        heapq.heapify(loads)
        for n in sorted(t.numels, reverse=True):
            load, r = heapq.heappop(loads)
            heapq.heappush(loads, (load + n, r))
        sizes = [0] * k
        for load, r in loads:
            sizes[r] = load
        return ShardSizes(name, k, P, _classes_from_sizes(sizes), 0,
                          "whole tensors, largest first, to the least-loaded rank (ZeroRedundancyOptimizer)")
    return _measured_shard_sizes(t, k, partitioner or name)


def _measured_shard_sizes(t: ModelTensors, k: int, partitioner: str) -> ShardSizes:
    """A partitioner without a closed form here: run it on the layout and group its ranks."""
    from ..partition import get_partitioner

    fn = get_partitioner(partitioner)
    if t.layout is None:
        raise ConfigError(
            "partitioner", partitioner, "has no closed form here; pass a layout (--model), not a bare count"
        )
    plan = fn(t.layout, k)
    sizes = [s.padded_numel for s in plan.shards]
    return ShardSizes(partitioner, k, t.total, _classes_from_sizes(sizes), sum(sizes) - t.total,
                      f"measured from the {partitioner} partitioner's ShardPlan")
