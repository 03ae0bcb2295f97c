"""Closed-form communication per optimizer step: what every rank sends and receives, per collective.

C-ZERO-005's expected value (the engine's measured traffic must equal it exactly) and what
``zerosim comm`` prints. It follows the engine's collective schedule (:mod:`zerosim.engine.step`,
:mod:`zerosim.engine.gradients`) and the ring attribution of :mod:`zerosim.comm.base`; per strategy:
NO_SHARD all-reduces the gradient (``2(N-1)/N Psi`` elements sent per rank), ZeRO-1 all-reduces or
reduce-scatters it and all-gathers the parameters (``3(N-1)/N`` or ``2(N-1)/N Psi``), ZeRO-2
reduce-scatters and all-gathers (``2(N-1)/N Psi``), ZeRO-3 gathers twice and reduce-scatters per unit
(``3(N-1)/N Psi``), hybrid strategies do that inside the shard group and all-reduce a ``1/k`` shard
across replicas. The schedule with micro-batches, padding and dtypes, the hybrid intra/inter-node split
and the paper's accounting are derived in docs/cost-model.md. Control traffic (``*.control`` groups) is
reported apart.

Cost: O(tensors + ranks) to build the padded units from the partitioner's plan (O(1) given a plain
parameter count), so 10^12 parameters x 1024 ranks answer instantly.

Why one module of this length: every strategy's schedule and its per-link attribution are one
table of collectives; the engine's schedule and this model are compared line for line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ..errors import ConfigError, require_positive_int
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy, StrategyKind, Topology

GROUP_KINDS = ("world", "shard", "replicate")
ZERO1_GRAD_REDUCE = ("all_reduce", "reduce_scatter")  # the same names as RunConfig.zero1_grad_reduce
LINK_CLASSES = ("intra", "inter")


@dataclass(frozen=True)
class CollectiveCost:
    """One kind of collective on one kind of group, per rank per step."""

    group_kind: str          # world | shard | replicate
    collective: str          # all_reduce | reduce_scatter | all_gather
    purpose: str             # "grad reduce", "param gather (forward)", ...
    calls: int
    group_size: int
    dtype_bytes: int
    payload_elements: int    # sum over calls of the full buffer length S (elements)

    @property
    def payload_bytes(self) -> int:
        return self.payload_elements * self.dtype_bytes

    @property
    def factor(self) -> Fraction:
        n = self.group_size
        if n <= 1:
            return Fraction(0)
        return Fraction(2 * (n - 1), n) if self.collective == "all_reduce" else Fraction(n - 1, n)

    @property
    def elements_sent(self) -> Fraction:
        return self.factor * self.payload_elements

    @property
    def bytes_sent(self) -> Fraction:
        return self.factor * self.payload_bytes

    @property
    def bytes_received(self) -> Fraction:
        return self.bytes_sent  # ring: symmetric for all-reduce, reduce-scatter, all-gather

    def to_json(self) -> dict[str, Any]:
        return {"group_kind": self.group_kind, "collective": self.collective, "purpose": self.purpose,
                "calls": self.calls, "group_size": self.group_size, "dtype_bytes": self.dtype_bytes,
                "payload_elements": self.payload_elements, "payload_bytes": self.payload_bytes,
                "elements_sent": float(self.elements_sent), "bytes_sent": float(self.bytes_sent),
                "bytes_received": float(self.bytes_received)}


@dataclass
class CommEstimate:
    """Per-rank traffic of one optimizer step (identical on every rank under ring attribution)."""

    strategy: str
    world_size: int
    ranks_per_node: int
    shard_group_size: int
    replicas: int
    micro_batches: int
    numel: int                     # Psi: real parameters
    packed_numel: int              # P: what the collectives move (Psi + padding)
    param_bytes: int
    grad_bytes: int
    partitioner: str | None
    items: list[CollectiveCost] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _topology: Topology | None = None
    variant: str | None = None     # ZeRO-1 only: "all_reduce" | "reduce_scatter" (zero1_grad_reduce)

    # ---- totals ----------------------------------------------------------------------------------
    @property
    def bytes_sent(self) -> Fraction:
        return sum((i.bytes_sent for i in self.items), Fraction(0))

    @property
    def bytes_received(self) -> Fraction:
        return sum((i.bytes_received for i in self.items), Fraction(0))

    @property
    def elements_sent(self) -> Fraction:
        return sum((i.elements_sent for i in self.items), Fraction(0))

    @property
    def padding(self) -> int:
        return self.packed_numel - self.numel

    def by_group_kind(self) -> dict[str, Fraction]:
        out: dict[str, Fraction] = {}
        for i in self.items:
            out[i.group_kind] = out.get(i.group_kind, Fraction(0)) + i.bytes_sent
        return out

    def expected(self) -> dict[tuple[str, str], tuple[int, Fraction, Fraction]]:
        """(group_kind, collective) -> (calls, bytes_sent, bytes_received): what C-ZERO-005 compares."""
        out: dict[tuple[str, str], tuple[int, Fraction, Fraction]] = {}
        for i in self.items:
            c, s, r = out.get((i.group_kind, i.collective), (0, Fraction(0), Fraction(0)))
            out[(i.group_kind, i.collective)] = (c + i.calls, s + i.bytes_sent, r + i.bytes_received)
        return out

    def paper_elements(self) -> Fraction:
        """The ZeRO paper's per-rank elements for this stage, on the unpadded Psi (M = 1 reference)."""
        n, psi = self.world_size, self.numel
        kind = StrategyKind(self.strategy.split(":")[0])
        if kind is StrategyKind.FULL_SHARD:
            return Fraction(3 * (n - 1), n) * psi
        if kind in (StrategyKind.HYBRID_SHARD, StrategyKind.HYBRID_SHARD_ZERO2):
            k, r = self.shard_group_size, self.replicas
            mult = 3 if kind is StrategyKind.HYBRID_SHARD else 2
            return Fraction(mult * (k - 1), k) * psi + Fraction(2 * (r - 1), r) * Fraction(psi, k)
        return Fraction(2 * (n - 1), n) * psi

    # ---- link classes -----------------------------------------------------------------------------
    def per_rank_links(self, rank: int) -> dict[str, dict[str, Fraction]]:
        """Bytes ``rank`` sends to / receives from its ring neighbours, split intra- vs inter-node."""
        topo = self._topology or Topology(self.world_size, self.ranks_per_node)
        if not 0 <= rank < self.world_size:
            raise ConfigError("rank", rank, f"must be in [0, {self.world_size})")
        out = {c: {"sent": Fraction(0), "received": Fraction(0)} for c in LINK_CLASSES}
        k = self.shard_group_size
        for item in self.items:
            succ = _ring_successor(item.group_kind, rank, self.world_size, k)
            pred = _ring_successor(item.group_kind, rank, self.world_size, k, step=-1)
            if succ is None or pred is None:
                continue
            out["intra" if topo.same_node(rank, succ) else "inter"]["sent"] += item.bytes_sent
            out["intra" if topo.same_node(rank, pred) else "inter"]["received"] += item.bytes_received
        return out

    def collective_links(self, max_world: int = 4096) -> list[dict[str, Any]]:
        """Per collective (in :attr:`items` order): elements and bytes each rank sends per step, split
        by the link class of its ring successor, as the mean over ranks (rank 0's above ``max_world``
        ranks, where the mean would cost O(ranks) per collective)."""
        topo = self._topology or Topology(self.world_size, self.ranks_per_node)
        ranks = range(self.world_size) if self.world_size <= max_world else range(1)
        out = []
        for item in self.items:
            inter_ranks = 0
            for rank in ranks:
                succ = _ring_successor(item.group_kind, rank, self.world_size, self.shard_group_size)
                inter_ranks += succ is not None and not topo.same_node(rank, succ)
            inter_share = Fraction(inter_ranks, len(ranks))
            row: dict[str, Any] = {
                "group_kind": item.group_kind,
                "collective": item.collective,
                "purpose": item.purpose,
                "basis": "mean over ranks" if len(ranks) > 1 else "rank 0",
            }
            for cls, share in (("intra", 1 - inter_share), ("inter", inter_share)):
                row[cls] = {"elements_sent": float(item.elements_sent * share),
                            "bytes_sent": float(item.bytes_sent * share)}
            out.append(row)
        return out

    def link_totals(self) -> dict[str, dict[str, Fraction]]:
        """Sum over every rank of :meth:`per_rank_links` (O(N) per collective kind)."""
        tot = {c: {"sent": Fraction(0), "received": Fraction(0)} for c in LINK_CLASSES}
        for rank in range(self.world_size):
            for c, d in self.per_rank_links(rank).items():
                tot[c]["sent"] += d["sent"]
                tot[c]["received"] += d["received"]
        return tot

    def to_json(self, with_links: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "strategy": self.strategy, "world_size": self.world_size, "ranks_per_node": self.ranks_per_node,
            "shard_group_size": self.shard_group_size, "replicas": self.replicas,
            "micro_batches": self.micro_batches, "numel": self.numel, "packed_numel": self.packed_numel,
            "padding": self.padding, "param_bytes": self.param_bytes, "grad_bytes": self.grad_bytes,
            "partitioner": self.partitioner, "variant": self.variant,
            "per_rank": {"bytes_sent": float(self.bytes_sent), "bytes_received": float(self.bytes_received),
                         "elements_sent": float(self.elements_sent),
                         "by_group_kind": {k: float(v) for k, v in self.by_group_kind().items()}},
            "paper_elements_per_rank": float(self.paper_elements()),
            "collectives": [i.to_json() for i in self.items],
            "notes": list(self.notes),
        }
        if with_links:
            out["links_rank0"] = {
                c: {k: float(v) for k, v in d.items()} for c, d in self.per_rank_links(0).items()
            }
            if self.world_size <= 4096:
                out["links_total"] = {
                    c: {k: float(v) for k, v in d.items()} for c, d in self.link_totals().items()
                }
        return out


