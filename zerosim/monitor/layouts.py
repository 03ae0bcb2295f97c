"""What one rank of a live run holds, read from what its framework exposes (never declared by the user).

A :class:`LiveLayout` lists the tensor pieces the rank holds (each a flat element range of a full
parameter, with the local tensor holding it), the ranges whose optimizer state it owns (C-ZERO-001),
that state (C-ZERO-002's live clauses) and the reduced gradient over the owned elements.

Readers, chosen by :func:`read_layout` from the objects given to the monitor:

* a torch module (plain, DDP-wrapped, or FSDP2 ``fully_shard``-ed: DTensor parameters sharded on
  dim 0 or replicated, a 1-D or 2-D HSDP mesh) with a ``torch.optim`` optimizer: a DTensor's local
  shard is the piece and the owned range, from its placements and local shape; a plain parameter
  is held and owned whole;
* the same module with ``ZeroRedundancyOptimizer``: parameters held whole, owned as the optimizer
  assigned them (``_param_to_rank``), state in its inner optimizer;
* a :class:`zerogpu.trainer.ZeroTrainer`: the engine's full parameters (ZeRO-1/2) or parameter shard
  (ZeRO-3, hybrid), its owned pieces and optimizer state arrays.

DeepSpeed engines have their reader in :mod:`zerosim.monitor.deepspeed`. A layout that cannot be read
raises :class:`~zerosim.errors.ConfigError` naming what was missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError

#: a held gradient piece is named after its parameter with this suffix (replicas of a reduced gradient
#: hold the same bytes too)
GRAD_SUFFIX = ".grad"


@dataclass
class OwnedState:
    """The optimizer state of one owned piece: ``values`` by state name (None: no state kept for it);
    ``numel``: the elements it must cover. ``stepped``: the optimizer steps the piece now (it is in one
    of its parameter groups, needs a gradient and has one), so it must keep state and its step counter
    counts; a frozen parameter, one no group holds yet, or one without a gradient at this step is
    neither expected to keep state nor counted."""

    name: str
    numel: int
    values: dict[str, Any] | None
    stepped: bool = True


@dataclass
class LiveLayout:
    adapter: str
    numels: dict[str, int]
    #: (tensor, start, stop, local tensor): parameter pieces, and reduced-gradient pieces (GRAD_SUFFIX)
    held: list[tuple[str, int, int, torch.Tensor]] = field(default_factory=list)
    owned: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    states: list[OwnedState] = field(default_factory=list)
    grads: list[torch.Tensor] | None = None  # None: the rank holds no gradient now
    #: the flat ranges of each tensor whose gradient ``grads`` holds (None: the owned ranges)
    grad_ranges: dict[str, list[tuple[int, int]]] | None = None
    grad_dtype: str = "float32"
    #: why the framework never shows the monitor its reduced gradient (None: it shows it, or not this step)
    grads_note: str | None = None
    #: (float64 sum of squares, elements) of the reduced gradient over the owned elements, measured by the
    #: framework's reader inside the step when the gradient itself is gone by now (DeepSpeed)
    grad_squares: tuple[float, int] | None = None

    def keys(self) -> dict[str, Any]:
        """The layout without its values: what every rank exchanges once (and again when it changes)."""
        keys = {"adapter": self.adapter, "numels": self.numels,
                "held": [[n, a, b] for n, a, b, _ in self.held],
                "owned": {k: [list(r) for r in v] for k, v in self.owned.items()},
                "names": list(self.numels)}
        if self.grad_ranges is not None:
            keys["grad_ranges"] = {k: [list(r) for r in v] for k, v in self.grad_ranges.items()}
        return keys


def read_layout(model: Any, optimizer: Any) -> LiveLayout:
    """The layout of ``model`` and ``optimizer`` on this rank (see the module docstring)."""
    trainer = model if hasattr(model, "engine") and hasattr(model, "local_shards") else optimizer
    if trainer is not None and hasattr(trainer, "engine") and hasattr(trainer, "local_shards"):
        return _zero_trainer_layout(trainer)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError("model", type(model).__name__,
                          "must be a torch.nn.Module (plain, DDP or FSDP2) or a zerogpu ZeroTrainer")
    module = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
    if optimizer is not None and hasattr(optimizer, "_param_to_rank") and hasattr(optimizer, "optim"):
        return _zero_redundancy_layout(module, optimizer)
    if optimizer is None or not hasattr(optimizer, "state"):
        raise ConfigError("optimizer", type(optimizer).__name__, "must be a torch.optim optimizer")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return _module_layout(module, optimizer, dist.get_rank(), dist.get_world_size())
    return _module_layout(module, optimizer)


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def local_tensor(t: Any) -> torch.Tensor:
    """The tensor holding this rank's elements of ``t``: a DTensor's local tensor (read from the DTensor
    without going through its operator dispatch, which costs more than the rest of a small check),
    ``t`` itself otherwise. The monitor only reads it, never writes it."""
    inner = getattr(t, "_local_tensor", None)
    if inner is not None and type(inner) in (torch.Tensor, torch.nn.Parameter):
        return inner
    return t.to_local() if hasattr(t, "to_local") else t


def dtensor_place(param: Any) -> tuple[int, int, int, int]:
    """(start, stop, replica, replicas) of a DTensor's local piece: its flat element range (dim-0 shards
    and replicas only), and this rank's index among the ranks holding the same piece and how many hold
    it (the piece is replicated over every mesh dimension whose placement is ``Replicate``: HSDP's
    replica groups, every rank of a replicated DTensor). Worked out once per global shape, mesh and
    placements: a placement's type check alone costs more than the rest of reading a parameter."""
    key = (tuple(param.shape), param.device_mesh, tuple(param.placements))
    found = _PLACES.get(key)
    if found is None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        mesh = param.device_mesh
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        replica, replicas = 0, 1
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Replicate):
                replica, replicas = replica * mesh.size(dim) + coordinate[dim], replicas * mesh.size(dim)
            elif not (isinstance(placement, Shard) and placement.dim == 0):
                raise ConfigError("placements", str(param.placements),
                                  "the monitor reads dim-0 shards and replicas only")
        if param.dim() == 0:
            start, stop = 0, 1
        else:
            local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
            row = param.numel() // param.shape[0] if param.shape[0] else 0
            start, stop = offset[0] * row, (offset[0] + local_shape[0]) * row
        found = _PLACES[key] = (start, stop, replica, replicas)
    return found


