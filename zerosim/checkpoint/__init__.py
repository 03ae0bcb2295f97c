"""Sharded, reshardable checkpoints of the ZeRO engine's state (format, save / load, offline reshard),
and the rank-0 load of a full state dict (broadcast, each rank keeping its shard).

See docs/checkpoints.md: the format, what makes a save atomic, how a load reshards, C-ZERO-007.
"""

from __future__ import annotations

from .broadcast import BroadcastLoadResult, broadcast_and_shard_state_dict, open_state_dict
from .engine_state import (
    LoadResult,
    SaveResult,
    engine_snapshot,
    load_engine_state,
    load_full_state,
    save_engine_state,
)
from .format import (
    DEFAULT_BLOCK_BYTES,
    INDEX_NAME,
    CheckpointIndex,
    CheckpointReader,
    FileRecord,
    ReadStats,
    read_index,
)
from .resharding import Inspection, ReshardResult, inspect_checkpoint, reshard

__all__ = [
    "BroadcastLoadResult",
    "DEFAULT_BLOCK_BYTES",
    "INDEX_NAME",
    "CheckpointIndex",
    "CheckpointReader",
    "FileRecord",
    "Inspection",
    "LoadResult",
    "ReadStats",
    "ReshardResult",
    "SaveResult",
    "broadcast_and_shard_state_dict",
    "engine_snapshot",
    "inspect_checkpoint",
    "load_engine_state",
    "load_full_state",
    "open_state_dict",
    "read_index",
    "reshard",
    "save_engine_state",
]