def _ring_successor(kind: str, rank: int, n: int, k: int, step: int = 1) -> int | None:
    """The rank ``rank`` sends to (``step=1``) or receives from (``step=-1``) in the ring of its
    ``kind`` group (group order, cyclic), in O(1); ``None`` when the group has one member."""
    if kind == "world":
        return (rank + step) % n if n > 1 else None
    if kind == "shard":
        base = rank - rank % k
        return base + (rank - base + step) % k if k > 1 else None
    return (rank + step * k) % n if n // k > 1 else None  # replicate: rank % k, rank % k + k, ...


def packed_unit_sizes(
    layout: ParamLayout, strategy: ShardingStrategy, partitioner: str, world_size: int
) -> list[int]:
    """``k * c_u`` for every non-empty unit, exactly as :func:`zerosim.values.flat_buffers.build_unit_plan`
    pads them (``c_u`` = the most elements any rank owns of unit ``u``), vectorised: O(intervals)."""
    import numpy as np

    from ..partition import get_partitioner
    from ..values.flat_buffers import unit_tensor_groups

    k = strategy.shard_group_size(world_size)
    plan = get_partitioner(partitioner)(layout, k)
    groups = unit_tensor_groups(layout, strategy)
    offsets = layout.offsets
    p_start, p_end, p_unit, unit_numel = [], [], [], []
    for u, (_, tids) in enumerate(groups):
        n = 0
        for i in tids:
            numel = layout.tensors[i].numel
            if numel:
                p_start.append(offsets[i])
                p_end.append(offsets[i] + numel)
                p_unit.append(u)
            n += numel
        unit_numel.append(n)
    order = np.argsort(np.asarray(p_start, dtype=np.int64), kind="stable")
    ps = np.asarray(p_start, dtype=np.int64)[order]
    pe = np.asarray(p_end, dtype=np.int64)[order]
    pu = np.asarray(p_unit, dtype=np.int64)[order]
    starts, ends, ranks = [], [], []
    for j in range(k):
        for s, e in plan.shard(j).intervals:
            if e > s:
                starts.append(s)
                ends.append(e)
                ranks.append(j)
    owned = np.zeros((k, len(groups)), dtype=np.int64)
    if starts:
        s_arr = np.asarray(starts, dtype=np.int64)
        e_arr = np.asarray(ends, dtype=np.int64)
        r_arr = np.asarray(ranks, dtype=np.int64)
        i0 = np.searchsorted(pe, s_arr, side="right")
        i1 = np.searchsorted(ps, e_arr, side="left")
        counts = np.maximum(i1 - i0, 0)
        idx = np.repeat(np.arange(len(s_arr)), counts)
        piece = np.repeat(i0, counts) + (
            np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        overlap = np.minimum(e_arr[idx], pe[piece]) - np.maximum(s_arr[idx], ps[piece])
        np.add.at(owned, (r_arr[idx], pu[piece]), np.maximum(overlap, 0))
    chunk = owned.max(axis=0) if k else np.zeros(len(groups), dtype=np.int64)
    return [int(k * c) for c, n in zip(chunk, unit_numel, strict=True) if n]


def unit_sizes(layout_or_numel: ParamLayout | int, strategy: ShardingStrategy, world_size: int,
               partitioner: str | None) -> tuple[int, list[int]]:
    """(Psi, packed size k*c_u of every unit) as the engine pads them."""
    k = strategy.shard_group_size(world_size)
    if isinstance(layout_or_numel, ParamLayout):
        if partitioner is None:
            raise ConfigError("partitioner", None, "a layout needs a partitioner to know its padding")
        return layout_or_numel.total_numel, packed_unit_sizes(
            layout_or_numel, strategy, partitioner, world_size
        )
    if isinstance(layout_or_numel, bool) or not isinstance(layout_or_numel, int):
        raise ConfigError("numel", layout_or_numel, "expected a parameter count or a ParamLayout")
    psi = require_positive_int("numel", layout_or_numel)
    return psi, [-(-psi // k) * k]  # one flat unit, evenly padded (an even partitioner's padding)


def comm_per_step(
    layout_or_numel: ParamLayout | int,
    strategy: ShardingStrategy | str,
    topology: Topology | int,
    partitioner: str | None = "fsdp",
    micro_batches: int = 1,
    param_bytes: int = 4,
    grad_bytes: int = 4,
    zero1_grad_reduce: str = "all_reduce",
) -> CommEstimate:
    """Per-rank data traffic of one optimizer step of the reference engine (see the module docstring).

    ``layout_or_numel``: a ParamLayout (units and padding from ``partitioner``, one unit per block
    under FULL_SHARD / HYBRID_SHARD) or a plain parameter count (one evenly padded flat unit).
    ``zero1_grad_reduce``: how ZeRO-1 averages gradients, ``"all_reduce"`` (default) or
    ``"reduce_scatter"``; other strategies ignore it.
    """
    if zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
        raise ConfigError(
            "zero1_grad_reduce", zero1_grad_reduce, f"known: {', '.join(ZERO1_GRAD_REDUCE)} (--zero1-reduce)"
        )
    if isinstance(topology, int):
        topology = Topology(topology)
    if not isinstance(topology, Topology):
        raise ConfigError("topology", topology, "expected a Topology or a world size")
    if not isinstance(strategy, ShardingStrategy):  # a name; anything else is refused by parse
        strategy = ShardingStrategy.parse(strategy, topology.ranks_per_node)
    require_positive_int("micro_batches", micro_batches)
    require_positive_int("param_bytes", param_bytes)
    require_positive_int("grad_bytes", grad_bytes)
    n = topology.world_size
    k = strategy.shard_group_size(n)
    r = n // k
    psi, packed = unit_sizes(layout_or_numel, strategy, n, partitioner)
    m = micro_batches
    total_packed = sum(packed)
    chunk = total_packed // k
    shard_kind = "world" if k == n else "shard"
    rep_kind = "world" if k == 1 else "replicate"
    est = CommEstimate(strategy.name, n, topology.rpn, k, r, m, psi, total_packed, param_bytes, grad_bytes,
                       partitioner if isinstance(layout_or_numel, ParamLayout) else None, _topology=topology)
    add = est.items.append
    kind = strategy.kind
    if kind is StrategyKind.NO_SHARD:
        if n > 1:
            add(CollectiveCost("world", "all_reduce", "grad reduce", 1, n, grad_bytes, psi))
    elif kind is StrategyKind.SHARD_OPTIMIZER:
        est.variant = zero1_grad_reduce
        if zero1_grad_reduce == "reduce_scatter":
            add(CollectiveCost(shard_kind, "reduce_scatter", "grad reduce-scatter (after accumulation)", 1, k,
                               grad_bytes, total_packed))
            est.notes.append(
                "ZeRO-1 (reduce_scatter, DeepSpeed stage 1): one gradient reduce-scatter per step "
                "and one parameter all-gather: 2(N-1)/N Psi, the paper's P_os figure"
            )
        else:
            if n > 1:
                add(CollectiveCost("world", "all_reduce", "grad reduce", 1, n, grad_bytes, psi))
            est.notes.append(
                "ZeRO-1 (all_reduce, torch ZeroRedundancyOptimizer): all-reduces the full gradient "
                "and all-gathers the parameters: 3(N-1)/N Psi (the paper's 2(N-1)/N Psi is the "
                "reduce_scatter variant)"
            )
        add(
            CollectiveCost(
                shard_kind, "all_gather", "param gather (after step)", 1, k, param_bytes, total_packed
            )
        )
    elif kind in (StrategyKind.SHARD_GRAD_OP, StrategyKind.HYBRID_SHARD_ZERO2):
        add(
            CollectiveCost(
                shard_kind,
                "reduce_scatter",
                "grad reduce-scatter (per micro-batch)",
                m,
                k,
                grad_bytes,
                m * total_packed,
            )
        )
        if kind is StrategyKind.HYBRID_SHARD_ZERO2 and r > 1:
            add(
                CollectiveCost(
                    rep_kind, "all_reduce", "grad shard all-reduce across replicas", 1, r, grad_bytes, chunk
                )
            )
        add(
            CollectiveCost(
                shard_kind, "all_gather", "param gather (after step)", 1, k, param_bytes, total_packed
            )
        )
    else:  # FULL_SHARD, HYBRID_SHARD
        units = len(packed)
        add(
            CollectiveCost(
                shard_kind,
                "all_gather",
                "param gather (forward + backward, per block)",
                2 * m * units,
                k,
                param_bytes,
                2 * m * total_packed,
            )
        )
        add(
            CollectiveCost(
                shard_kind,
                "reduce_scatter",
                "grad reduce-scatter (per block)",
                m * units,
                k,
                grad_bytes,
                m * total_packed,
            )
        )
        if kind is StrategyKind.HYBRID_SHARD and r > 1:
            add(
                CollectiveCost(
                    rep_kind, "all_reduce", "grad shard all-reduce across replicas", 1, r, grad_bytes, chunk
                )
            )
    if est.padding:
        est.notes.append(
            f"padding: the collectives move {est.packed_numel:,} elements for {psi:,} parameters "
            f"({est.padding:,} padding elements, real traffic)"
        )
    return est


def comm_for_run(run: Any) -> CommEstimate:
    """The estimate for a resolved engine run (:class:`zerosim.engine.config.ResolvedRun`)."""
    return comm_per_step(run.layout, run.strategy, run.topology, run.partitioner, run.micro_batches,
                         run.precision.param_bytes, 4, getattr(run, "zero1_grad_reduce", "all_reduce"))

