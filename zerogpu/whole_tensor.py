"""The whole-tensor layout of :class:`zerogpu.trainer.ZeroTrainer`: matrix optimizers on whole tensors.

An elementwise optimizer (torch.optim's SGD, Adam, AdamW) updates each element from that element's
gradient and state alone, so the engine may hand it any flat slice of the model: the even flat
split of every partitioner is correct. Muon orthogonalises each whole 2-D update and Adafactor
factors a matrix's second moment into row and column statistics; on a slice of a tensor they
compute another update. For them the trainer uses the *whole-tensor layout*: the partitioner
places every tensor whole on one rank of its shard group (``zero-redundancy``: whole tensors,
largest first, to the least loaded rank; or the seed's block maps ``round-robin`` and
``contiguous``), the owner steps its tensors, with their state, through the user's torch
optimizer, and the engine's all-gather (or ZeRO-3's per-unit gathers) hands the updated tensors to
every rank. Gradients are reduced and clipped exactly as in the flat layout (C-ZERO-002's full
step on the owned tensors; C-ZERO-001's coverage, now of whole tensors).

:func:`choose_layout` makes the choice at construction (``layout="auto"``: the optimizer's class
decides), :func:`tensor_owners` refuses a partitioner that splits a tensor, and
:class:`WholeTensorOptimizer` is the optimizer the engine calls (``init_state`` / ``step`` on the
flat master shard), stepping views of the master shaped as the tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerosim.errors import ConfigError
from zerosim.numerics.optim import OptimizerSpec, _real
from zerosim.partition.base import ShardPlan
from zerosim.values.flat_buffers import UnitPlan
from zerosim.values.layout import ParamLayout

#: ``layout=`` values of ZeroTrainer
LAYOUTS = ("auto", "flat", "whole-tensor")
#: the optimizers whose update is elementwise (any split of a flat vector gives the same update)
ELEMENTWISE_NAMES = ("sgd", "adam", "adamw")
ELEMENTWISE_CLASSES: tuple[type, ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
#: the partitioner a whole-tensor layout uses unless one is named: whole tensors, balanced greedily
DEFAULT_WHOLE_TENSOR_PARTITIONER = "zero-redundancy"

OptimizerFactory = Callable[[list[torch.Tensor]], Any]


def is_elementwise_optimizer(optim: Any) -> bool:
    """True for an :class:`OptimizerSpec` of sgd / adam / adamw, a dict naming one of them, or an
    instance of exactly torch.optim.SGD / Adam / AdamW; False for anything else (Muon, Adafactor, a
    user's optimizer, a subclass: nothing is assumed about how it combines elements)."""
    if isinstance(optim, OptimizerSpec):
        return optim.elementwise
    if isinstance(optim, Mapping):
        return str(optim.get("name")) in ELEMENTWISE_NAMES
    return type(optim) in ELEMENTWISE_CLASSES


def choose_layout(layout: Any, optim: Any) -> str:
    """``"flat"`` or ``"whole-tensor"`` for ZeroTrainer's ``layout=`` and optimizer: ``"auto"`` takes the
    flat even split for an elementwise optimizer and whole tensors for any other; ``"flat"`` with a
    non-elementwise optimizer is refused (its slices would change the optimizer's math)."""
    if layout not in LAYOUTS:
        raise ConfigError("layout", layout, f"must be one of {', '.join(LAYOUTS)}")
    elementwise = is_elementwise_optimizer(optim)
    if layout == "auto":
        return "flat" if elementwise else "whole-tensor"
    if layout == "flat" and not elementwise:
        raise ConfigError("layout", layout, f"{optimizer_name(optim)} is not elementwise: on flat slices of "
                          "its tensors it computes another update; use layout='whole-tensor' (or 'auto')")
    return str(layout)


def optimizer_name(optim: Any) -> str:
    """A name for messages and for ``spec.name``: the dict's or spec's name, else the class name."""
    if isinstance(optim, (OptimizerSpec, Mapping)):
        return str(optim.name if isinstance(optim, OptimizerSpec) else optim.get("name"))
    return type(optim).__name__


def optimizer_factory(optim: Any) -> OptimizerFactory:
    """``factory(tensors) -> optimizer`` that treats exactly those tensors as ``optim`` treats a model's:
    the verify protocol's ``make_optimizer``, a torch.optim optimizer of one parameter group rebuilt
    with its own hyper-parameters (``defaults``), or torch's class for an :class:`OptimizerSpec`."""
    if isinstance(optim, Mapping):
        make = optim.get("make_optimizer")
        if not callable(make):
            raise ConfigError("optim.make_optimizer", make,
                              f"a whole-tensor layout of {optimizer_name(optim)} needs "
                              "make_optimizer(params) -> optimizer in the dict")
        return make
    if isinstance(optim, OptimizerSpec):
        return _spec_factory(optim)
    if isinstance(optim, torch.optim.Optimizer):
        if len(optim.param_groups) != 1:
            raise ConfigError("optim", type(optim).__name__,
                              f"has {len(optim.param_groups)} parameter groups; the trainer rebuilds it "
                              "over whole tensors from one group's hyper-parameters")
        cls, defaults = type(optim), {k: v for k, v in optim.defaults.items() if k != "params"}
        return lambda tensors: cls(tensors, **defaults)
    raise ConfigError("optim", type(optim).__name__,
                      "must be an OptimizerSpec, a dict or a torch.optim optimizer")


def _spec_factory(spec: OptimizerSpec) -> OptimizerFactory:
    if spec.name == "adafactor":
        return lambda ts: torch.optim.Adafactor(ts, lr=spec.lr, beta2_decay=spec.beta2_decay,
                                                eps=(spec.eps1, spec.eps), d=spec.d,
                                                weight_decay=spec.weight_decay or 0.0)
    if spec.name == "muon":
        raise ConfigError("optim", spec.name, "an OptimizerSpec of muon names a recipe of two optimizers "
                          "(Muon on the 2-D tensors, AdamW on the others); pass the verify protocol's dict "
                          "with make_optimizer(params), or a torch.optim.Muon over 2-D parameters")
    if spec.name == "sgd":
        return lambda ts: torch.optim.SGD(ts, lr=spec.lr, momentum=spec.momentum, dampening=spec.dampening,
                                          nesterov=spec.nesterov, weight_decay=spec.weight_decay or 0.0)
    cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
    return lambda ts: cls(ts, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                          weight_decay=spec.weight_decay or 0.0)


@dataclass(frozen=True)
class WholeTensorSpec(OptimizerSpec):
    """What the engine reads of a whole-tensor run's optimizer: its name, the clip threshold, and no
    flat state arrays (the state lives with the owner's torch optimizer, per tensor)."""

    def __post_init__(self) -> None:
        if self.max_grad_norm is not None:
            v = _real("max_grad_norm", self.max_grad_norm)
            if v <= 0:
                raise ConfigError("max_grad_norm", self.max_grad_norm,
                                  "must be > 0 (or None for no clipping)")
            object.__setattr__(self, "max_grad_norm", v)

    @property
    def state_names(self) -> tuple[str, ...]:
        return ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_grad_norm": self.max_grad_norm, "layout": "whole-tensor"}


def whole_tensor_spec(optim: Any) -> WholeTensorSpec:
    """The engine's spec of a whole-tensor run (name and ``max_grad_norm`` of a dict or spec)."""
    clip = None
    if isinstance(optim, OptimizerSpec):
        clip = optim.max_grad_norm
    elif isinstance(optim, Mapping):
        clip = optim.get("max_grad_norm")
    return WholeTensorSpec(optimizer_name(optim), max_grad_norm=clip)


def tensor_owners(layout: ParamLayout, plan: ShardPlan, partitioner: str) -> dict[str, int]:
    """The shard-group rank that owns each tensor whole under ``plan``; ConfigError (one line) naming
    the first tensor the partitioner splits between ranks or leaves partly unowned."""
    owners: dict[str, int] = {}
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        if not t.numel:
            continue
        g1 = g0 + t.numel
        holders = [(j, s, e) for j in range(plan.world_size) for s, e in plan.shard(j).intervals
                   if s < g1 and e > g0]
        if len(holders) != 1 or holders[0][1] > g0 or holders[0][2] < g1:
            ranks = sorted({j for j, _, _ in holders})
            raise ConfigError("partitioner", partitioner,
                              f"splits tensor {t.name!r} {tuple(t.shape)} between ranks {ranks}; "
                              "a non-elementwise optimizer needs whole tensors "
                              "(zero-redundancy, round-robin or contiguous)")
        owners[t.name] = holders[0][0]
    return owners


@dataclass(frozen=True)
class OwnedTensor:
    """A tensor this rank steps: its name, shape and place in the packed master shard."""

    name: str
    shape: tuple[int, ...]
    position: int
    numel: int


def owned_tensors(layout: ParamLayout, owned_pieces: tuple[tuple[int, int, int], ...]) -> list[OwnedTensor]:
    """The tensors whole inside this rank's owned ``(global start, global end, shard position)`` pieces
    (a partitioner checked by :func:`tensor_owners` gives each tensor whole to one rank)."""
    out = []
    for t, g0 in zip(layout.tensors, layout.offsets, strict=True):
        for a, b, pos in owned_pieces:
            if t.numel and a <= g0 and g0 + t.numel <= b:
                out.append(OwnedTensor(t.name, tuple(t.shape), pos + g0 - a, t.numel))
                break
    return out


def rank_tensors(layout: ParamLayout, unit_plan: UnitPlan, shards_optimizer: bool, partitioner: str,
                 rank: int) -> list[OwnedTensor]:
    """The tensors world rank ``rank`` steps whole (every one when the optimizer state is replicated);
    ConfigError when the partitioner splits a tensor between the ranks of a shard group.

    Positions are read from the unit plan whenever the optimizer state is sharded, a shard group of
    one rank included (hybrid on an ``(R, 1)`` mesh): the shard stores unit after unit, in the units'
    order, which under ZeRO-3 and hybrid is not the global flat order (the root unit first)."""
    if not shards_optimizer:
        return owned_tensors(layout, ((0, layout.total_numel, 0),))
    if unit_plan.k > 1:
        tensor_owners(layout, unit_plan.shard_plan, partitioner)
    return owned_tensors(layout, tuple(unit_plan.owned_global(rank % unit_plan.k)))


def gather_tensor_state(optimizer: WholeTensorOptimizer, layout: ParamLayout,
                        device: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor's torch-named state from its owner, on every rank (collective over the world:
    each rank contributes the tensors it steps; replicas of an owner hold the same values)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, optimizer.tensor_state())
    merged: dict[str, dict[str, torch.Tensor]] = {}
    for held in gathered:
        for name, state in held.items():
            merged.setdefault(name, state)
    return {t.name: {k: v.to(device) for k, v in merged.get(t.name, {}).items()} for t in layout.tensors}


