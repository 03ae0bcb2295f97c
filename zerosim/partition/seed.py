"""The seed's partition rules (entrenar's ZeRO-1), in Pythonic form, and the partitioners built on them.

* :class:`OptimizerShard` splits a flat parameter vector into ``world_size`` contiguous shards:
  ``total // world_size`` each, and the first ``total % world_size`` ranks one extra element. (The
  seed's doc comment says the *last* shard absorbs the remainder; its code gives the extra to the
  first ranks, which is what C-ZERO-001's "within 1 of total // world_size" needs. We follow the code.)
* :class:`ZeroShardMap` assigns whole transformer blocks to ranks, round-robin or contiguously; the
  embedding, final norm and lm head go to rank 0 by default. Its ``memory_fraction_for_rank`` counts
  *blocks*; :meth:`ZeroShardMap.byte_fraction_for_rank` weighs them by bytes, which is the number
  that matters when the embedding alone is a third of the model.

Registered partitioners: ``seed`` (flat OptimizerShard rule), ``round-robin`` and ``contiguous``
(block maps as a ShardPlan). All serve C-ZERO-001.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, require_non_negative_int, require_positive_int, require_rank
from ..values.intervals import Interval, merge_adjacent
from ..values.layout import Block, ParamLayout
from ._common import ceil_div, check_args, make_flat_plan, make_plan
from .base import ShardPlan, ShardTable, register_partitioner

ADAM_STATE_BYTES_PER_PARAM = 2 * 4  # m + v, fp32: what the seed's shard_memory_bytes counts


# ---- OptimizerShard ------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerShard:
    """One rank's contiguous slice ``[param_start, param_end)`` of the flat parameter vector.

    C-ZERO-001: the shards of all ranks cover ``[0, total_params)``, never overlap, and every shard
    holds ``total_params // world_size`` or one more element.
    """

    rank: int
    world_size: int
    param_start: int
    param_end: int
    total_params: int

    @classmethod
    def for_rank(cls, rank: int, world_size: int, total_params: int) -> OptimizerShard:
        """The shard of ``rank``: the first ``total % world_size`` ranks get one extra element."""
        world_size = require_positive_int("world_size", world_size)
        rank = require_rank(rank, world_size)
        total_params = require_non_negative_int("total_params", total_params)
        base, remainder = divmod(total_params, world_size)
        if rank < remainder:
            start = rank * (base + 1)
            end = start + base + 1
        else:
            start = remainder * (base + 1) + (rank - remainder) * base
            end = start + base
        return cls(rank, world_size, start, end, total_params)

    @classmethod
    def all_ranks(cls, world_size: int, total_params: int) -> list[OptimizerShard]:
        """Every rank's shard, in rank order."""
        world_size = require_positive_int("world_size", world_size)
        return [cls.for_rank(r, world_size, total_params) for r in range(world_size)]

    @property
    def interval(self) -> Interval:
        return (self.param_start, self.param_end)

    def shard_size(self) -> int:
        """Number of parameters in this shard."""
        return self.param_end - self.param_start

    def owns_param(self, param_idx: int) -> bool:
        """Whether flat parameter ``param_idx`` belongs to this shard."""
        return self.param_start <= param_idx < self.param_end

    def memory_savings(self) -> float:
        """Fraction of optimizer memory saved versus full replication: ``1 - 1/world_size``."""
        return 1.0 - 1.0 / self.world_size

    def shard_memory_bytes(self) -> int:
        """Optimizer memory of this shard: Adam's m and v in fp32 (8 bytes per parameter)."""
        return self.shard_size() * ADAM_STATE_BYTES_PER_PARAM

    def full_memory_bytes(self) -> int:
        """Optimizer memory without sharding (8 bytes per parameter)."""
        return self.total_params * ADAM_STATE_BYTES_PER_PARAM


