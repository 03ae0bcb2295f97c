"""Closed-form per-rank memory of model states: parameters, gradients, optimizer state; device vs host.

This is the cost side of C-ZERO-004 (the memory a backend really allocates is compared against it).
It is pure arithmetic on element counts: no arrays, no plans with per-rank intervals, so it answers
instantly for 10^12 parameters on 1024 ranks. Ranks that hold the same amount form one *rank class*
(e.g. "every rank stores ceil(P/k) elements"), so the work is O(tensors + classes), not O(ranks).

Two accountings, always named:

* **ZeRO paper** (Rajbhandari et al. 2020, sec. 3) for the persistent model states:
  ``(2 + 2 + K) * Psi`` for DDP with mixed-precision Adam, ``K = 12`` = fp32 master params (4) +
  Adam m (4) + v (4). With ``precision="mixed", optimizer="adamw"`` and the default (paper)
  partitioner, ``params + grads + optimizer_states`` here are exactly the paper's figures
  (7.5B params, N_d = 64: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB). Padding of the partitioner's shards
  costs what a real element costs.
* **Engine** (zerosim's reference engine, ``zerosim.engine``) for the transient buffers of a step,
  which the paper leaves out; see :func:`transient_phases`. ``peak = persistent + max(transient)``.

Per-element bytes come from :class:`MemorySettings`: ``params`` = the working (compute) copy,
``grads`` = the persistent gradient in its accumulation dtype, ``optimizer_states`` = K = fp32 master
copy (when the working copy is not fp32) + one buffer per optimizer state (Adam: m and v; SGD with
momentum: one buffer; plain SGD: none). When the params *are* the master (fp32) but ZeRO-1/2 keeps
them replicated while the optimizer steps a shard, a separate master shard is kept (as DeepSpeed's
stage-1/2 fp32 partition and the reference engine do): K grows by the param bytes for those two.

Activations, workspace and allocator fragmentation are not modelled (they depend on batch, sequence
length and kernels, not on the sharding strategy).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, require_non_negative_int
from ..layout import ParamLayout
from ..strategy import ShardingStrategy, StrategyKind, Topology
from .comm_model import ZERO1_GRAD_REDUCE

CATEGORIES = ("params", "grads", "optimizer_states")
PLACES = ("device", "host")


# ---------------------------------------------------------------------------------------------
# settings: precision, optimizer, offload, prefetch
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrecisionSpec:
    """Bytes per element of each kind of state under one precision recipe."""

    name: str
    param_bytes: int    # working copy used in forward/backward
    grad_bytes: int     # gradient (accumulation) dtype
    master_bytes: int   # separate fp32 master copy kept with the optimizer (0 when params are fp32)
    state_bytes: int    # bytes of each optimizer state buffer (Adam m, v; SGD momentum)
    description: str


PRECISIONS: dict[str, PrecisionSpec] = {
    "mixed": PrecisionSpec("mixed", 2, 2, 4, 4,
                           "ZeRO paper mixed precision: fp16 params and grads, fp32 master + fp32 optimizer states"),
    "bf16-mixed": PrecisionSpec("bf16-mixed", 2, 2, 4, 4,
                                "bf16 params and grads, fp32 master + fp32 optimizer states"),
    "bf16-fp32grads": PrecisionSpec("bf16-fp32grads", 2, 4, 4, 4,
                                    "bf16 params, fp32 gradient accumulation, fp32 master + fp32 optimizer states"),
    "fp16-fp32grads": PrecisionSpec("fp16-fp32grads", 2, 4, 4, 4,
                                    "fp16 params, fp32 gradient accumulation, fp32 master + fp32 optimizer states"),
    "fp32": PrecisionSpec("fp32", 4, 4, 0, 4, "everything fp32; the params are the master copy"),
    "bf16-pure": PrecisionSpec("bf16-pure", 2, 2, 0, 2, "pure bf16: params, grads and optimizer states bf16, no master"),
}
# "fp16" / "bf16" name the reference engine's policies (zerosim.precision): 16-bit params, fp32 grads
_PRECISION_ALIASES = {"paper": "mixed", "fp16-mixed": "mixed", "amp": "mixed", "bf16mixed": "bf16-mixed",
                      "bf16": "bf16-fp32grads", "fp16": "fp16-fp32grads", "bf16-fp32-grads": "bf16-fp32grads",
                      "fp16-fp32-grads": "fp16-fp32grads", "float32": "fp32", "pure-bf16": "bf16-pure"}

#: number of optimizer state buffers per parameter element
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
_OPTIMIZER_ALIASES = {"sgd_momentum": "sgd-momentum", "sgdm": "sgd-momentum", "momentum": "sgd-momentum"}

OFFLOAD_CHOICES = ("none", "optimizer", "grads+optimizer", "params+optimizer", "params+grads+optimizer")


#: the reference engine's precision policies (zerosim.precision.Precision) in this model's terms: the
#: engine keeps gradients in float32 (upcast before reduction) and a float32 master when mixed.
ENGINE_PRECISION = {"fp32": "fp32", "bf16": "bf16-fp32grads", "fp16": "fp16-fp32grads"}


def canonical_precision(name: str) -> str:
    key = str(name).strip().lower().replace("_", "-")
    key = _PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise ConfigError("precision", name, f"unknown precision; known: {', '.join(PRECISIONS)}")
    return key


def canonical_optimizer(name: str) -> str:
    key = str(name).strip().lower()
    key = _OPTIMIZER_ALIASES.get(key, key)
    if key not in OPTIMIZER_STATES:
        raise ConfigError("optimizer", name, f"unknown optimizer; known: {', '.join(OPTIMIZER_STATES)}")
    return key


def parse_offload(text: str | Iterable[str] | None) -> frozenset[str]:
    """``"none"`` | ``"optimizer"`` | ``"params+optimizer"`` | ``"all"`` ... -> the offloaded categories.

    ``optimizer`` means the optimizer state *and* the fp32 master copy (they live together).
    """
    if text is None:
        return frozenset()
    parts = text.replace(",", "+").split("+") if isinstance(text, str) else list(text)
    out: set[str] = set()
    for raw in parts:
        p = str(raw).strip().lower()
        if p in ("", "none"):
            continue
        if p == "all":
            out |= {"params", "grads", "optimizer_states"}
        elif p in ("optimizer", "optimizer_states", "optim", "opt"):
            out.add("optimizer_states")
        elif p in ("params", "param", "parameters"):
            out.add("params")
        elif p in ("grads", "grad", "gradients"):
            out.add("grads")
        else:
            raise ConfigError("offload", text, f"unknown part {raw!r}; use none, optimizer, grads, params joined by '+'")
    return frozenset(out)


def offload_name(parts: frozenset[str]) -> str:
    if not parts:
        return "none"
    order = [("params", "params"), ("grads", "grads"), ("optimizer_states", "optimizer")]
    return "+".join(label for key, label in order if key in parts)


@dataclass(frozen=True)
class MemorySettings:
    """Precision recipe, optimizer, what is offloaded to host memory, and the ZeRO-3 prefetch depth.

    ``grad_bucket_numel``: SHARD_GRAD_OP's transient unsharded gradient; ``None`` = the whole padded
    flat gradient (what the reference engine does).
    ``zero1_grad_reduce``: how ZeRO-1 averages gradients (the engine's ``RunConfig.zero1_grad_reduce``):
    ``"all_reduce"`` (torch ZeroRedundancyOptimizer, default) or ``"reduce_scatter"`` (DeepSpeed
    stage 1), which holds the packed full gradient and the reduced chunk at once (see
    :func:`transient_phases`).
    """

    precision: str = "mixed"
    optimizer: str = "adamw"
    offload: str = "none"
    prefetch_depth: int = 1
    grad_bucket_numel: int | None = None
    zero1_grad_reduce: str = "all_reduce"

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer))
        object.__setattr__(self, "offload", offload_name(parse_offload(self.offload)))
        require_non_negative_int("prefetch_depth", self.prefetch_depth)
        if self.grad_bucket_numel is not None:
            require_non_negative_int("grad_bucket_numel", self.grad_bucket_numel)
        if not isinstance(self.zero1_grad_reduce, str) or self.zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
            raise ConfigError("zero1_grad_reduce", self.zero1_grad_reduce,
                              f"known: {', '.join(ZERO1_GRAD_REDUCE)} (--zero1-reduce)")

    @property
    def spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def offloaded(self) -> frozenset[str]:
        return parse_offload(self.offload)

    @property
    def num_optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def K(self) -> int:  # noqa: N802 - the paper's name
        """Optimizer-state bytes per parameter (the ZeRO paper's K): master copy + state buffers."""
        return self.spec.master_bytes + self.num_optimizer_states * self.spec.state_bytes

    def optimizer_bytes(self, strategy: ShardingStrategy) -> int:
        """K for ``strategy``: plus a separate master copy when the params are the master (fp32) but
        cannot double as it: ZeRO-1/2 replicate the params while the optimizer steps a shard, and an
        offloaded optimizer steps on the host while the working params stay on the device."""
        extra = 0
        if self.spec.master_bytes == 0:
            split_by_sharding = strategy.shards_optimizer and not strategy.shards_params
            off = self.offloaded
            split_by_offload = "optimizer_states" in off and "params" not in off
            if split_by_sharding or split_by_offload:
                extra = self.spec.param_bytes
        return self.K + extra

    def bytes_per_element(self, strategy: ShardingStrategy | None = None) -> dict[str, int]:
        k = self.K if strategy is None else self.optimizer_bytes(strategy)
        return {"params": self.spec.param_bytes, "grads": self.spec.grad_bytes, "optimizer_states": k}

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "optimizer": self.optimizer, "offload": self.offload,
                "prefetch_depth": self.prefetch_depth, "grad_bucket_numel": self.grad_bucket_numel,
                "zero1_grad_reduce": self.zero1_grad_reduce,
                "K": self.K, "bytes_per_element": self.bytes_per_element(),
                "precision_description": self.spec.description}


# ---------------------------------------------------------------------------------------------
# shard sizes per partitioner, in closed form
# ---------------------------------------------------------------------------------------------
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


def _uniform(partitioner: str, k: int, total: int, per: int, rule: str) -> ShardSizes:
    return ShardSizes(partitioner, k, total, (ShardClass(per, k, ((0, k),)),), per * k - total, rule)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class _Tensors:
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


def _as_tensors(layout_or_numel: ParamLayout | int | float) -> _Tensors:
    if isinstance(layout_or_numel, ParamLayout):
        lay = layout_or_numel
        numels = tuple(t.numel for t in lay.tensors)
        dim0 = tuple(t.shape[0] if t.shape else 1 for t in lay.tensors)
        modules: dict[str, int] = {}
        for t in lay.tensors:  # DeepSpeed's "layer": one module's own params (weight + bias)
            mod = t.name.rsplit(".", 1)[0] if "." in t.name else t.name
            modules[mod] = modules.get(mod, 0) + t.numel
        return _Tensors(lay.name, numels, dim0, tuple(lay.block_numel(b) for b in lay.blocks),
                        tuple(modules.values()), lay)
    n = parse_param_count(layout_or_numel)
    return _Tensors(f"{n} params", (n,), (n,), (), (), None)


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
            num = float(text) * scale
        except ValueError:
            raise ConfigError(field, value, "must be a number such as 7.5e9 or 7.5B") from None
        value = num
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

    Closed forms (documented with each partitioner in REFERENCES.md), O(tensors + classes):

    * ``None`` / ``"paper"``: the ZeRO paper's ``Psi / N_d`` (rounded up): one flat buffer padded to
      a multiple of ``k``, ``ceil(P/k)`` per rank. Also the reference engine's flat padding rule.
    * ``"seed"``: ``P // k`` per rank, the first ``P % k`` ranks one more; no padding.
    * ``"deepspeed"`` (stage 1/2): flat group padded to a multiple of ``2k``; ``padded / k`` each.
    * ``"deepspeed-zero3"``: every tensor padded to a multiple of ``k``: ``sum ceil(n_i / k)`` each.
    * ``"fsdp"``: torch.chunk on dim 0 per tensor, shards padded to chunk 0: ``sum ceil(d0/k)*rest``.
    * ``"zero-redundancy"``: whole tensors, sorted by size, each to the least-loaded rank (no padding).
    * any other registered name: the partitioner is run on the layout and its ShardPlan measured.
    """
    t = _as_tensors(model)
    P = t.total
    name = (partitioner or "paper").strip().lower().replace("_", "-")
    if k == 1:
        return _uniform(name, 1, P, P, "one rank holds everything")
    if name in ("paper", "flat", "even"):
        return _uniform(name, k, P, _ceil(P, k), "one flat buffer padded to a multiple of k: ceil(P/k) per rank")
    if name == "seed":
        base, rem = divmod(P, k)
        classes = [ShardClass(base + 1, rem, ((0, rem),))] if rem else []
        classes.append(ShardClass(base, k - rem, ((rem, k),)))
        return ShardSizes(name, k, P, tuple(c for c in classes if c.count), 0,
                          "P // k per rank, the first P % k ranks one more (entrenar OptimizerShard.for_rank)")
    if name in ("deepspeed", "deepspeed-zero12"):
        padded = _ceil(P, 2 * k) * 2 * k
        return _uniform(name, k, P, padded // k, "flat group padded to a multiple of 2k (DeepSpeed stage 1/2)")
    if name == "deepspeed-zero3":
        per = sum(_ceil(n, k) for n in t.numels)
        return _uniform(name, k, P, per, "each tensor padded to a multiple of k (DeepSpeed stage 3)")
    if name in ("fsdp", "fsdp2"):
        per = sum(_ceil(d0, k) * (n // d0) if d0 else 0 for n, d0 in zip(t.numels, t.dim0, strict=True))
        return _uniform(name, k, P, per, "torch.chunk on dim 0 per tensor, padded to chunk 0 (FSDP2)")
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


def _measured_shard_sizes(t: _Tensors, k: int, partitioner: str) -> ShardSizes:
    """A partitioner without a closed form here: run it on the layout and group its ranks."""
    from ..partition import get_partitioner

    fn = get_partitioner(partitioner)
    if t.layout is None:
        raise ConfigError("partitioner", partitioner, "has no closed form here; pass a layout (--model), not a bare count")
    plan = fn(t.layout, k)
    sizes = [s.padded_numel for s in plan.shards]
    return ShardSizes(partitioner, k, t.total, _classes_from_sizes(sizes), sum(sizes) - t.total,
                      f"measured from the {partitioner} partitioner's ShardPlan")


# ---------------------------------------------------------------------------------------------
# the estimate
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Placed:
    """Bytes on the device and on the host."""

    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    def __add__(self, other: Placed) -> Placed:
        return Placed(self.device + other.device, self.host + other.host)

    def to_json(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host}


@dataclass(frozen=True)
class RankClassMemory:
    """Memory of every rank in one class (same local ranks in every shard group)."""

    local_ranks: tuple[tuple[int, int], ...]
    count: int                      # ranks in the whole world
    numel: dict[str, int]           # elements stored per category
    params: Placed
    grads: Placed
    optimizer_states: Placed
    transient: dict[str, int]       # device bytes of transient buffers at each phase of a step

    @property
    def total(self) -> Placed:
        return self.params + self.grads + self.optimizer_states

    @property
    def transient_device(self) -> int:
        """The largest transient of the step (phases do not overlap)."""
        return max(self.transient.values(), default=0)

    @property
    def peak_device(self) -> int:
        return self.total.device + self.transient_device

    def category(self, name: str) -> Placed:
        return {"params": self.params, "grads": self.grads, "optimizer_states": self.optimizer_states,
                "total": self.total}[name]

    def to_json(self) -> dict[str, Any]:
        return {
            "local_ranks": [list(r) for r in self.local_ranks],
            "count": self.count,
            "numel": dict(self.numel),
            "params": self.params.to_json(),
            "grads": self.grads.to_json(),
            "optimizer_states": self.optimizer_states.to_json(),
            "total": self.total.to_json(),
            "transient": {"device": self.transient_device, "phases": dict(self.transient)},
            "peak": {"device": self.peak_device, "host": self.total.host},
        }


@dataclass(frozen=True)
class UnitBytes:
    """One gather / reduce unit of the engine's schedule: a block under ZeRO-3, the model otherwise."""

    name: str
    numel: int          # real elements
    packed_numel: int   # k * chunk: the all-gather output / reduce-scatter input length
    unpack_copy: bool   # the gathered buffer is copied to unit order (non-identity packing)


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank memory for one configuration; ``per_rank`` is the class with the highest device peak."""

    model: str
    total_params: int
    strategy: ShardingStrategy
    topology: Topology
    settings: MemorySettings
    shard: ShardSizes
    classes: tuple[RankClassMemory, ...]
    largest_block_numel: int | None
    units: tuple[UnitBytes, ...] = ()
    packing: str = "partitioner"
    notes: tuple[str, ...] = field(default=())

    @property
    def per_rank(self) -> RankClassMemory:
        return max(self.classes, key=lambda c: (c.peak_device, c.total.total))

    @property
    def shard_group_size(self) -> int:
        return self.shard.k

    @property
    def transient_modelled(self) -> bool:
        """False for ZeRO-3 / hybrid on a bare parameter count without ``largest_block_numel``: the
        gathered-block transient needs the block structure, so ``transient`` / ``peak`` are not known."""
        return not (self.strategy.shards_params and not self.units)

    def to_json(self) -> dict[str, Any]:
        k = self.shard.k
        return {
            "model": self.model,
            "total_params": self.total_params,
            "strategy": self.strategy.name,
            "zero_stage": self.strategy.zero_stage,
            "world_size": self.topology.world_size,
            "ranks_per_node": self.topology.ranks_per_node,
            "shard_group_size": k,
            "replicate_group_size": self.topology.world_size // k,
            "partitioner": self.shard.partitioner,
            "partition_rule": self.shard.rule,
            "packing": self.packing,
            "padding_elements_per_shard_group": self.shard.padding,
            "largest_block_numel": self.largest_block_numel,
            "settings": {**self.settings.to_json(), "bytes_per_element": self.settings.bytes_per_element(self.strategy)},
            "units": "bytes",
            "accounting": ("params/grads/optimizer_states/total: persistent model states (ZeRO paper "
                           "accounting, with partitioner padding); transient/peak: the reference engine's schedule"),
            "transient_modelled": self.transient_modelled,
            "per_rank": self.per_rank.to_json(),
            "rank_classes": [c.to_json() for c in self.classes],
            "notes": list(self.notes),
        }


def _strategy(strategy: ShardingStrategy | str, topology: Topology) -> ShardingStrategy:
    if isinstance(strategy, ShardingStrategy):
        return strategy
    return ShardingStrategy.parse(strategy, topology.ranks_per_node)


_PER_TENSOR_RULES = ("fsdp", "fsdp2", "deepspeed-zero3")


def _block_units(t: _Tensors, k: int, partitioner: str | None) -> list[UnitBytes]:
    """ZeRO-3 units (one per block) with their packed sizes under the partitioner's rule."""
    lay = t.layout
    assert lay is not None
    name = (partitioner or "paper").strip().lower().replace("_", "-")
    out = []
    for b in lay.blocks:
        n = lay.block_numel(b)
        if name in _PER_TENSOR_RULES:
            sub = ParamLayout(tuple(lay.tensors[i] for i in b.tensor_indices), {}, b.name)
            chunk = shard_sizes(sub, k, name).max_stored
        else:
            chunk = _ceil(n, k)
        out.append(UnitBytes(b.name, n, k * chunk, False))
    return out


def _engine_units(t: _Tensors, strategy: ShardingStrategy, world_size: int,
                  partitioner: str | None) -> tuple[int, list[UnitBytes], str]:
    """The reference engine's packing (``zerosim.engine.flat_buffers``): exact, built from the plan."""
    from ..engine.flat_buffers import build_unit_plan

    if t.layout is None:
        raise ConfigError("packing", "engine", "needs a layout (the engine packs per block), not a bare count")
    name = partitioner or "fsdp"
    plan = build_unit_plan(t.layout, strategy, name, world_size)
    units = [UnitBytes(u.name, u.numel, u.packed_numel, not u.is_identity) for u in plan.units]
    return plan.shard_numel, units, name


def _window_max(values: Sequence[int], width: int) -> int:
    """Largest sum of ``width`` consecutive values (fewer at the end of the sequence)."""
    best, n = 0, len(values)
    for j in range(n):
        best = max(best, sum(values[j:min(j + width, n)]))
    return best


def transient_phases(strategy: ShardingStrategy, settings: MemorySettings, total: int,
                     units: Sequence[UnitBytes], shard_numel: int) -> dict[str, int]:
    """Device bytes of the transient buffers at each phase of a step, following the engine's schedule.

    ``d`` = prefetch depth, ``pb`` / ``gb`` = param / grad bytes, ``G_u`` = gathered bytes of unit ``u``
    (``packed_u * pb``, plus an unpacked copy when the packing is not the identity):

    * FULL_SHARD / HYBRID_SHARD, ``forward``: the largest window of ``1 + d`` consecutive gathered
      blocks (uniform blocks: ``(1 + d) * largest_block * pb``). ``backward``: the same windows, or,
      once a block's params are freed, the ``d`` prefetched blocks plus the block's packed fp32
      gradient before its reduce-scatter (``packed_u * gb``).
    * SHARD_GRAD_OP / HYBRID_SHARD_ZERO2, ``backward_end``: the micro-batch's unsharded gradients in
      the param dtype (``P * pb``) plus the packed flat gradient (``packed * gb``, or
      ``grad_bucket_numel * gb`` for bucketed implementations); ``refresh``: the all-gathered params.
    * SHARD_OPTIMIZER, ``optimizer``: the rank's gradient chunk (``chunk * gb``), which stays live
      through ``refresh``: the all-gathered params plus that chunk. With
      ``zero1_grad_reduce="reduce_scatter"`` (DeepSpeed stage 1) also ``reduce``: the packed (padded)
      full gradient plus the reduced chunk it is scattered into (``packed * gb + chunk * gb``); the
      all-reduce variant reduces the accumulation buffer in place.
    * NO_SHARD: none.
    """
    pb, gb, d = settings.spec.param_bytes, settings.spec.grad_bytes, settings.prefetch_depth
    out: dict[str, int] = {}
    if strategy.shards_params:
        if not units:
            return out
        gathered = [u.packed_numel * pb + (u.numel * pb if u.unpack_copy else 0) for u in units]
        out["forward"] = _window_max(gathered, 1 + d)
        after_free = max(sum(gathered[max(j - d, 0):j]) + units[j].packed_numel * gb for j in range(len(units)))
        out["backward"] = max(out["forward"], after_free)
    elif strategy.shards_optimizer:
        packed = units[0].packed_numel if units else shard_numel
        if strategy.shards_grads:
            bucket = packed if settings.grad_bucket_numel is None else min(settings.grad_bucket_numel, packed)
            out["backward_end"] = total * pb + bucket * gb
            out["refresh"] = packed * pb
        else:
            if settings.zero1_grad_reduce == "reduce_scatter":
                out["reduce"] = packed * gb + shard_numel * gb  # packed input and chunk output live together
            out["optimizer"] = shard_numel * gb
            out["refresh"] = packed * pb + shard_numel * gb  # the chunk lives until the params are refreshed
    return out


def memory_per_rank(
    layout_or_numel: ParamLayout | int | float,
    strategy: ShardingStrategy | str,
    topology: Topology | int,
    settings: MemorySettings | None = None,
    partitioner: str | None = None,
    largest_block_numel: int | None = None,
    packing: str = "partitioner",
) -> MemoryEstimate:
    """Per-rank bytes of params, grads and optimizer states (device and host) plus transients.

    ``layout_or_numel``: a :class:`ParamLayout` (blocks give the ZeRO-3 transient; tensors give
    per-tensor padding) or a bare parameter count (``7.5e9``); for a bare count the largest block
    may be passed as ``largest_block_numel`` (else the ZeRO-3 transient is reported as 0 with a note).
    ``topology``: a :class:`Topology` or a world size. ``partitioner``: see :func:`shard_sizes`;
    ``None`` is the ZeRO paper's even split (rounded up).
    ``packing``: ``"partitioner"`` (each rank stores what the partitioner gives it, closed form) or
    ``"engine"`` (the reference engine's flat units: every rank stores, per unit, as many elements as
    the rank owning most of it; built from the plan, so meant for simulator-sized runs).
    """
    if isinstance(topology, int) and not isinstance(topology, bool):
        topology = Topology(topology)
    if not isinstance(topology, Topology):
        raise ConfigError("topology", topology, "must be a Topology or a positive world size")
    if packing not in ("partitioner", "engine"):
        raise ConfigError("packing", packing, "must be 'partitioner' or 'engine'")
    settings = settings or MemorySettings()
    strat = _strategy(strategy, topology)
    t = _as_tensors(layout_or_numel)
    P = t.total
    k = strat.shard_group_size(topology.world_size)
    r = topology.world_size // k
    notes: list[str] = []

    off = settings.offloaded
    if "params" in off and not strat.shards_params:
        raise ConfigError("offload", settings.offload,
                          f"offloading params needs a strategy that shards them (zero3 / hybrid_shard), not {strat.name}")

    if packing == "engine":
        shard_numel, units, part_name = _engine_units(t, strat, topology.world_size, partitioner)
        if not strat.shards_optimizer:
            shard_numel = P
        sizes = _uniform(part_name, k, P, shard_numel, "reference engine packing: per unit, every rank stores "
                         "the largest rank's share") if k > 1 else _uniform(part_name, 1, P, P, "unsharded")
    else:
        sizes = shard_sizes(layout_or_numel, k, partitioner) if k > 1 else _uniform(partitioner or "paper", 1, P, P, "unsharded")
        units = []
        if strat.shards_params and t.layout is not None and largest_block_numel is None:
            units = _block_units(t, k, partitioner)
        elif strat.shards_params and largest_block_numel is not None:
            n_blocks = max(1, settings.prefetch_depth + 1)
            L = require_non_negative_int("largest_block_numel", largest_block_numel)
            units = [UnitBytes(f"block{i}", L, _ceil(L, k) * k, False) for i in range(n_blocks)]
        elif strat.shards_optimizer and not strat.shards_params:
            units = [UnitBytes("model", P, k * sizes.max_stored, False)]
    if sizes.padding:
        notes.append(f"{sizes.padding} padding elements per shard group ({sizes.rule})")
    if strat.shards_params and not units:
        notes.append("ZeRO-3 transient not modelled: no block structure (pass a layout / --model PRESET, "
                     "or largest_block_numel / --largest-block N)")
    if largest_block_numel is not None:
        largest: int | None = largest_block_numel
    elif t.block_numels:
        largest = max(t.block_numels)
    else:
        largest = None
    bpe = settings.bytes_per_element(strat)

    def place(cat: str, numel: int) -> Placed:
        b = numel * bpe[cat]
        return Placed(0, b) if cat in off else Placed(b, 0)

    classes = []
    for c in sizes.classes:
        numel = {
            "params": c.stored_numel if strat.shards_params else P,
            "grads": c.stored_numel if strat.shards_grads else P,
            "optimizer_states": c.stored_numel if strat.shards_optimizer else P,
        }
        classes.append(RankClassMemory(
            local_ranks=c.local_ranks, count=c.count * r, numel=numel,
            params=place("params", numel["params"]), grads=place("grads", numel["grads"]),
            optimizer_states=place("optimizer_states", numel["optimizer_states"]),
            transient=transient_phases(strat, settings, P, units, c.stored_numel),
        ))
    return MemoryEstimate(t.name, P, strat, topology, settings, sizes, tuple(classes), largest, tuple(units),
                          packing, tuple(notes))


def all_strategies(topology: Topology) -> list[ShardingStrategy]:
    """Every strategy, hybrids included when the topology has more than one node."""
    out = [ShardingStrategy(StrategyKind.NO_SHARD), ShardingStrategy(StrategyKind.SHARD_OPTIMIZER),
           ShardingStrategy(StrategyKind.SHARD_GRAD_OP), ShardingStrategy(StrategyKind.FULL_SHARD)]
    if topology.num_nodes > 1:
        out += [ShardingStrategy.hybrid_shard(topology.rpn), ShardingStrategy.hybrid_shard_zero2(topology.rpn)]
    return out
