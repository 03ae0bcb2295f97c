"""``fsdp2``, ``fsdp2-grad-op``, ``fsdp2-hybrid``: torch's ``fully_shard`` (FSDP2).

``fully_shard`` is applied to every block of the model (each element of an ``nn.ModuleList``) and
then to the root, so a tied embedding/head stays in one group. Parameters are DTensors sharded on
dim 0 (``torch.chunk``: uneven, padded to the first chunk's size); a rank owns, of each flattened
parameter, the rows of its local shard. Full values are what ``DTensor.full_tensor()`` returns, for
the parameters and for each optimizer state buffer, gathered in one collective per call
(:func:`._full_tensors.full_tensors`).

* ``fsdp2``: parameters resharded after forward and backward (strategy "zero3"). The root is given
  ``reshard_after_forward=True`` explicitly (FSDP2 keeps the root gathered otherwise), so every
  group is gathered twice per step, as the ZeRO-3 schedule of the communication model says.
* ``fsdp2-grad-op``: ``reshard_after_forward=False``: gathered once per step, kept for backward
  (strategy "zero2"; FSDP2 still frees them after backward, so at rest a rank holds a shard).
* ``fsdp2-hybrid``: HSDP on a 2-D mesh (replicate x shard): world ``N`` even -> ``(2, N/2)``,
  odd -> ``(1, N)``. At world 2 that is ``(2, 1)``: two replicas of an unsharded shard group, so
  the replica all-reduce, the part HSDP adds to FSDP, is what runs; world 4 is ``(2, 2)``.
  Strategy ``"hybrid:<shard size>"``. ``optim["mesh"] = (R, S)`` (``--mesh RxS``) replaces the default
  shape, the degenerate ``(N, 1)`` (pure replication) and ``(1, N)`` (pure sharding) included.

Mixed precision (``optim["mixed_precision"]``): every ``fully_shard`` gets
``MixedPrecisionPolicy(param_dtype, reduce_dtype)``. The sharded parameters (the masters) and the
optimizer state stay float32; FSDP2 casts a shard to ``param_dtype`` before all-gathering it (the
gather moves ``param_dtype``), computes and differentiates in ``param_dtype``, casts the unsharded
gradient to ``reduce_dtype`` before the reduce-scatter (and, under HSDP, the replica all-reduce) and
the reduced shard to float32. Under accumulation (``set_requires_gradient_sync(False)``) FSDP2
accumulates the unsharded gradients in ``reduce_dtype`` when it differs from ``param_dtype``
(``FSDPParam.to_accumulated_grad_if_needed``), in ``param_dtype`` when the two are equal. Under
float16 the adapter's :class:`~zerosim.verify.adapters._mixed_precision.DynamicLossScale` scales the
loss and unscales the float32 gradient shards, all ranks deciding together whether to skip the step
(torch.amp.GradScaler checks only the local shard of a DTensor gradient); its state is saved in the
checkpoint as one replicated tensor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..optimizers import is_elementwise
from ..resources import storage_bytes
from ._full_tensors import full_tensors
from ._mixed_precision import MixedPolicy, loss_scale_of, mixed_optimizer_step, mixed_policy
from ._torch_optim import accumulate_backward, build_optimizer, optimizer_state_copy


def hybrid_mesh_shape(world: int) -> tuple[int, int]:
    """(replicas, shard group size) of the HSDP mesh at ``world`` ranks (see the module docstring)."""
    return (2, world // 2) if world % 2 == 0 else (1, world)


def apply_fully_shard(
    model: torch.nn.Module, mesh: DeviceMesh, reshard_after_forward: bool, policy: MixedPolicy | None = None
) -> None:
    """``fully_shard`` each block (every element of every ModuleList), then the root; with the
    protocol's mixed-precision policy as FSDP2's ``MixedPrecisionPolicy`` when there is one."""
    options: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if policy is not None:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                                    reduce_dtype=policy.reduce_dtype)
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, **options)
    fully_shard(model, **options)


def refuse_if_optimizer_raises_on_shards(params: list[Any], optim: dict[str, Any]) -> None:
    """Step the phase's optimizer once on copies of FSDP2's sharded parameters (same DTensor shapes and
    placements, zero gradients, on every rank: collective) and raise NotImplementedError with the
    framework's own error when it cannot (``torch.optim.Adafactor`` raises inside DTensor); the
    parameters themselves are left untouched."""
    copies = []
    for p in params:
        copy = torch.nn.Parameter(p.detach().clone())
        copy.grad = torch.zeros_like(copy)
        copies.append(copy)
    try:
        build_optimizer(copies, optim).step()
    except NotImplementedError as e:
        raise NotImplementedError(f"FSDP2 cannot step {optim.get('name')} on its DTensor shards: "
                                  f"{_first_line(e)}") from e
    except (RuntimeError, ValueError, TypeError, AssertionError) as e:
        raise NotImplementedError(f"FSDP2 cannot step {optim.get('name')} on its DTensor shards: "
                                  f"{type(e).__name__}: {_first_line(e)}") from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def owned_range(param: Any) -> list[tuple[int, int]]:
    """The flattened element range of ``param``'s (a DTensor's) local dim-0 shard here (empty if none)."""
    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    if param.dim() == 0:
        return [(0, 1)]
    row = param.numel() // param.shape[0] if param.shape[0] else 0
    start, rows = offset[0], local_shape[0]
    return [(start * row, (start + rows) * row)] if rows * row else []


class FSDP2Trainer:
    partition_rule = "fsdp"  # torch.chunk on dim 0 per tensor, padded to the first chunk

    def __init__(
        self,
        model: torch.nn.Module,
        optim: dict[str, Any],
        *,
        reshard_after_forward: bool,
        mesh_shape: tuple[int, ...],
        declared_strategy: str,
    ):
        self.model = model
        self.optim = optim
        self.reshard_after_forward = reshard_after_forward
        self.declared_strategy = declared_strategy
        device_type = next(model.parameters()).device.type
        names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
        self.mesh = init_device_mesh(device_type, mesh_shape, mesh_dim_names=names)
        self.policy = mixed_policy(optim)
        self.loss_scale = loss_scale_of(self.policy)
        apply_fully_shard(model, self.mesh, reshard_after_forward, self.policy)
        if not is_elementwise(str(optim.get("name"))):
            refuse_if_optimizer_raises_on_shards(list(model.parameters()), optim)
        self.optimizer = build_optimizer(model.parameters(), optim)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(inputs, targets)
        (loss if self.loss_scale is None else self.loss_scale.scale_loss(loss)).backward()
        self._grad_norm = mixed_optimizer_step(self.model.parameters(), self.optimizer, self.optim,
                                               self.loss_scale)
        return float(loss.detach())

    def step_accumulated(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step on the mean gradient of K micro-batches, FSDP2's way:
        ``set_requires_gradient_sync(False)`` on all but the last (unsharded gradients accumulate
        locally; the last backward reduce-scatters their sum / K). ``fsdp2-grad-op`` also keeps the
        gathered parameters between micro-batches (``set_reshard_after_backward(False)``), so it
        gathers once per step as ZeRO-2 does."""
        self.optimizer.zero_grad(set_to_none=True)
        root: Any = self.model

        def sync(last: bool) -> None:
            root.set_requires_gradient_sync(last)
            if not self.reshard_after_forward:
                root.set_reshard_after_backward(last)

        scale = self.loss_scale.scale_loss if self.loss_scale is not None else None
        try:
            loss = accumulate_backward(self.model, micro_batches, sync, scale_loss=scale)
        finally:
            sync(True)
        self._grad_norm = mixed_optimizer_step(self.model.parameters(), self.optimizer, self.optim,
                                               self.loss_scale)
        return loss

    def last_grad_norm(self) -> float:
        """The total gradient norm before clipping of the last step: what ``clip_grad_norm_`` returned
        (over the DTensor gradients, reduced across the mesh)."""
        return self._grad_norm

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        named = list(self.model.named_parameters())
        return dict(zip([n for n, _ in named], full_tensors([p for _, p in named]), strict=True))

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        keys, values = [], []
        for name, p in self.model.named_parameters():
            state = self.optimizer.state.get(p)
            if state:
                out[name] = {}
                for key, value in optimizer_state_copy(state).items():
                    keys.append((name, key))
                    values.append(value)
        for (name, key), full in zip(keys, full_tensors(values), strict=True):
            out[name][key] = full
        return out

    def local_shards(self) -> dict[str, list[tuple[int, int]]]:
        return {name: owned_range(p) for name, p in self.model.named_parameters()}

    def save_checkpoint(self, directory: Any) -> None:
        """torch.distributed.checkpoint: every rank writes its shards of the model's and the optimizer's
        state dicts (``get_state_dict``) with ``dcp.save``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.loss_scale is not None:
            # every step so far may have overflowed and been skipped: no optimizer state yet, and the
            # skipped gradients still held would stop get_state_dict from creating the empty state
            # that load_checkpoint's fresh trainer creates and expects in the checkpoint
            self.optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.loss_scale is not None:
            state[_LOSS_SCALE_KEY] = _scale_tensor(self.loss_scale.state_dict())
        dcp.save(state, checkpoint_id=str(directory))

    def load_checkpoint(self, directory: Any) -> None:
        """``dcp.load`` into this trainer's own (sharded) state dicts, which reshards from the saved world
        size to this one, then ``set_state_dict``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.loss_scale is not None:
            state[_LOSS_SCALE_KEY] = torch.zeros(len(_SCALE_FIELDS), dtype=torch.float64)
        dcp.load(state, checkpoint_id=str(directory))
        if self.loss_scale is not None:
            self.loss_scale.load_state_dict(dict(zip(_SCALE_FIELDS, state[_LOSS_SCALE_KEY].tolist(),
                                                     strict=True)))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def resident_bytes(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": storage_bytes([*params, *_unsharded_buffers(self.model)]),
            "grads": storage_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": storage_bytes(t for p in params for t in self.optimizer.state.get(p, {}).values()),
        }


