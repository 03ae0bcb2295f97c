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

Mixed precision (``optim["mixed_precision"]``) maps onto zerosim's own policy
(:mod:`zerosim.numerics.precision`): the model is cast to ``param_dtype`` (bfloat16) before the engine is
built, which makes the engine keep float32 master shards, upcast every gradient to float32 before reducing
and accumulating it, and cast the stepped masters down into the working parameters.
:class:`MixedZeroTrainer` then writes the float32 values the model arrived with into the master shards
(the engine would otherwise start from the bfloat16-rounded ones) and returns the masters from
``full_parameters()``. What the engine cannot do is refused with the reason (NotImplementedError:
verify reports the phase unsupported): float16 (no dynamic loss scaling in zerosim's precision
policy) and a ``reduce_dtype`` other than float32 (its reductions are always in the master dtype).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from zerogpu.trainer import ZeroTrainer

from ._mixed_precision import MixedPolicy, mixed_policy, without_policy
from .fsdp2 import hybrid_mesh_shape

Factory = Callable[..., ZeroTrainer]


class MixedZeroTrainer(ZeroTrainer):
    """ZeroTrainer on a ``param_dtype`` model whose float32 masters start from the float32 model
    (see the module docstring); ``full_parameters()`` returns the masters."""

    def __init__(self, model: torch.nn.Module, optim: dict[str, Any], strategy: str, policy: MixedPolicy,
                 **options: Any):
        refuse_unsupported(policy)
        masters = {name: p.detach().to(torch.float32, copy=True) for name, p in model.named_parameters()}
        model.to(policy.param_dtype)
        super().__init__(model, without_policy(optim), strategy, **options)
        self._write_masters(masters)

    @torch.no_grad()
    def _write_masters(self, masters: dict[str, torch.Tensor]) -> None:
        """This rank's pieces of the float32 values into the engine's master shard."""
        e = self.state
        flat = torch.empty(e.layout.total_numel, dtype=torch.float32)
        for t in e.layout.tensors:
            g0, g1 = e.layout.tensor_range(t.name)
            flat[g0:g1] = masters[t.name].reshape(-1).cpu()
        for g0, g1, pos in e.owned_pieces:
            e.master[pos:pos + g1 - g0] = flat[g0:g1].to(e.master.device)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """The float32 masters, full (collective when they are sharded)."""
        e = self.state
        arr = e.master
        if e.sharded_optim:
            assert e.shard_comm is not None
            arr = e.assemble_full_state(e.shard_comm.all_gather(arr))
        return self._split(arr)


def refuse_unsupported(policy: MixedPolicy) -> None:
    """NotImplementedError with the reason for what zerosim's precision policy cannot do."""
    if policy.param_dtype != torch.bfloat16:
        raise NotImplementedError(
            f"zerogpu cannot train in {policy.param_name}: zerosim's precision policy has no dynamic loss "
            "scaling, so float16 gradients that underflow would stay underflowed")
    if policy.reduce_dtype != torch.float32:
        raise NotImplementedError(
            f"zerogpu cannot reduce gradients in {policy.reduce_name}: its engine upcasts every gradient to "
            "the float32 master dtype before reducing it")


def _trainer(model: torch.nn.Module, optim: dict[str, Any], strategy: str, **options: Any) -> ZeroTrainer:
    policy = mixed_policy(optim)
    if policy is None:
        return ZeroTrainer(model, optim, strategy, **options)
    return MixedZeroTrainer(model, optim, strategy, policy, **options)


def make_zero1_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return _trainer(model, optim, "zero1", **options)


def make_zero2_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return _trainer(model, optim, "zero2", **options)


def make_zero3_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    return _trainer(model, optim, "zero3", **options)


def make_hybrid_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    """HSDP on ``optim["mesh"]`` = (replicas, shard group size) when the run names one, else the default."""
    optim = dict(optim)
    mesh = optim.pop("mesh", None)
    shape = tuple(mesh) if mesh is not None else hybrid_mesh_shape(dist.get_world_size())
    return _trainer(model, optim, "hybrid", mesh=shape, **options)


def make_offload_trainer(model: torch.nn.Module, optim: dict[str, Any], **options: Any) -> ZeroTrainer:
    from zerogpu.module_units import describe_module
    from zerogpu.offload import OffloadConfig

    world = dist.get_world_size()
    described = describe_module(model)
    policy = mixed_policy(optim)
    itemsize = policy.param_dtype.itemsize if policy is not None else next(model.parameters()).element_size()
    shard_bytes = sorted((-(-sum(described.layout.tensors[i].numel for i in b.tensor_indices) // world) + 64)
                         * itemsize for b in described.layout.blocks)
    budget = sum(shard_bytes[-2:])
    offload = OffloadConfig(device_budget_bytes=budget, prefetch_depth=1)
    return _trainer(model, optim, "zero3", offload=offload, **options)


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
