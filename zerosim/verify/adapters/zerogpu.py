"""``zerogpu-1``, ``zerogpu-2``, ``zerogpu-3``, ``zerogpu-hybrid``, ``zerogpu-3-offload``: zerosim's own
engine around the verify model (:class:`zerogpu.trainer.ZeroTrainer`).

The trainer already speaks the verify protocol; these factories only choose the strategy. Every
element of the model's ``blocks`` list is a ZeRO-3 unit, the rest (embeddings, final norm, head)
the root unit, with FSDP2's partition rule (``fsdp``: dim-0 chunks per tensor). ``zerogpu-hybrid``
uses the mesh FSDP2's hybrid adapter uses: ``optim["mesh"]`` when the run names one (``--mesh RxS``),
else ``(2, N/2)`` at even world sizes, ``(1, N)`` at odd ones.
``zerogpu-3-offload`` keeps the parameter shards on the offload manager's host tier with a device
budget of the two largest units' shards, so eviction and prefetch both run every step.

Each has a ``-native`` variant (``zerogpu-3-native``, ...): the same trainer stepping its optimizer
shard with torch.optim's own kernel (``optimizer_kernel="torch"``) instead of zerosim's exact
reference optimizer, which is what a peer's ``torch.optim`` optimizer runs. The variants are
runnable by name but are not part of ``verify --all``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerogpu.trainer import ZeroTrainer

from .fsdp2 import hybrid_mesh_shape

Factory = Callable[..., ZeroTrainer]


def make_zero1_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return ZeroTrainer(model, optim, "zero1", **options)


def make_zero2_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return ZeroTrainer(model, optim, "zero2", **options)


def make_zero3_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return ZeroTrainer(model, optim, "zero3", **options)


def make_hybrid_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    """HSDP on ``optim["mesh"]`` = (replicas, shard group size) when the run names one, else the default."""
    optim = dict(optim)
    mesh = optim.pop("mesh", None)
    shape = tuple(mesh) if mesh is not None else hybrid_mesh_shape(dist.get_world_size())
    return ZeroTrainer(model, optim, "hybrid", mesh=shape, **options)


def make_offload_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    from zerogpu.module_units import describe_module
    from zerogpu.offload import OffloadConfig

    world = dist.get_world_size()
    described = describe_module(model)
    itemsize = next(model.parameters()).element_size()
    shard_bytes = sorted((-(-sum(described.layout.tensors[i].numel for i in b.tensor_indices) // world) + 64)
                         * itemsize for b in described.layout.blocks)
    budget = sum(shard_bytes[-2:])
    offload = OffloadConfig(device_budget_bytes=budget, prefetch_depth=1)
    return ZeroTrainer(model, optim, "zero3", offload=offload, **options)


def _native(factory: Factory) -> Factory:
    """``factory`` with torch.optim's own optimizer kernel (the ``-native`` variants)."""

    def make(model: torch.nn.Module, optim: dict[str, Any]) -> ZeroTrainer:
        return factory(model, optim, optimizer_kernel="torch")

    make.__name__ = f"{factory.__name__}_native"
    return make


make_zero1_native_trainer = _native(make_zero1_trainer)
make_zero2_native_trainer = _native(make_zero2_trainer)
make_zero3_native_trainer = _native(make_zero3_trainer)
make_hybrid_native_trainer = _native(make_hybrid_trainer)
make_offload_native_trainer = _native(make_offload_trainer)
