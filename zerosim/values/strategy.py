"""Sharding strategies (what is sharded, over which group) and the cluster topology.

Ranks are node-major: node ``n`` holds ranks ``[n*k, (n+1)*k)`` for ``k`` ranks per node. A hybrid
strategy shards inside each contiguous group of ``intra_node_size`` ranks and replicates across the
strided groups ``{g*k + local}`` (the FSDP paper's sharding factor F = intra_node_size).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..errors import ConfigError, require_positive_int


class StrategyKind(str, Enum):
    NO_SHARD = "no_shard"                      # DDP: everything replicated, grads all-reduced
    SHARD_OPTIMIZER = "shard_optimizer"        # ZeRO-1: optimizer state sharded
    SHARD_GRAD_OP = "shard_grad_op"            # ZeRO-2: + gradients sharded
    FULL_SHARD = "full_shard"                  # ZeRO-3: + parameters sharded
    HYBRID_SHARD = "hybrid_shard"              # ZeRO-3 inside a node group, replicate across
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"  # ZeRO-2 inside a node group, replicate across


_ALIASES = {
    "ddp": StrategyKind.NO_SHARD, "zero0": StrategyKind.NO_SHARD, "no_shard": StrategyKind.NO_SHARD,
    "zero1": StrategyKind.SHARD_OPTIMIZER, "shard_optimizer": StrategyKind.SHARD_OPTIMIZER,
    "zero2": StrategyKind.SHARD_GRAD_OP, "shard_grad_op": StrategyKind.SHARD_GRAD_OP,
    "zero3": StrategyKind.FULL_SHARD, "full_shard": StrategyKind.FULL_SHARD,
    "hybrid_shard": StrategyKind.HYBRID_SHARD, "hsdp": StrategyKind.HYBRID_SHARD,
    "hybrid_shard_zero2": StrategyKind.HYBRID_SHARD_ZERO2,
}


@dataclass(frozen=True)
class ShardingStrategy:
    """A strategy value. Hybrid kinds carry ``intra_node_size`` (the shard group size)."""

    kind: StrategyKind
    intra_node_size: int | None = None

    def __post_init__(self) -> None:
        if self.is_hybrid:
            if self.intra_node_size is None:
                raise ConfigError("intra_node_size", None, f"{self.kind.value} needs the shard group size")
            require_positive_int("intra_node_size", self.intra_node_size)
        elif self.intra_node_size is not None:
            raise ConfigError(
                "intra_node_size",
                self.intra_node_size,
                f"only hybrid strategies take it, not {self.kind.value}",
            )

    # constructors mirroring torch's enum names
    @classmethod
    def hybrid_shard(cls, intra_node_size: int) -> ShardingStrategy:
        return cls(StrategyKind.HYBRID_SHARD, intra_node_size)

    @classmethod
    def hybrid_shard_zero2(cls, intra_node_size: int) -> ShardingStrategy:
        return cls(StrategyKind.HYBRID_SHARD_ZERO2, intra_node_size)

    @classmethod
    def parse(cls, text: str, ranks_per_node: int | None = None) -> ShardingStrategy:
        """Parse ``zero3``, ``FULL_SHARD``, ``hybrid_shard:8`` ... (hybrid size defaults to ranks_per_node).
        """
        raw = str(text)
        name, _, size = raw.strip().lower().replace("-", "_").partition(":")
        kind = _ALIASES.get(name)
        if kind is None:
            raise ConfigError("strategy", raw, f"unknown strategy; known: {', '.join(sorted(_ALIASES))}")
        if kind in (StrategyKind.HYBRID_SHARD, StrategyKind.HYBRID_SHARD_ZERO2):
            if size:
                try:
                    n = int(size)
                except ValueError:
                    raise ConfigError("strategy", raw, "hybrid size after ':' must be an integer") from None
            elif ranks_per_node is not None:
                n = ranks_per_node
            else:
                raise ConfigError(
                    "strategy",
                    raw,
                    "hybrid strategies need a shard group size: 'hybrid_shard:8' or --ranks-per-node",
                )
            return cls(kind, n)
        if size:
            raise ConfigError("strategy", raw, f"{kind.value} takes no ':size'")
        return cls(kind)

    @property
    def name(self) -> str:
        return self.kind.value if not self.is_hybrid else f"{self.kind.value}:{self.intra_node_size}"

    def __str__(self) -> str:
        return self.name

    @property
    def is_hybrid(self) -> bool:
        return self.kind in (StrategyKind.HYBRID_SHARD, StrategyKind.HYBRID_SHARD_ZERO2)

    @property
    def zero_stage(self) -> int:
        return {
            StrategyKind.NO_SHARD: 0,
            StrategyKind.SHARD_OPTIMIZER: 1,
            StrategyKind.SHARD_GRAD_OP: 2,
            StrategyKind.FULL_SHARD: 3,
            StrategyKind.HYBRID_SHARD: 3,
            StrategyKind.HYBRID_SHARD_ZERO2: 2,
        }[self.kind]

    @property
    def shards_optimizer(self) -> bool:
        return self.zero_stage >= 1

    @property
    def shards_grads(self) -> bool:
        return self.zero_stage >= 2

    @property
    def shards_params(self) -> bool:
        return self.zero_stage >= 3

    def shard_group_size(self, world_size: int) -> int:
        """Ranks one copy of the model state is sharded over (1 for NO_SHARD: nothing is split)."""
        if self.kind is StrategyKind.NO_SHARD:
            return 1
        if self.is_hybrid:
            assert self.intra_node_size is not None
            if world_size % self.intra_node_size:
                raise ConfigError(
                    "intra_node_size", self.intra_node_size, f"must divide world_size={world_size}"
                )
            return self.intra_node_size
        return world_size


NO_SHARD = ShardingStrategy(StrategyKind.NO_SHARD)
SHARD_OPTIMIZER = ShardingStrategy(StrategyKind.SHARD_OPTIMIZER)
SHARD_GRAD_OP = ShardingStrategy(StrategyKind.SHARD_GRAD_OP)
FULL_SHARD = ShardingStrategy(StrategyKind.FULL_SHARD)
ALL_KINDS = tuple(StrategyKind)


@dataclass(frozen=True)
class Topology:
    """World size and ranks per node; derives shard groups and replicate groups for a strategy."""

    world_size: int
    ranks_per_node: int | None = None

    def __post_init__(self) -> None:
        require_positive_int("world_size", self.world_size)
        rpn = self.world_size if self.ranks_per_node is None else self.ranks_per_node
        object.__setattr__(self, "ranks_per_node", rpn)
        require_positive_int("ranks_per_node", rpn)
        if self.world_size % rpn:
            raise ConfigError(
                "ranks_per_node", self.ranks_per_node, f"must divide world_size={self.world_size}"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.rpn

    @property
    def rpn(self) -> int:
        assert self.ranks_per_node is not None
        return self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.rpn

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def shard_groups(self, strategy: ShardingStrategy) -> list[list[int]]:
        """Contiguous groups of ranks that together hold one copy of the sharded state."""
        k = strategy.shard_group_size(self.world_size)
        return [list(range(g * k, (g + 1) * k)) for g in range(self.world_size // k)]

    def replicate_groups(self, strategy: ShardingStrategy) -> list[list[int]]:
        """Strided groups of ranks that hold identical shards (same local index in each shard group)."""
        k = strategy.shard_group_size(self.world_size)
        return [list(range(local, self.world_size, k)) for local in range(k)]

    def shard_group_of(self, rank: int, strategy: ShardingStrategy) -> tuple[int, int]:
        """(group index, local rank inside the shard group)."""
        k = strategy.shard_group_size(self.world_size)
        return rank // k, rank % k
