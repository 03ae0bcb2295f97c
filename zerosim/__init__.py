"""zerosim: verify and measure ZeRO-style sharded data-parallel training."""

from .errors import ConfigError, ZeroSimError
from .layout import ParamLayout, TensorSpec
from .plan import StatePlan, build_plan
from .presets import PRESETS, GPTConfig
from .strategy import ShardingStrategy, StrategyKind, Topology

__version__ = "0.1.0"

__all__ = [
    "ConfigError", "GPTConfig", "PRESETS", "ParamLayout", "ShardingStrategy", "StatePlan",
    "StrategyKind", "TensorSpec", "Topology", "ZeroSimError", "build_plan",
]

# The seed partitioner's API (OptimizerShard, ZeroShardMap) and the user-facing partition checker.
from .check_impl import PartitionReport, check_partition  # noqa: E402
from .partition.seed import OptimizerShard, ZeroShardMap  # noqa: E402

__all__ += ["OptimizerShard", "PartitionReport", "ZeroShardMap", "check_partition"]