#: a DTensor's flat range and replica index by (global shape, mesh, placements): never changes for a rank
_PLACES: dict[tuple[Any, ...], tuple[int, int, int, int]] = {}


def _state_of(state: dict[str, Any] | None) -> dict[str, Any] | None:
    return dict(state) if state else None


def stepped_by(optimizer: Any) -> Any:
    """Whether ``optimizer`` steps a parameter now: one of its parameter groups holds it, it needs a
    gradient and has one (torch's optimizers skip a parameter whose gradient is None)."""
    groups = getattr(optimizer, "param_groups", None) or []
    members = {id(p) for group in groups for p in group.get("params", ())}
    return lambda p: id(p) in members and bool(p.requires_grad) and p.grad is not None


def gradient_slice(numel: int, rank: int, world: int) -> tuple[int, int]:
    """The flat range of a replicated gradient of ``numel`` elements whose squares ``rank`` of
    ``world`` sums for the recomputed norm: contiguous near-equal slices, each element in one."""
    return numel * rank // world, numel * (rank + 1) // world


def _module_layout(module: torch.nn.Module, optimizer: Any, rank: int = 0, world: int = 1) -> LiveLayout:
    """A torch module's layout on ``rank`` of ``world``. A rank holds a piece of each parameter (all of a
    plain one, its local shard of a DTensor) and the reduced gradient over it; where several ranks hold
    the same piece (every rank for a plain parameter under DDP, the replica groups of an HSDP shard), they
    hold the same gradient bytes (C-ZERO-003 compares them), so for the norm each sums only its
    :func:`gradient_slice` of the piece (``grad_ranges``): the ranks' slices cover every element once and
    the gradient is read as many times less as the piece has holders."""
    from torch.distributed.tensor import DTensor

    params = list(module.named_parameters())
    is_fsdp = any(isinstance(p, DTensor) for _, p in params)
    layout = LiveLayout("fsdp2" if is_fsdp else "ddp", numels={})
    state = optimizer.state
    stepped = stepped_by(optimizer)
    grads: list[torch.Tensor] = []
    summed: dict[str, list[tuple[int, int]]] = {}
    for name, p in params:
        numel = layout.numels[name] = p.numel()
        if isinstance(p, DTensor):
            start, stop, replica, replicas = dtensor_place(p)
            local = local_tensor(p)
        else:
            start, stop, replica, replicas, local = 0, numel, rank, world, p
        if stop > start:
            layout.held.append((name, start, stop, local))
            layout.owned[name] = [(start, stop)]
            layout.states.append(OwnedState(name, stop - start, _state_of(state.get(p)), stepped(p)))
        else:
            layout.owned[name] = []
        a, b = gradient_slice(stop - start, replica, replicas)
        summed[name] = [(start + a, start + b)] if b > a else []
        grad = p.grad
        if grad is not None and stop > start:
            grad = local_tensor(grad)
            layout.held.append((name + GRAD_SUFFIX, start, stop, grad))
            grads.append(grad.reshape(-1)[a:b])
    if params:
        layout.grad_dtype = dtype_name(local_tensor(params[-1][1]))
    # a parameter without a gradient (frozen, or unused this step) adds nothing to the norm, as in
    # clip_grad_norm_; a rank holding no gradient at all (freed before the check) has none to compare
    layout.grads = grads if any(p.grad is not None for _, p in params) else None
    layout.grad_ranges = summed  # the same whether or not the gradient is held now
    return layout


