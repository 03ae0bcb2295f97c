"""The whole-tensor layout: where a run whose optimizer is not elementwise puts its tensors.

An elementwise optimizer (SGD, Adam, AdamW) may step any flat slice of the model, so every partitioner's
even flat split is correct. Muon and Adafactor (:mod:`zerosim.numerics.optim_matrix`) need each tensor whole:
when the optimizer state is sharded over a shard group of more than one rank, every tensor goes
whole, with its state, to one owner rank, which steps it; the gradients are reduced, the norm
summed and the updated parameters gathered exactly as in the flat layout (the unit plan packs
whatever the partitioner owns). :func:`resolve_partitioner` picks the partition rule:

* ``fsdp`` (the run's default partitioner, which cuts tensors) becomes ``zero-redundancy`` (whole
  tensors, largest first, to the least loaded rank; C-ZERO-001's balance bound: the largest tensor);
* ``zero-redundancy``, ``round-robin`` and ``contiguous`` (the seed's ZeroShardMap block maps) are
  used as named; a partitioner that splits a tensor between ranks is refused (ConfigError naming
  the tensor) by :func:`check_whole_tensors`.

``matrix_layout="flat-slices"`` (``RunConfig.extra``, ``zerosim simulate --matrix-layout``) is the
deliberately wrong layout: the named partitioner as it is, every rank stepping its slices of a
tensor as if they were the tensor (:func:`zerosim.numerics.optim_matrix.sliced_slots`). C-ZERO-002 fails it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from ..numerics.optim import OptimizerSpec
from ..numerics.optim_matrix import MatrixOptimizer, sliced_slots, whole_tensor_slots
from ..numerics.xp import ArrayNamespace
from ..partition import get_partitioner
from ..partition.base import RegisteredPartitioner
from ..values.flat_buffers import UnitPlan
from ..values.layout import ParamLayout
from ..values.strategy import ShardingStrategy

#: ``matrix_layout`` values: the correct one first
MATRIX_LAYOUTS = ("whole-tensor", "flat-slices")
#: the partitioner a whole-tensor layout uses in place of the default flat one
WHOLE_TENSOR_PARTITIONER = "zero-redundancy"
#: partitioners that cut tensors, replaced by :data:`WHOLE_TENSOR_PARTITIONER` (the run's default)
REPLACED_DEFAULT = "fsdp"
#: the optimizer options a run takes from ``RunConfig.extra`` (OptimizerSpec's fields of those names):
#: the shared ones, then the matrix optimizers' own
EXTRA_OPTIONS = ("momentum", "weight_decay", "betas", "eps", "nesterov", "dampening", "beta2_decay", "eps1",
                 "d", "ns_coefficients", "ns_steps", "adjust_lr_fn", "adamw_lr", "adamw_betas", "adamw_eps",
                 "adamw_weight_decay")


def matrix_layout(extra: dict[str, Any], spec: OptimizerSpec, xp: str = "numpy") -> str | None:
    """The layout a run asks for (``extra["matrix_layout"]``, default whole-tensor); None for an
    elementwise optimizer, which has none to choose. The matrix optimizers run on numpy arrays only."""
    value = extra.get("matrix_layout", MATRIX_LAYOUTS[0])
    if value not in MATRIX_LAYOUTS:
        raise ConfigError("matrix_layout", value, f"known: {', '.join(MATRIX_LAYOUTS)}")
    if spec.elementwise:
        if "matrix_layout" in extra:
            raise ConfigError("matrix_layout", value, f"applies to muon and adafactor, not {spec.name}")
        return None
    if xp != "numpy":
        raise ConfigError("xp", xp, f"{spec.name} runs in the numpy engine only (--backend sim or mpi); "
                          "zerogpu.ZeroTrainer steps torch.optim's on whole tensors")
    return str(value)


def needs_whole_tensors(spec: OptimizerSpec, strategy: ShardingStrategy, k: int, layout: str | None) -> bool:
    """Whether the run must own whole tensors: a matrix optimizer in the whole-tensor layout whose
    state is sharded over more than one rank."""
    return not spec.elementwise and layout == MATRIX_LAYOUTS[0] and strategy.shards_optimizer and k > 1


def resolve_partitioner(name: str, whole: bool) -> tuple[str, RegisteredPartitioner]:
    """The partition rule (name, rule): the default flat rule becomes the whole-tensor one when ``whole``."""
    name = WHOLE_TENSOR_PARTITIONER if whole and name == REPLACED_DEFAULT else name
    return name, get_partitioner(name)


def check_whole_tensors(layout: ParamLayout, units: UnitPlan, whole: bool = True) -> None:
    """With ``whole``: ConfigError (one line, naming the partitioner and the tensor) when a shard-group
    rank owns part of a tensor."""
    for j in range(units.k if whole else 0):
        whole_tensor_slots(layout, units.owned_global(j), units.partitioner)


def engine_optimizer(run: Any, rank: int, xp: ArrayNamespace) -> Any:
    """The optimizer a rank's engine steps its master shard with: None (the engine's own elementwise
    optimizer) unless the run's optimizer is not elementwise; then a :class:`MatrixOptimizer` over the
    tensors the rank owns whole (every tensor when the state is replicated), or, in the deliberately
    wrong ``flat-slices`` layout, over its slices of them."""
    spec = run.spec
    if spec.elementwise:
        return None
    units = run.unit_plan
    if run.strategy.shards_optimizer:
        pieces = tuple(units.owned_global(rank % run.k))
    else:
        pieces = ((0, run.layout.total_numel, 0),)
    wrong = getattr(run, "matrix_layout", None) == MATRIX_LAYOUTS[1]
    slots = sliced_slots(run.layout, pieces) if wrong else whole_tensor_slots(run.layout, pieces)
    return MatrixOptimizer(spec, slots, xp)
