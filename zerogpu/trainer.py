"""``ZeroTrainer``: zerosim's ZeRO engine around any torch ``nn.Module`` (ZeRO-1/2/3, hybrid, offload).

::

    import torch.distributed as dist
    from zerogpu import ZeroTrainer

    dist.init_process_group("gloo")                      # or "nccl", under torchrun
    trainer = ZeroTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-4), "zero3")
    for inputs, targets in batches:
        loss = trainer.step(inputs, targets)             # model(inputs, targets) -> scalar loss
    weights = trainer.full_parameters()                  # collective: every rank gets full tensors

The forward and backward are the module's (autograd); the flat buffers, the shard plan of the
chosen partitioner, the averaging reduce-scatter / all-reduce, the global-norm clipping, the
optimizer step and the all-gather are :mod:`zerosim.engine.step`'s, the same code the
simulator checks against its ground truth (:mod:`zerogpu.module_engine` says how the two meet).
Strategies: ``"ddp"`` (no sharding), ``"zero1"``, ``"zero2"``, ``"zero3"``, ``"hybrid"`` (ZeRO-3
inside shard groups, replicated across them; ``mesh=(replicas, shard_size)``, a 2-D DeviceMesh, or
``"hybrid_shard:<shard size>"``), ``"hybrid_zero2"``. ``offload=OffloadConfig(...)`` (ZeRO-3
only) keeps the parameter shards on the host tier of :class:`zerogpu.offload.OffloadManager` and
fetches them per unit within a device budget, and steps the master shard, its optimizer state and
its gradient shard with the host tier's optimizer (:mod:`zerogpu.offload_step`; the kernel follows
``optimizer_kernel``: the exact reference by default, torch's fused CPU kernel with ``"fused"``).

Numerics: the optimizer is zerosim's torch.optim-exact SGD / Adam / AdamW (:mod:`zerosim.numerics.optim`)
on a master copy in float32 (float64 for a float64 model; bfloat16 / float16 models train on a
float32 master). Given the same gradients, a step is bitwise equal to the simulator's engine; the
gradients are autograd's, and the reduction order is the communicator's (bitwise equal to the
simulator's rank-order sum at two ranks, within the reordering bound above; see
:mod:`zerogpu.comm`).

It implements the trainer protocol of ``zerosim verify`` (``step``, ``full_parameters``,
``full_optimizer_state``, ``local_shards``, ``save_checkpoint`` / ``load_checkpoint``, plus
``declared_strategy``, ``partition_rule`` and
``resident_bytes`` for C-ZERO-004/005), so ``zerosim verify zerogpu-3`` checks it like any peer.

Why one module of this length: it is the trainer's public face, one class whose constructor validates
and wires every option (layout, strategy, partitioner, offload, kernel) and whose methods are the
verify protocol's; the work each option selects lives in its own module (whole_tensor, offload_step,
module_engine, state_dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerosim.comm.base import DEFAULT_TIMEOUT_S
from zerosim.engine.observation import full_params_view, holdings
from zerosim.engine.rank_state import RankState
from zerosim.errors import ConfigError, require_non_negative_int
from zerosim.numerics.optim import OptimizerSpec
from zerosim.numerics.precision import Precision
from zerosim.numerics.xp import torch_namespace
from zerosim.partition import get_partitioner
from zerosim.values.flat_buffers import build_unit_plan
from zerosim.values.strategy import ShardingStrategy

from .comm import TorchCommunicator
from .comm_setup import hold_job, release_job
from .module_engine import LossFn, module_engine
from .module_run import ModuleRun
from .module_units import UnitSpec, describe_module
from .offload_step import HostTierStep, host_kernel_for
from .optimizer_kernels import OPTIMIZER_KERNELS
from .whole_tensor import (
    DEFAULT_WHOLE_TENSOR_PARTITIONER,
    WholeTensorOptimizer,
    choose_layout,
    gather_tensor_state,
    optimizer_factory,
    rank_tensors,
    whole_tensor_spec,
)

STRATEGY_NAMES = ("ddp", "zero1", "zero2", "zero3", "hybrid", "hybrid_zero2")
#: how a refusal of parameter offload on a GPU begins (``zerosim gpu-check`` reports its offload step skipped)
OFFLOAD_ON_DEVICE_REFUSED = "parameter offload runs on the CPU only"
_DECLARED = {"no_shard": "ddp", "shard_optimizer": "zero1", "shard_grad_op": "zero2", "full_shard": "zero3"}


def default_loss(model: torch.nn.Module, inputs: Any, targets: Any) -> torch.Tensor:
    """``model(inputs, targets)`` (a model that returns its loss), or ``model(inputs)`` without targets."""
    return model(inputs) if targets is None else model(inputs, targets)


def optimizer_spec(optim: Any) -> OptimizerSpec:
    """The :class:`OptimizerSpec` for an ``OptimizerSpec``, the verify protocol's dict, or a torch.optim
    SGD / Adam / AdamW with one parameter group (its hyper-parameters are read; the object is unused)."""
    if isinstance(optim, OptimizerSpec):
        return optim
    if isinstance(optim, Mapping):
        # the protocol's make_optimizer builds a torch optimizer; the flat layout steps zerosim's own
        options = {k: v for k, v in optim.items() if k not in ("name", "make_optimizer")}
        return OptimizerSpec.parse(str(optim.get("name")), **options)
    if isinstance(optim, torch.optim.Optimizer):
        kind = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw"}.get(type(optim))
        if kind is None or len(optim.param_groups) != 1:
            raise ConfigError("optim", type(optim).__name__, "ZeroTrainer steps SGD, Adam or AdamW with one "
                              "parameter group (pass an OptimizerSpec for anything else it supports)")
        g = optim.param_groups[0]
        for flag in ("maximize", "amsgrad", "capturable", "differentiable"):
            if g.get(flag):
                raise ConfigError(f"optim.{flag}", True, "is not supported by zerosim's optimizers")
        lr = float(g["lr"]) if not isinstance(g["lr"], torch.Tensor) else float(g["lr"].item())
        if kind == "sgd":
            return OptimizerSpec("sgd", lr=lr, momentum=g["momentum"], dampening=g["dampening"],
                                 nesterov=g["nesterov"], weight_decay=g["weight_decay"])
        return OptimizerSpec(kind, lr=lr, betas=tuple(g["betas"]), eps=g["eps"],
                             weight_decay=g["weight_decay"])
    raise ConfigError("optim", type(optim).__name__,
                      "must be an OptimizerSpec, a dict or a torch.optim optimizer")


def resolve_strategy(strategy: Any, mesh: Any, world: int) -> ShardingStrategy:
    """The engine strategy for a name (see STRATEGY_NAMES) and an optional ``(replicas, shard)`` mesh."""
    shape = _mesh_shape(mesh)
    if shape is not None and shape[0] * shape[1] != world:
        raise ConfigError("mesh", shape, f"has {shape[0] * shape[1]} ranks but the world has {world}")
    if isinstance(strategy, ShardingStrategy):
        return strategy
    if not isinstance(strategy, str):
        raise ConfigError("strategy", strategy, f"known: {', '.join(STRATEGY_NAMES)}")
    name = strategy.strip().lower()
    if name in ("hybrid", "hybrid_zero2"):
        size = shape[1] if shape is not None else (world // 2 if world % 2 == 0 else world)
        name = f"{'hybrid_shard' if name == 'hybrid' else 'hybrid_shard_zero2'}:{size}"
    elif shape is not None:
        raise ConfigError("mesh", shape,
                          f"a 2-D mesh needs strategy 'hybrid' or 'hybrid_zero2', not {strategy!r}")
    parsed = ShardingStrategy.parse(name)
    if parsed.is_hybrid and world % parsed.shard_group_size(world):
        raise ConfigError("strategy", strategy,
                          f"the shard group size does not divide the world size {world}")
    return parsed


def _mesh_shape(mesh: Any) -> tuple[int, int] | None:
    if mesh is None:
        return None
    shape = tuple(getattr(mesh, "shape", mesh))  # a DeviceMesh or a (replicas, shard size) tuple
    if len(shape) == 1:
        return (1, int(shape[0]))
    if len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ConfigError("mesh", mesh, "must be (replicas, shard size) or a 1-D / 2-D DeviceMesh")
    return (int(shape[0]), int(shape[1]))


class ZeroTrainer:
    """Sharded data-parallel training of ``model`` on the current torch.distributed world (C-ZERO-001..005).

    ``partitioner``: any registered zerosim partitioner (``"fsdp"``: dim-0 chunks per tensor as FSDP2;
    ``"seed"``, ``"deepspeed"``, ``"zero-redundancy"``, or your own). ``units``: which submodules ZeRO-3
    gathers as one (:mod:`zerogpu.module_units`). ``prefetch``: units gathered ahead. ``loss_fn``:
    ``fn(model, inputs, targets) -> loss`` (default: the model returns its loss).
    ``optimizer_kernel``: ``"reference"`` (zerosim's exact optimizer: bitwise equal to the simulator on
    every CPU kernel), ``"torch"`` (torch.optim's default kernel for the device, what a peer's
    ``torch.optim`` optimizer runs), ``"fused"`` (torch's fused kernel) or ``"compiled"`` (the
    reference's operations as one torch.compile'd pass on a device, the reference on the CPU); see
    :mod:`zerogpu.torch_kernels`. With ``offload`` it chooses the host tier's kernel
    (:mod:`zerogpu.offload_step`). ``layout``: ``"auto"`` (the flat even split for torch.optim's SGD,
    Adam and AdamW, whole tensors for any other optimizer), ``"flat"`` or ``"whole-tensor"``; the
    whole-tensor layout's default partitioner is ``zero-redundancy`` (:mod:`zerogpu.whole_tensor`).
    """

    #: every rank's shard of a unit is padded to the shard group's largest (C-ZERO-004 plans it so)
    packed_shards = True

    def __init__(
        self,
        model: torch.nn.Module,
        optim: Any,
        strategy: str | ShardingStrategy = "zero3",
        *,
        partitioner: str | None = None,
        layout: str = "auto",
        mesh: Any = None,
        offload: Any = None,
        units: UnitSpec = None,
        prefetch: int = 1,
        loss_fn: LossFn | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        optimizer_kernel: str = "reference",
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("torch.distributed", "uninitialized",
                              "call torch.distributed.init_process_group (e.g. under torchrun) first")
        described = describe_module(model, units)
        world = dist.get_world_size()
        #: "flat" (the even flat split, elementwise optimizers) or "whole-tensor" (zerogpu.whole_tensor)
        self.layout = choose_layout(layout, optim)
        whole = self.layout == "whole-tensor"
        spec = whole_tensor_spec(optim) if whole else optimizer_spec(optim)
        factory = optimizer_factory(optim) if whole else None
        plan_strategy = resolve_strategy(strategy, mesh, world)
        if partitioner is None:
            partitioner = DEFAULT_WHOLE_TENSOR_PARTITIONER if whole else "fsdp"
        rule = get_partitioner(partitioner)
        require_non_negative_int("prefetch", prefetch)
        if optimizer_kernel not in OPTIMIZER_KERNELS:
            raise ConfigError("optimizer_kernel", optimizer_kernel,
                              f"must be one of {', '.join(OPTIMIZER_KERNELS)}")
        if offload is not None and not plan_strategy.shards_params:
            raise ConfigError("offload", type(offload).__name__,
                              f"parameter offload needs ZeRO-3 or hybrid, not {plan_strategy.name}")
        device = str(described.device)
        if offload is not None and described.device.type != "cpu":
            # the offload manager holds the optimizer state and master on the host tier, but the engine
            # keeps them, its gradient shard and the optimizer step on the model's device
            raise ConfigError("offload", device, f"{OFFLOAD_ON_DEVICE_REFUSED}: on a GPU the engine keeps "
                              "the optimizer state on the device, which offload's host tier cannot hold "
                              "(move the model to the CPU, or train without offload)")
        self.model = model
        self.strategy = plan_strategy
        self.partition_rule = rule.name
        self.declared_strategy = _declared(plan_strategy, world)
        self.comm = TorchCommunicator(device=device, timeout_s=timeout_s)
        unit_plan = build_unit_plan(described.layout, plan_strategy, rule, world)
        whole_optimizer = None
        if factory is not None:
            mine = rank_tensors(described.layout, unit_plan, plan_strategy.shards_optimizer, rule.name,
                                dist.get_rank())
            whole_optimizer = WholeTensorOptimizer(factory, mine)
        #: the whole-tensor layout's optimizer (each owned tensor whole, with its state), else None
        self.whole_optimizer = whole_optimizer
        run = ModuleRun(
            layout=described.layout,
            unit_plan=unit_plan,
            strategy=plan_strategy,
            world_size=world,
            precision=Precision.of_model_dtype(str(described.dtype)),
            spec=spec,
            partitioner=rule.name,
            prefetch=prefetch,
            optimizer_kernel=optimizer_kernel,
        )
        manager = None
        if offload is not None:
            from .offload import OffloadConfig, OffloadManager

            if not isinstance(offload, OffloadConfig):
                raise ConfigError("offload", type(offload).__name__,
                                  "must be a zerogpu.offload.OffloadConfig")
            manager = OffloadManager(offload, device)
        self.offload = manager
        step_optimizer: Any = whole_optimizer
        #: with offload (flat layout): the host tier's step of the engine's shard (zerogpu.offload_step)
        self.host_step: HostTierStep | None = None
        if manager is not None and whole_optimizer is None:
            host_kernel = host_kernel_for(optimizer_kernel)
            if host_kernel is not None:
                step_optimizer = self.host_step = HostTierStep(spec, host_kernel)
        #: this rank's engine state (the simulator's RankState: buffers, optimizer state, communicators)
        #: and the autograd-hook schedule that runs the engine's steps over the model
        self.state, self.schedule = module_engine(self.comm, run, torch_namespace(device), described,
                                                  loss_fn or default_loss, manager, step_optimizer)
        self.described = described
        e = self.state
        #: a master shard apart from the parameters (ZeRO-1/2, mixed precision): one buffer more in C-ZERO-004
        self.master_copy = not (e.master is e.param_shard or e.master is e.params_full)
        self._steps = 0
        hold_job(self.comm.job)  # released by close()
        self._closed = False

    @property
    def engine(self) -> RankState:
        """The earlier name of :attr:`state` (this rank's engine state), kept for existing code."""
        return self.state

    # ---- training ---------------------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any = None) -> float:
        """One optimizer step on this rank's batch (the gradient is the mean over ranks); the local loss."""
        return self._step([(inputs, targets)])

    def step_accumulated(self, micro_batches: Any) -> float:
        """One optimizer step on the mean gradient of this rank's micro-batches (a list of ``(inputs,
        targets)``) over all ranks: the engine's own micro-batch loop (ZeRO-2/3 reduce each micro-batch
        into the shard, NO_SHARD / ZeRO-1 once after the last); the mean local loss."""
        batches = [tuple(b) for b in micro_batches]
        if not batches or any(len(b) != 2 for b in batches):
            raise ConfigError("micro_batches", len(batches),
                              "give a non-empty list of (inputs, targets) pairs")
        return self._step(batches)

    def _step(self, batches: list[Any]) -> float:
        obs = self.schedule.step(self._steps, batches)
        self._steps += 1
        self._grad_norm = float(obs.grad_norm)
        return float(obs.local_loss)

    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step before clipping, as the engine computed and clipped
        with (C-ZERO-008: what the trainer reports equals what it computed)."""
        norm = getattr(self, "_grad_norm", None)
        if norm is None:
            raise ConfigError("last_grad_norm", None, "no step has run yet")
        return norm

    def close(self) -> None:
        """End the trainer: every hook the engine registered on the model is removed (the parameters
        stay views of the engine's buffers; dropping the trainer does the same when the engine is
        collected), and the last open trainer of the process stops the thread that publishes the
        ranks' collective progress (joined, :func:`zerogpu.comm_setup.release_job`). Not collective;
        call it on every rank before ``dist.destroy_process_group()``. A second call does nothing."""
        self.schedule.remove_hooks()
        if not self._closed:
            self._closed = True
            release_job(self.comm.job)

    # ---- the verify protocol: full values, shards, resident bytes ----------------------------------
    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter, full, as this rank computes with it next (collective under ZeRO-3)."""
        flat = self.state.xp.from_numpy(full_params_view(self.state))  # bfloat16 included
        return self._split(flat.to(self.described.device))

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """torch.optim-named state of every parameter, full (collective when the state is sharded)."""
        if self.whole_optimizer is not None:
            return gather_tensor_state(self.whole_optimizer, self.state.layout, self.described.device)
        e = self.state
        arrays = {}
        for name in e.run.spec.state_names:
            arr = e.opt_state[name]
            if e.sharded_optim:
                assert e.shard_comm is not None
                arr = e.assemble_full_state(e.shard_comm.all_gather(arr))
            arrays[name] = self._split(arr)
        step = torch.tensor(float(e.opt_state["step"]), dtype=torch.float32)
        out: dict[str, dict[str, torch.Tensor]] = {}
        for t in e.layout.tensors:
            state = {key: split[t.name] for key, split in arrays.items()}
            if e.run.spec.name != "sgd":
                state["step"] = step.clone()
            out[t.name] = state
        return out

    # ---- checkpoints ------------------------------------------------------------------------------
    def _refuse_whole_tensor_checkpoint(self) -> None:
        if self.whole_optimizer is not None:
            raise NotImplementedError(
                "ZeroTrainer's checkpoints hold the flat layout's optimizer state; the whole-tensor layout "
                "keeps each tensor's state in its owner's torch optimizer, which they do not save")

    def save_checkpoint(self, directory: Any) -> Any:
        """Write the engine's master weights, optimizer state and step counter as a sharded checkpoint
        (:func:`zerosim.checkpoint.save_engine_state`; collective, between steps). The flat layout only."""
        from zerosim.checkpoint import save_engine_state

        self._refuse_whole_tensor_checkpoint()
        return save_engine_state(self.state, directory)

    def load_checkpoint(self, directory: Any, *, strict: bool = True) -> Any:
        """Load a checkpoint saved at any world size and strategy (collective, between steps). The
        engine's arrays are written in place, so the module's parameters (views into them) see the
        loaded values; the step counter resumes from the checkpoint's."""
        from zerosim.checkpoint import load_engine_state

        self._refuse_whole_tensor_checkpoint()
        result = load_engine_state(self.state, directory, strict=strict)
        self.schedule.params_refreshed()
        self._steps = int(self.state.opt_state["step"])
        return result

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        """Half-open ranges of each flattened parameter whose optimizer state this rank owns (C-ZERO-001)."""
        e = self.state
        out: dict[str, list[tuple[int, int]]] = {}
        for t in e.layout.tensors:
            g0, g1 = e.layout.tensor_range(t.name)
            out[t.name] = [(max(a, g0) - g0, min(b, g1) - g0)
                           for a, b, _ in e.owned_pieces if a < g1 and b > g0]
        return out

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank keeps (C-ZERO-004's measured side):
        the engine's live arrays, plus any ZeRO-3 unit buffer allocated right now (none between steps)."""
        held = holdings(self.state)
        whole_state = self.whole_optimizer.state_nbytes() if self.whole_optimizer is not None else 0
        return {
            "params": held["params"].nbytes + self.schedule.unit_resident_bytes(),
            "grads": held["grads"].nbytes,
            "optimizer": held["optimizer"].nbytes + whole_state,
        }

    def memory_stats(self) -> dict[str, Any]:
        """Resident bytes per kind and, with offload, the offload manager's tiers (current and peak)."""
        out: dict[str, Any] = {"resident": self.resident_bytes()}
        if self.offload is not None:
            out["offload"] = self.offload.memory_stats()
        return out

    def _split(self, flat: Any) -> dict[str, torch.Tensor]:
        layout = self.state.layout
        out = {}
        for t in layout.tensors:
            g0, g1 = layout.tensor_range(t.name)
            out[t.name] = flat[g0:g1].reshape(t.shape).clone()
        return out


def _declared(strategy: ShardingStrategy, world: int) -> str | None:
    """The name ``zerosim verify`` judges memory and traffic by (ddp, zero1..3, hybrid:<shard size>);
    None for hybrid ZeRO-2, which verify has no plan for."""
    if strategy.kind.value == "hybrid_shard":
        return f"hybrid:{strategy.shard_group_size(world)}"
    return _DECLARED.get(strategy.kind.value)