def _zero_redundancy_layout(module: torch.nn.Module, optimizer: Any) -> LiveLayout:
    import torch.distributed as dist

    rank = dist.get_rank()
    owner_of = optimizer._param_to_rank
    inner = optimizer.optim.state
    layout = LiveLayout("zero-redundancy", numels={})
    grads: list[torch.Tensor] = []
    params = list(module.named_parameters())
    for name, p in params:
        numel = layout.numels[name] = p.numel()
        grad = p.grad
        layout.held.append((name, 0, numel, p))
        if grad is not None:
            layout.held.append((name + GRAD_SUFFIX, 0, numel, grad))
        if owner_of.get(p) != rank:
            layout.owned[name] = []
            continue
        layout.owned[name] = [(0, numel)]
        layout.states.append(OwnedState(name, numel, _state_of(inner.get(p)),
                                        bool(p.requires_grad) and grad is not None))
        if grad is not None:
            grads.append(grad)
    if params:
        layout.grad_dtype = dtype_name(params[-1][1])
    layout.grads = grads if any(p.grad is not None for _, p in params) else None
    return layout


def _zero_trainer_layout(trainer: Any) -> LiveLayout:
    e = trainer.state
    layout = LiveLayout(f"zerogpu-{trainer.strategy.name}",
                        numels={t.name: t.numel for t in e.layout.tensors})
    ranges = {t.name: e.layout.tensor_range(t.name) for t in e.layout.tensors}
    if e.params_full is not None:
        for name, (g0, g1) in ranges.items():
            layout.held.append((name, 0, g1 - g0, e.params_full[g0:g1]))
    else:
        for a, b, pos in e.owned_pieces:
            for name, (g0, g1) in ranges.items():
                lo, hi = max(a, g0), min(b, g1)
                if lo < hi:
                    layout.held.append((name, lo - g0, hi - g0, e.param_shard[pos + lo - a: pos + hi - a]))
    layout.owned = {name: list(r) for name, r in trainer.local_shards().items()}
    names = [n for n in e.run.spec.state_names]
    for a, b, pos in e.owned_pieces:
        for name, (g0, g1) in ranges.items():
            lo, hi = max(a, g0), min(b, g1)
            if lo < hi:
                values: dict[str, Any] = {k: e.opt_state[k][pos + lo - a: pos + hi - a] for k in names}
                if names:
                    values["step"] = int(e.opt_state["step"])
                layout.states.append(OwnedState(name, hi - lo, values or None))
    layout.grad_dtype = dtype_name(e.master)
    layout.grads = None
    layout.grads_note = "the zerogpu engine reduces, clips and consumes its gradient inside its step"
    return layout
