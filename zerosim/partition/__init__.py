"""Partitioners: the peers' rules for splitting parameters over ranks, each producing a ShardPlan."""

from __future__ import annotations

import importlib

from ._common import MAX_INTERVALS, MAX_WORLD_SIZE
from .base import PARTITIONERS, RankShard, ShardPlan, get_partitioner, register_partitioner

# Built-in partitioner modules; each registers itself with ``register_partitioner`` on import.
_BUILTIN_MODULES = ("seed", "deepspeed", "fsdp", "zero_redundancy")


def _import_builtins() -> None:
    for mod in _BUILTIN_MODULES:
        try:
            importlib.import_module(f"{__name__}.{mod}")
        except ModuleNotFoundError as e:  # pragma: no cover - only while a module is being written
            if e.name != f"{__name__}.{mod}":
                raise


_import_builtins()
_load_builtin = True

__all__ = ["MAX_INTERVALS", "MAX_WORLD_SIZE", "PARTITIONERS", "RankShard", "ShardPlan", "get_partitioner",
           "register_partitioner"]
