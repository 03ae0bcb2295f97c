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

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, require_non_negative_int
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy, StrategyKind, Topology
from .memory_settings import MemorySettings
from .shard_sizes import ModelTensors, ShardSizes, ceil_div, model_tensors, shard_sizes, uniform_shard_sizes


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
            "settings": {
                **self.settings.to_json(),
                "bytes_per_element": self.settings.bytes_per_element(self.strategy),
            },
            "units": "bytes",
            "accounting": (
                "params/grads/optimizer_states/total: persistent model states (ZeRO paper "
                "accounting, with partitioner padding); transient/peak: the reference engine's schedule"
            ),
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


def _block_units(t: ModelTensors, k: int, partitioner: str | None) -> list[UnitBytes]:
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
            chunk = ceil_div(n, k)
        out.append(UnitBytes(b.name, n, k * chunk, False))
    return out


def _engine_units(t: ModelTensors, strategy: ShardingStrategy, world_size: int,
                  partitioner: str | None) -> tuple[int, list[UnitBytes], str]:
    """The reference engine's packing (``zerosim.values.flat_buffers``): exact, built from the plan."""
    from ..values.flat_buffers import build_unit_plan

    if t.layout is None:
        raise ConfigError(
            "packing", "engine", "needs a layout (the engine packs per block), not a bare count"
        )
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
    * SHARD_OPTIMIZER, ``refresh``: the all-gathered params. The all-reduce variant reduces the
      accumulation buffer in place and steps a view of it (each rank's owned gradient is one range
      of it: :mod:`zerosim.engine.grad_order`), so nothing else is transient. With
      ``zero1_grad_reduce="reduce_scatter"`` (DeepSpeed stage 1) the rank's gradient chunk
      (``chunk * gb``) is a buffer of its own: ``reduce`` holds the packed (padded) full gradient
      plus the reduced chunk it is scattered into (``packed * gb + chunk * gb``), ``optimizer`` the
      chunk, which stays live through ``refresh`` (the all-gathered params plus that chunk).
    * NO_SHARD: none.
    """
    pb, gb, d = settings.spec.param_bytes, settings.spec.grad_bytes, settings.prefetch_depth
    out: dict[str, int] = {}
    if strategy.shards_params:
        if not units:
            return out
        gathered = [u.packed_numel * pb + (u.numel * pb if u.unpack_copy else 0) for u in units]
        out["forward"] = _window_max(gathered, 1 + d)
        after_free = max(
            sum(gathered[max(j - d, 0) : j]) + units[j].packed_numel * gb for j in range(len(units))
        )
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
                out["refresh"] = packed * pb + shard_numel * gb  # the chunk lives until the refresh
            else:  # the owned gradient is a view of the accumulation buffer
                out["refresh"] = packed * pb
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
    t = model_tensors(layout_or_numel)
    P = t.total
    k = strat.shard_group_size(topology.world_size)
    r = topology.world_size // k
    notes: list[str] = []

    off = settings.offloaded
    if "params" in off and not strat.shards_params:
        raise ConfigError(
            "offload",
            settings.offload,
            f"offloading params needs a strategy that shards them (zero3 / hybrid_shard), not {strat.name}",
        )

    if packing == "engine":
        shard_numel, units, part_name = _engine_units(t, strat, topology.world_size, partitioner)
        if not strat.shards_optimizer:
            shard_numel = P
        sizes = (
            uniform_shard_sizes(
                part_name,
                k,
                P,
                shard_numel,
                "reference engine packing: per unit, every rank stores the largest rank's share",
            )
            if k > 1
            else uniform_shard_sizes(part_name, 1, P, P, "unsharded")
        )
    else:
        sizes = (
            shard_sizes(layout_or_numel, k, partitioner)
            if k > 1
            else uniform_shard_sizes(partitioner or "paper", 1, P, P, "unsharded")
        )
        units = []
        if strat.shards_params and t.layout is not None and largest_block_numel is None:
            units = _block_units(t, k, partitioner)
        elif strat.shards_params and largest_block_numel is not None:
            n_blocks = max(1, settings.prefetch_depth + 1)
            L = require_non_negative_int("largest_block_numel", largest_block_numel)
            units = [UnitBytes(f"block{i}", L, ceil_div(L, k) * k, False) for i in range(n_blocks)]
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
    if not isinstance(topology, Topology):
        raise ConfigError("topology", type(topology).__name__, "must be a zerosim.Topology")
    out = [ShardingStrategy(StrategyKind.NO_SHARD), ShardingStrategy(StrategyKind.SHARD_OPTIMIZER),
           ShardingStrategy(StrategyKind.SHARD_GRAD_OP), ShardingStrategy(StrategyKind.FULL_SHARD)]
    if topology.num_nodes > 1:
        out += [
            ShardingStrategy.hybrid_shard(topology.rpn),
            ShardingStrategy.hybrid_shard_zero2(topology.rpn),
        ]
    return out