@register_partitioner("seed", "flat split, total//ws each, first total%ws ranks +1 (entrenar OptimizerShard)")
def seed_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """The seed's flat rule over the whole layout.

    balance_bound = 1: shards hold ``total // ws`` or ``total // ws + 1`` elements, and the plan also
    asks the check for the seed's literal clause (every shard within 1 of ``total // ws``).
    """
    ws = check_args(layout, world_size)
    total = layout.total_numel
    base, remainder = divmod(total, ws)
    # OptimizerShard.for_rank's rule, without validating every rank again: rank r starts after
    # r shards of ``base`` and min(r, remainder) extra elements
    notes = "OptimizerShard.for_rank: sizes differ by at most 1; no padding"
    if total < ShardTable.MAX_VALUE:
        r = np.arange(ws + 1, dtype=np.int64)
        bounds = r * base + np.minimum(r, remainder)
        return make_flat_plan("seed", total, bounds[:-1], bounds[1:], np.zeros(ws, dtype=np.int64),
                              balance_bound=1, notes=notes, balance_target=total // ws, balance_tolerance=1)
    starts = [r * base + min(r, remainder) for r in range(ws + 1)]
    return make_plan(
        "seed", ws, total, [[(starts[r], starts[r + 1])] for r in range(ws)], [0] * ws, balance_bound=1,
        notes=notes, balance_target=total // ws, balance_tolerance=1,
    )


# ---- ZeroShardMap --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ZeroShardMap:
    """Which rank owns each transformer block's state (and the embedding, final norm, lm head).

    ``other_owner`` is ours: the owner of parameters that belong to no block (the seed has none).
    """

    block_owners: tuple[int, ...]
    world_size: int
    embedding_owner: int = 0
    final_norm_owner: int = 0
    lm_head_owner: int = 0
    other_owner: int = 0

    def __post_init__(self) -> None:
        require_positive_int("world_size", self.world_size)
        object.__setattr__(self, "block_owners", tuple(self.block_owners))
        for i, owner in enumerate(self.block_owners):
            require_rank(owner, self.world_size, f"block_owners[{i}]")
        for name in ("embedding_owner", "final_norm_owner", "lm_head_owner", "other_owner"):
            require_rank(getattr(self, name), self.world_size, name)

    @classmethod
    def round_robin(cls, num_blocks: int, world_size: int) -> ZeroShardMap:
        """Block ``i`` goes to rank ``i % world_size``; non-block parts to rank 0."""
        num_blocks = require_non_negative_int("num_blocks", num_blocks)
        world_size = require_positive_int("world_size", world_size)
        return cls(tuple(i % world_size for i in range(num_blocks)), world_size)

    @classmethod
    def contiguous(cls, num_blocks: int, world_size: int) -> ZeroShardMap:
        """Contiguous runs of blocks; the first ``num_blocks % world_size`` ranks get one extra."""
        num_blocks = require_non_negative_int("num_blocks", num_blocks)
        world_size = require_positive_int("world_size", world_size)
        base, remainder = divmod(num_blocks, world_size)
        owners: list[int] = []
        for rank in range(world_size):
            owners += [rank] * (base + (rank < remainder))
        return cls(tuple(owners), world_size)

    @property
    def num_blocks(self) -> int:
        return len(self.block_owners)

    def block_owner(self, block_idx: int) -> int:
        """The rank owning block ``block_idx`` (the seed panics out of range; we raise ConfigError)."""
        if (
            isinstance(block_idx, bool)
            or not isinstance(block_idx, int)
            or not 0 <= block_idx < self.num_blocks
        ):
            raise ConfigError("block_idx", block_idx, f"must be in [0, {self.num_blocks})")
        return self.block_owners[block_idx]

    def rank_owns_block(self, rank: int, block_idx: int) -> bool:
        require_rank(rank, self.world_size)
        return self.block_owner(block_idx) == rank

    def blocks_for_rank(self, rank: int) -> list[int]:
        require_rank(rank, self.world_size)
        return [i for i, owner in enumerate(self.block_owners) if owner == rank]

    def num_blocks_for_rank(self, rank: int) -> int:
        require_rank(rank, self.world_size)
        return sum(1 for owner in self.block_owners if owner == rank)

    def memory_fraction_for_rank(self, rank: int) -> float:
        """The seed's fraction: blocks owned / blocks (0.0 when there are no blocks).

        It ignores the embedding, final norm and lm head and the blocks' sizes; see
        :meth:`byte_fraction_for_rank` for the fraction of bytes.
        """
        owned = self.num_blocks_for_rank(rank)
        return owned / self.num_blocks if self.num_blocks else 0.0

    # -- against a layout ----------------------------------------------------------------------
    def owner_of(self, block: Block, layout: ParamLayout) -> int:
        """The rank owning a layout block (transformer blocks by their order in the layout)."""
        return self.owners_by_block(layout)[block.name]

    def owners_by_block(self, layout: ParamLayout) -> dict[str, int]:
        """Owner of every block of ``layout``, by block name; transformer blocks in index order."""
        blocks = sorted((b for b in layout.blocks if b.kind == "block"), key=lambda b: (b.index or 0, b.name))
        if len(blocks) != self.num_blocks:
            raise ConfigError("num_blocks", self.num_blocks,
                              f"the layout {layout.name!r} has {len(blocks)} transformer blocks")
        owners = {b.name: self.block_owners[i] for i, b in enumerate(blocks)}
        pinned = {"embedding": self.embedding_owner, "final_norm": self.final_norm_owner,
                  "lm_head": self.lm_head_owner}
        for b in layout.blocks:
            if b.kind != "block":
                owners[b.name] = pinned.get(b.kind, self.other_owner)
        return owners

    def intervals_by_rank(self, layout: ParamLayout) -> list[tuple[Interval, ...]]:
        """Every rank's flat intervals: the tensors of the blocks it owns (touching ones joined)."""
        owners = self.owners_by_block(layout)
        offsets = layout.offsets
        per_rank: list[list[Interval]] = [[] for _ in range(self.world_size)]
        for block in layout.blocks:
            per_rank[owners[block.name]] += [(offsets[i], offsets[i] + layout.tensors[i].numel)
                                             for i in block.tensor_indices]
        return [merge_adjacent(ivs) for ivs in per_rank]

    def intervals_for_rank(self, rank: int, layout: ParamLayout) -> tuple[Interval, ...]:
        require_rank(rank, self.world_size)
        return self.intervals_by_rank(layout)[rank]

    def bytes_by_rank(self, layout: ParamLayout) -> list[int]:
        owners = self.owners_by_block(layout)
        out = [0] * self.world_size
        for b in layout.blocks:
            out[owners[b.name]] += layout.block_bytes(b)
        return out

    def bytes_for_rank(self, rank: int, layout: ParamLayout) -> int:
        require_rank(rank, self.world_size)
        return self.bytes_by_rank(layout)[rank]

    def byte_fraction_for_rank(self, rank: int, layout: ParamLayout) -> float:
        """Fraction of the layout's bytes ``rank`` owns, embedding / norm / head included."""
        total = layout.total_bytes
        return self.bytes_for_rank(rank, layout) / total if total else 0.0

    def to_shard_plan(self, layout: ParamLayout, name: str = "zero-shard-map") -> ShardPlan:
        """This map as a ShardPlan over ``layout``.

        balance_bound = P + ceil(B/ws) * Bmax - floor(B/ws) * Bmin, with P the elements of the
        non-block parts (all on their owners), B the number of transformer blocks and Bmax / Bmin
        the largest / smallest block: ranks own floor or ceil of B/ws blocks, so no rank holds more
        than P + ceil * Bmax and none fewer than floor * Bmin.
        """
        ws = self.world_size
        blocks = [b for b in layout.blocks if b.kind == "block"]
        sizes = [layout.block_numel(b) for b in blocks]
        pinned = layout.total_numel - sum(sizes)
        nb = len(blocks)
        bound = pinned + (ceil_div(nb, ws) * max(sizes) - (nb // ws) * min(sizes) if sizes else 0)
        total_bytes = layout.total_bytes
        counts = [0] * ws
        for owner in self.block_owners:
            counts[owner] += 1
        return make_plan(
            name, ws, layout.total_numel, self.intervals_by_rank(layout), [0] * ws, bound,
            notes="whole blocks per rank; embedding/final norm/lm head on their owners (rank 0)",
            block_owners=list(self.block_owners),
            block_fraction=[c / nb if nb else 0.0 for c in counts],
            byte_fraction=[b / total_bytes if total_bytes else 0.0 for b in self.bytes_by_rank(layout)],
        )


@register_partitioner("round-robin", "whole blocks, block i -> rank i % ws; embedding/norm/head on rank 0")
def round_robin_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """ZeroShardMap.round_robin as a ShardPlan; balance bound as in ZeroShardMap.to_shard_plan."""
    ws = check_args(layout, world_size)
    return ZeroShardMap.round_robin(layout.num_transformer_blocks, ws).to_shard_plan(layout, "round-robin")


@register_partitioner("contiguous", "whole blocks in contiguous runs; embedding/norm/head on rank 0")
def contiguous_partition(layout: ParamLayout, world_size: int) -> ShardPlan:
    """ZeroShardMap.contiguous as a ShardPlan; balance bound as in ZeroShardMap.to_shard_plan."""
    ws = check_args(layout, world_size)
    return ZeroShardMap.contiguous(layout.num_transformer_blocks, ws).to_shard_plan(layout, "contiguous")