class WholeTensorOptimizer:
    """The engine's optimizer (``init_state(n, dtype)``, ``step(master, grad, state)``) for the
    whole-tensor layout: the owned tensors are views of the flat master shard in their own shapes,
    stepped by ``factory(views)`` (built at the first step, so its state is the owner's alone).
    Padding elements of the shard are never touched."""

    def __init__(self, factory: OptimizerFactory, tensors: list[OwnedTensor]):
        self.factory = factory
        self.tensors = tensors
        self.optimizer: Any = None
        self._master: Any = None
        self.views: dict[str, torch.Tensor] = {}

    def init_state(self, n: int, dtype: str = "float32") -> dict[str, Any]:
        return {"step": 0}

    def _bind(self, master: torch.Tensor) -> None:
        if self._master is master:
            return
        if self._master is not None:
            raise RuntimeError("the engine's master shard was replaced; the optimizer state is bound to it")
        self._master = master
        self.views = {t.name: master[t.position:t.position + t.numel].view(t.shape) for t in self.tensors}
        self.optimizer = self.factory(list(self.views.values())) if self.views else None

    @torch.no_grad()
    def step(self, master: torch.Tensor, grad: torch.Tensor, state: dict[str, Any]) -> None:
        """One step of the owner's optimizer on its whole tensors (``state["step"]`` counts steps)."""
        self._bind(master)
        for t in self.tensors:
            self.views[t.name].grad = grad[t.position:t.position + t.numel].view(t.shape)
        if self.optimizer is not None:
            self.optimizer.step()
        for view in self.views.values():
            view.grad = None
        state["step"] = int(state["step"]) + 1

    def tensor_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The torch-named state of every owned tensor (tensors only, detached copies on the CPU)."""
        held = self.optimizer.state if self.optimizer is not None else {}
        out = {}
        for name, view in self.views.items():
            entries = held.get(view, {})
            out[name] = {k: v.detach().to("cpu", copy=True) for k, v in entries.items() if torch.is_tensor(v)}
        return out

    def state_nbytes(self) -> int:
        """Bytes of the per-element state the owner keeps (0-dim step counters left out, as the flat
        layout's integer step is)."""
        held = self.optimizer.state if self.optimizer is not None else {}
        return sum(v.nbytes for entries in held.values() for v in entries.values()
                   if torch.is_tensor(v) and v.dim() > 0)
