"""What the memory model is asked about: precision, optimizer, offload and prefetch settings.

:class:`MemorySettings` fixes the bytes every element of each model state costs (``params``,
``grads``, ``optimizer_states`` = K), where each state lives (device or host) and how many gathered
units a ZeRO-3 step keeps in flight. The estimate itself is :mod:`zerosim.cost.memory_model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, require_non_negative_int
from ..values.dtypes import SHORT_NAMES
from ..values.strategy import ShardingStrategy
from .comm_model import ZERO1_GRAD_REDUCE


@dataclass(frozen=True)
class PrecisionSpec:
    """Bytes per element of each kind of state under one precision recipe."""

    name: str
    param_bytes: int    # working copy used in forward/backward
    grad_bytes: int     # gradient (accumulation) dtype
    master_bytes: int   # separate fp32 master copy kept with the optimizer (0 when params are fp32)
    state_bytes: int    # bytes of each optimizer state buffer (Adam m, v; SGD momentum)
    description: str


PRECISIONS: dict[str, PrecisionSpec] = {
    "mixed": PrecisionSpec(
        "mixed",
        2,
        2,
        4,
        4,
        "ZeRO paper mixed precision: fp16 params and grads, fp32 master + fp32 optimizer states",
    ),
    "bf16-mixed": PrecisionSpec(
        "bf16-mixed", 2, 2, 4, 4, "bf16 params and grads, fp32 master + fp32 optimizer states"
    ),
    "bf16-fp32grads": PrecisionSpec(
        "bf16-fp32grads",
        2,
        4,
        4,
        4,
        "bf16 params, fp32 gradient accumulation, fp32 master + fp32 optimizer states",
    ),
    "fp16-fp32grads": PrecisionSpec(
        "fp16-fp32grads",
        2,
        4,
        4,
        4,
        "fp16 params, fp32 gradient accumulation, fp32 master + fp32 optimizer states",
    ),
    "fp32": PrecisionSpec("fp32", 4, 4, 0, 4, "everything fp32; the params are the master copy"),
    "bf16-pure": PrecisionSpec(
        "bf16-pure", 2, 2, 0, 2, "pure bf16: params, grads and optimizer states bf16, no master"
    ),
}
# "fp16" / "bf16" name the reference engine's policies (zerosim.numerics.precision): 16-bit params, fp32 grads
_PRECISION_ALIASES = {"paper": "mixed", "fp16-mixed": "mixed", "amp": "mixed", "bf16mixed": "bf16-mixed",
                      "bf16": "bf16-fp32grads", "fp16": "fp16-fp32grads", "bf16-fp32-grads": "bf16-fp32grads",
                      "fp16-fp32-grads": "fp16-fp32grads", "float32": "fp32", "pure-bf16": "bf16-pure"}

#: number of optimizer state buffers per parameter element
OPTIMIZER_STATES: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 0, "sgd-momentum": 1}
_OPTIMIZER_ALIASES = {"sgd_momentum": "sgd-momentum", "sgdm": "sgd-momentum", "momentum": "sgd-momentum"}

OFFLOAD_CHOICES = ("none", "optimizer", "grads+optimizer", "params+optimizer", "params+grads+optimizer")


#: the reference engine's precision policies (zerosim.numerics.precision.Precision) in this model's terms: the
#: engine keeps gradients in float32 (upcast before reduction) and a float32 master when mixed.
ENGINE_PRECISION = {"fp32": "fp32", "bf16": "bf16-fp32grads", "fp16": "fp16-fp32grads"}


def canonical_precision(name: str) -> str:
    """A recipe of :data:`PRECISIONS` by its name or an alias; a plain dtype in either spelling (bfloat16
    or bf16, float32 or fp32: :func:`zerosim.values.dtypes.precision_name`) names the engine's policy of
    it."""
    key = str(name).strip().lower().replace("_", "-")
    key = _PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS and key in SHORT_NAMES:
        key = _PRECISION_ALIASES.get(SHORT_NAMES[key], SHORT_NAMES[key])
    if key not in PRECISIONS:
        raise ConfigError("precision", name, f"unknown precision; known: {', '.join(PRECISIONS)}")
    return key


def canonical_optimizer(name: str) -> str:
    key = str(name).strip().lower()
    key = _OPTIMIZER_ALIASES.get(key, key)
    if key not in OPTIMIZER_STATES:
        raise ConfigError("optimizer", name, f"unknown optimizer; known: {', '.join(OPTIMIZER_STATES)}")
    return key


def parse_offload(text: str | Iterable[str] | None) -> frozenset[str]:
    """``"none"`` | ``"optimizer"`` | ``"params+optimizer"`` | ``"all"`` ... -> the offloaded categories.

    ``optimizer`` means the optimizer state *and* the fp32 master copy (they live together).
    """
    if text is None:
        return frozenset()
    parts = text.replace(",", "+").split("+") if isinstance(text, str) else list(text)
    out: set[str] = set()
    for raw in parts:
        p = str(raw).strip().lower()
        if p in ("", "none"):
            continue
        if p == "all":
            out |= {"params", "grads", "optimizer_states"}
        elif p in ("optimizer", "optimizer_states", "optim", "opt"):
            out.add("optimizer_states")
        elif p in ("params", "param", "parameters"):
            out.add("params")
        elif p in ("grads", "grad", "gradients"):
            out.add("grads")
        else:
            raise ConfigError(
                "offload", text, f"unknown part {raw!r}; use none, optimizer, grads, params joined by '+'"
            )
    return frozenset(out)


def offload_name(parts: frozenset[str]) -> str:
    if not parts:
        return "none"
    order = [("params", "params"), ("grads", "grads"), ("optimizer_states", "optimizer")]
    return "+".join(label for key, label in order if key in parts)


@dataclass(frozen=True)
class MemorySettings:
    """Precision recipe, optimizer, what is offloaded to host memory, and the ZeRO-3 prefetch depth.

    ``grad_bucket_numel``: SHARD_GRAD_OP's transient unsharded gradient; ``None`` = the whole padded
    flat gradient (what the reference engine does).
    ``zero1_grad_reduce``: how ZeRO-1 averages gradients (the engine's ``RunConfig.zero1_grad_reduce``):
    ``"all_reduce"`` (torch ZeroRedundancyOptimizer, default) or ``"reduce_scatter"`` (DeepSpeed
    stage 1), which holds the packed full gradient and the reduced chunk at once (see
    :func:`zerosim.cost.memory_model.transient_phases`).
    """

    precision: str = "mixed"
    optimizer: str = "adamw"
    offload: str = "none"
    prefetch_depth: int = 1
    grad_bucket_numel: int | None = None
    zero1_grad_reduce: str = "all_reduce"

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", canonical_precision(self.precision))
        object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer))
        object.__setattr__(self, "offload", offload_name(parse_offload(self.offload)))
        require_non_negative_int("prefetch_depth", self.prefetch_depth)
        if self.grad_bucket_numel is not None:
            require_non_negative_int("grad_bucket_numel", self.grad_bucket_numel)
        if not isinstance(self.zero1_grad_reduce, str) or self.zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
            raise ConfigError("zero1_grad_reduce", self.zero1_grad_reduce,
                              f"known: {', '.join(ZERO1_GRAD_REDUCE)} (--zero1-reduce)")

    @property
    def spec(self) -> PrecisionSpec:
        return PRECISIONS[self.precision]

    @property
    def offloaded(self) -> frozenset[str]:
        return parse_offload(self.offload)

    @property
    def num_optimizer_states(self) -> int:
        return OPTIMIZER_STATES[self.optimizer]

    @property
    def K(self) -> int:  # noqa: N802 - the paper's name
        """Optimizer-state bytes per parameter (the ZeRO paper's K): master copy + state buffers."""
        return self.spec.master_bytes + self.num_optimizer_states * self.spec.state_bytes

    def optimizer_bytes(self, strategy: ShardingStrategy) -> int:
        """K for ``strategy``: plus a separate master copy when the params are the master (fp32) but
        cannot double as it: ZeRO-1/2 replicate the params while the optimizer steps a shard, and an
        offloaded optimizer steps on the host while the working params stay on the device."""
        extra = 0
        if self.spec.master_bytes == 0:
            split_by_sharding = strategy.shards_optimizer and not strategy.shards_params
            off = self.offloaded
            split_by_offload = "optimizer_states" in off and "params" not in off
            if split_by_sharding or split_by_offload:
                extra = self.spec.param_bytes
        return self.K + extra

    def bytes_per_element(self, strategy: ShardingStrategy | None = None) -> dict[str, int]:
        k = self.K if strategy is None else self.optimizer_bytes(strategy)
        return {"params": self.spec.param_bytes, "grads": self.spec.grad_bytes, "optimizer_states": k}

    def to_json(self) -> dict[str, Any]:
        return {"precision": self.precision, "optimizer": self.optimizer, "offload": self.offload,
                "prefetch_depth": self.prefetch_depth, "grad_bucket_numel": self.grad_bucket_numel,
                "zero1_grad_reduce": self.zero1_grad_reduce,
                "K": self.K, "bytes_per_element": self.bytes_per_element(),
                "precision_description": self.spec.description}