_LOSS_SCALE_KEY = "loss_scale"
_SCALE_FIELDS = ("scale", "growth_tracker", "skipped_steps")


def _scale_tensor(state: dict[str, float]) -> torch.Tensor:
    """The loss scale's state as one float64 tensor, the same on every rank (DCP saves it once)."""
    return torch.tensor([float(state[k]) for k in _SCALE_FIELDS], dtype=torch.float64)


def _unsharded_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters FSDP2 still holds (freed storages count 0 bytes)."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        state_of = getattr(module, "_get_fsdp_state", None)
        if state_of is None:
            continue
        group = getattr(state_of(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            out.extend(getattr(fsdp_param, "all_gather_outputs", ()) or ())
    return out


def make_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> FSDP2Trainer:
    return FSDP2Trainer(
        model,
        optim,
        reshard_after_forward=True,
        mesh_shape=(dist.get_world_size(),),
        declared_strategy="zero3",
    )


def make_grad_op_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> FSDP2Trainer:
    return FSDP2Trainer(
        model,
        optim,
        reshard_after_forward=False,
        mesh_shape=(dist.get_world_size(),),
        declared_strategy="zero2",
    )


def make_hybrid_trainer(model: torch.nn.Module, optim: dict[str, Any]) -> FSDP2Trainer:
    mesh = optim.get("mesh")
    replicas, shard = tuple(mesh) if mesh is not None else hybrid_mesh_shape(dist.get_world_size())
    return FSDP2Trainer(
        model,
        optim,
        reshard_after_forward=True,
        mesh_shape=(replicas, shard),
        declared_strategy=f"hybrid:{shard}",
    )
