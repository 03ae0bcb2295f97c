"""RunConfig: one simulated training run, validated completely before anything runs.

``RunConfig`` is a frozen value that travels: :meth:`RunConfig.to_json` / :meth:`RunConfig.from_json`
turn it into plain JSON and back (what a launcher writes for its ranks, :mod:`zerosim.engine.run_file`),
and loading checks every field's type and value (one-line ConfigError naming the field).
``RunConfig.resolve()`` turns it into a :class:`ResolvedRun` (model config, layout, strategy,
topology, optimizer spec, precision, the unit plan every rank shards by). Every bad input raises
:class:`~zerosim.errors.ConfigError` naming the field and the value, before any rank starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from typing import Any

from ..comm.sim import SCHEDULES
from ..cost.comm_model import ZERO1_GRAD_REDUCE
from ..errors import ConfigError, require_non_negative_int, require_positive_int
from ..numerics.model import SimModelConfig, sim_layout
from ..numerics.optim import OptimizerSpec
from ..numerics.precision import Precision
from ..partition import get_partitioner
from ..partition.base import RegisteredPartitioner
from ..partition.mutations import mutate
from ..values.flat_buffers import UnitPlan, build_unit_plan
from ..values.layout import ParamLayout
from ..values.plan import StatePlan, build_plan
from ..values.presets import PRESETS, require_simulator_preset, simulator_presets
from ..values.run_value import RunValue
from ..values.strategy import ShardingStrategy, StrategyKind, Topology
from . import matrix_layout as whole_tensor
from .fault_catalog import FAULTS, refusal
from .injection import NanInjection, resolve_injection

__all__ = ["NanInjection", "ResolvedRun", "RunConfig"]

OBSERVE_LEVELS = ("full", "digest", "none", "auto")
XP_NAMES = ("numpy", "torch")
LOAD_MODES = ("seed", "broadcast")
AUTO_FULL_LIMIT = 20_000_000    # world * steps * params above which "auto" keeps digests of gathered weights
AUTO_VALUES_LIMIT = 30_000_000  # steps * params above which "auto" keeps no shard values (C-ZERO-002 skipped)
#: The largest world size a run is configured for: every rank runs its own engine (a thread, or a
#: process); 1024 ranks of ``tiny`` take under a minute for 3 steps on two cores, time about linear in
#: the ranks (``zerosim bench scale``).
MAX_SIM_WORLD_SIZE = 1024
#: Bounds on the work of one run, measured on two cores: about 1e10 model flop/s (6 x params x tokens)
#: and about 6 ms of per-micro-batch bookkeeping per rank; each limit is about an hour there.
MAX_SIM_FLOP = 36_000_000_000_000
MAX_SIM_RANK_MICRO_STEPS = 600_000


@dataclass(frozen=True)
class RunConfig(RunValue):
    """One run of the reference engine. Strings are parsed by :meth:`resolve` (``strategy="hybrid_shard:2"``).
    """

    model: str | SimModelConfig = "tiny"
    world_size: int = 4
    strategy: str | ShardingStrategy = "full_shard"
    partitioner: str = "fsdp"
    optimizer: str | OptimizerSpec = "adamw"
    precision: str = "fp32"
    steps: int = 3
    micro_batches: int = 1
    seed: int = 0
    ranks_per_node: int | None = None
    lr: float | None = None
    max_grad_norm: float | None = 1.0
    batch_size: int | None = None
    seq_len: int | None = None
    offload: bool = False
    prefetch: int = 0
    timeout_s: float = 60.0
    schedule: str = "serial"
    observe: str = "auto"
    inject_nan: dict[str, Any] | NanInjection | None = None
    fault: str | None = None
    #: Initial weights: built from the seed on every rank ("seed"), or built on rank 0 only and
    #: broadcast tensor by tensor, each rank keeping its shard ("broadcast": the rank-0 load path).
    load: str = "seed"
    #: After this step (0-based), save the full state dict (every shard all-gathered and assembled by
    #: the plan) and load it back at the same world size; None: never.
    reshard_at: int | None = None
    xp: str = "numpy"
    #: How ZeRO-1 averages the gradient: "all_reduce" of the full flat gradient (torch's
    #: ZeroRedundancyOptimizer; default) or "reduce_scatter" into the rank's shard (DeepSpeed stage 1
    #: with ``reduce_scatter: true``; the ZeRO paper's P_os, 2(N-1)/N Psi). Other strategies ignore it.
    zero1_grad_reduce: str = "all_reduce"
    extra: dict[str, Any] = field(default_factory=dict)

    WHAT = "run config"

    def validate(self) -> ResolvedRun:
        """Check everything (raises ConfigError naming the field); returns the resolved run."""
        return self.resolve()

    def resolve(self) -> ResolvedRun:
        return ResolvedRun(self)

    def to_json(self) -> dict[str, Any]:
        """The config as JSON-native values (objects become their dicts or names); :meth:`from_json`
        reads it back."""
        d = asdict(self)
        for k in ("model", "strategy", "optimizer"):
            v = getattr(self, k)
            if isinstance(v, SimModelConfig):
                d[k] = asdict(v)
            elif isinstance(v, ShardingStrategy):
                d[k] = v.name
            elif isinstance(v, OptimizerSpec):
                d[k] = v.to_dict()
        if isinstance(self.inject_nan, NanInjection):
            d["inject_nan"] = asdict(self.inject_nan)
        return d

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> RunConfig:
        """The config these fields (a dict as :meth:`to_json` writes it) describe, validated: a value of
        the wrong JSON type or an invalid run raises a ConfigError naming the field (an unknown field:
        :meth:`~zerosim.values.run_value.RunValue.from_json`). A model or optimizer given as a dict becomes a
        SimModelConfig / OptimizerSpec."""
        for key, value in data.items():
            allowed = _JSON_TYPES[key]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                names = " or ".join(_JSON_NAMES[t] for t in allowed)
                raise ConfigError(key, value, f"expected {names}")
        values = dict(data)
        if isinstance(values.get("model"), dict):
            values["model"] = _from_dict(SimModelConfig, "model", values["model"])
        if isinstance(values.get("optimizer"), dict):
            spec = dict(values["optimizer"])
            if isinstance(spec.get("betas"), list):
                spec["betas"] = tuple(spec["betas"])
            values["optimizer"] = _from_dict(OptimizerSpec, "optimizer", spec)
        cfg = cls(**values)
        cfg.validate()
        return cfg


_JSON_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true/false", dict: "an object",
               type(None): "null"}
_INT, _OPT_INT, _NUM, _OPT_NUM = (int,), (int, type(None)), (int, float), (int, float, type(None))
#: RunConfig field -> the JSON types its value may have (checked before the run is resolved)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str, dict), "world_size": _INT, "strategy": (str,), "partitioner": (str,),
    "optimizer": (str, dict), "precision": (str,), "steps": _INT, "micro_batches": _INT, "seed": _INT,
    "ranks_per_node": _OPT_INT, "lr": _OPT_NUM, "max_grad_norm": _OPT_NUM, "batch_size": _OPT_INT,
    "seq_len": _OPT_INT, "offload": (bool,), "prefetch": _INT, "timeout_s": _NUM, "schedule": (str,),
    "observe": (str,), "inject_nan": (dict, type(None)), "fault": (str, type(None)), "load": (str,),
    "reshard_at": _OPT_INT, "xp": (str,), "zero1_grad_reduce": (str,), "extra": (dict,),
}


def _from_dict(kind: Any, field_name: str, values: dict[str, Any]) -> Any:
    """``kind(**values)`` for a model / optimizer given as a JSON object; unknown keys: ConfigError."""
    known = {f.name for f in fields(kind)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"{field_name}.{unknown[0]}", values[unknown[0]],
                          f"unknown; known: {', '.join(sorted(known))}")
    try:
        return kind(**values)
    except TypeError as e:
        raise ConfigError(field_name, values, str(e)) from None


class ResolvedRun:
    """A validated RunConfig with every derived value the ranks need (shared read-only in the simulator)."""

    def __init__(self, cfg: RunConfig):
        if not isinstance(cfg, RunConfig):
            raise ConfigError("config", type(cfg).__name__, "expected a RunConfig")
        self.cfg = cfg
        self.world_size = require_positive_int("world_size", cfg.world_size)
        if self.world_size > MAX_SIM_WORLD_SIZE:
            raise ConfigError("world_size", self.world_size,
                              f"at most {MAX_SIM_WORLD_SIZE} ranks: every rank runs its own engine in this "
                              "process (tiny at 1024 ranks takes about a minute on two cores, and time grows "
                              "with the ranks); zerosim plan and memory model larger worlds")
        self.steps = require_positive_int("steps", cfg.steps)
        self.micro_batches = require_positive_int("micro_batches", cfg.micro_batches)
        self.seed = require_non_negative_int("seed", cfg.seed)
        self.prefetch = require_non_negative_int("prefetch", cfg.prefetch)
        if (
            not isinstance(cfg.timeout_s, (int, float))
            or isinstance(cfg.timeout_s, bool)
            or not cfg.timeout_s > 0
        ):
            raise ConfigError("timeout_s", cfg.timeout_s, "must be a positive number of seconds")
        if cfg.schedule not in SCHEDULES:
            raise ConfigError("schedule", cfg.schedule, f"known: {', '.join(SCHEDULES)}")
        if cfg.observe not in OBSERVE_LEVELS:
            raise ConfigError("observe", cfg.observe, f"known: {', '.join(OBSERVE_LEVELS)}")
        if cfg.xp not in XP_NAMES:
            raise ConfigError("xp", cfg.xp, f"known: {', '.join(XP_NAMES)}")
        if not isinstance(cfg.offload, bool):
            raise ConfigError("offload", cfg.offload, "must be true or false")
        if not isinstance(cfg.zero1_grad_reduce, str) or cfg.zero1_grad_reduce not in ZERO1_GRAD_REDUCE:
            raise ConfigError(
                "zero1_grad_reduce",
                cfg.zero1_grad_reduce,
                f"known: {', '.join(ZERO1_GRAD_REDUCE)} (--zero1-reduce)",
            )
        self.zero1_grad_reduce = cfg.zero1_grad_reduce
        self.model_cfg = _model_config(cfg)
        self.layout: ParamLayout = sim_layout(self.model_cfg)
        self._refuse_unbounded_work()
        self.strategy = _strategy(cfg)
        if cfg.ranks_per_node is not None:
            require_positive_int("ranks_per_node", cfg.ranks_per_node)
        if self.strategy.is_hybrid:
            k = self.strategy.intra_node_size
            assert k is not None
            if self.world_size % k:
                raise ConfigError("strategy", self.strategy.name,
                                  f"the shard group size {k} does not divide world_size={self.world_size}")
        try:
            self.topology = Topology(
                self.world_size, cfg.ranks_per_node or _default_rpn(self.strategy, self.world_size)
            )
        except ConfigError as e:
            raise ConfigError("ranks_per_node", cfg.ranks_per_node, e.reason) from None
        #: the partition rule the run uses: the named one, or its broken mutation under a partitioner fault
        self.partition_rule: RegisteredPartitioner = get_partitioner(cfg.partitioner)  # unknown: ConfigError
        self.partitioner = cfg.partitioner
        self.spec = _optimizer_spec(cfg)
        #: Muon / Adafactor: "whole-tensor" (or the deliberately wrong "flat-slices"); None: elementwise
        self.matrix_layout = whole_tensor.matrix_layout(cfg.extra, self.spec, cfg.xp)
        self.precision = Precision.parse(cfg.precision)
        if cfg.offload and not self.strategy.shards_params:
            raise ConfigError(
                "offload",
                True,
                f"CPU offload is implemented for FULL_SHARD / HYBRID_SHARD, not {self.strategy.name}",
            )
        self.inject_nan = resolve_injection(cfg.inject_nan, self)
        if cfg.load not in LOAD_MODES:
            raise ConfigError("load", cfg.load, f"known: {', '.join(LOAD_MODES)}")
        if cfg.reshard_at is not None:
            require_non_negative_int("reshard_at", cfg.reshard_at)
            if cfg.reshard_at >= self.steps:
                raise ConfigError("reshard_at", cfg.reshard_at,
                                  f"must be a step of the run, below steps={self.steps}")
        if cfg.fault is not None and cfg.fault not in FAULTS:
            raise ConfigError("fault", cfg.fault, f"unknown fault; known: {', '.join(sorted(FAULTS))}")
        self.fault = cfg.fault
        self.k = self.strategy.shard_group_size(self.world_size)
        self.replicas = self.world_size // self.k
        if self.strategy.shards_optimizer and self.layout.total_numel < 1:
            raise ConfigError("model", cfg.model, "has no parameters")
        whole = whole_tensor.needs_whole_tensors(self.spec, self.strategy, self.k, self.matrix_layout)
        self.partitioner, self.partition_rule = whole_tensor.resolve_partitioner(self.partitioner, whole)
        # unit plan last: it runs the partitioner (cheap; O(tensors * ranks))
        self.unit_plan: UnitPlan = build_unit_plan(
            self.layout, self.strategy, self.partitioner, self.world_size
        )
        whole_tensor.check_whole_tensors(self.layout, self.unit_plan, whole)
        if self.fault is not None:
            why_not = refusal(FAULTS[self.fault], self)
            if why_not:
                raise ConfigError("fault", self.fault, why_not)
            if FAULTS[self.fault].where == "partitioner":  # the run trains with the broken rule
                self.partition_rule = mutate(self.partition_rule, FAULTS[self.fault].implementation)
                self.unit_plan = build_unit_plan(self.layout, self.strategy, self.partition_rule,
                                                 self.world_size)
        # What ranks keep for the contracts (memory!): shard values (master, optimizer state: about
        # 3 x params per step over all ranks), every rank's full gathered weights (world x params per step).
        psi_steps = self.layout.total_numel * self.steps
        auto = cfg.observe == "auto"
        self.observe_values = cfg.observe == "full" or (auto and psi_steps <= AUTO_VALUES_LIMIT)
        self.observe_full = cfg.observe == "full" or (auto and psi_steps * self.world_size <= AUTO_FULL_LIMIT)
        self.observe_gathered = cfg.observe != "none"  # "none": timing runs (the benchmark) observe nothing

    def _refuse_unbounded_work(self) -> None:
        """ConfigError before anything runs when the run's work exceeds what finishes in about an hour."""
        m = self.model_cfg
        shape = (f"{self.world_size} ranks x {self.steps} steps x {self.micro_batches} micro-batches x "
                 f"{m.batch_size} sequences x {m.seq_len} tokens")
        tokens = self.world_size * self.steps * self.micro_batches * m.batch_size * m.seq_len
        flop = 6 * self.layout.total_numel * tokens
        if flop > MAX_SIM_FLOP:
            raise ConfigError("run size", shape, f"about {flop:.2g} model flop, above the limit of "
                              f"{MAX_SIM_FLOP:.2g} (about an hour on two cores); lower steps, micro-batches, "
                              "batch size, sequence length or world size")
        rank_micro_steps = self.world_size * self.steps * self.micro_batches
        if rank_micro_steps > MAX_SIM_RANK_MICRO_STEPS:
            raise ConfigError("run size", shape, f"{rank_micro_steps:,} rank micro-batch steps, above the "
                              f"limit of {MAX_SIM_RANK_MICRO_STEPS:,} (about an hour on two cores)")

    @cached_property
    def state_plan(self) -> StatePlan:
        """The plan C-ZERO-004 compares the engine's live arrays against."""
        return build_plan(self.layout, self.strategy, self.partition_rule, self.topology)

    @property
    def strategy_kind(self) -> StrategyKind:
        return self.strategy.kind

    @property
    def zero1_reduce_scatter(self) -> bool:
        """ZeRO-1 averaging its gradient with a reduce-scatter into the rank's shard (not an all-reduce)."""
        return (
            self.strategy.kind is StrategyKind.SHARD_OPTIMIZER and self.zero1_grad_reduce == "reduce_scatter"
        )

    def describe(self) -> dict[str, Any]:
        return {
            "model": self.model_cfg.__dict__,
            "num_params": self.layout.total_numel,
            "world_size": self.world_size,
            "strategy": self.strategy.name,
            "partitioner": self.partitioner,
            "ranks_per_node": self.topology.ranks_per_node,
            "shard_group_size": self.k,
            "replicas": self.replicas,
            "optimizer": self.spec.to_dict(),
            "precision": self.precision.name,
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "seed": self.seed,
            "offload": self.cfg.offload,
            "prefetch": self.prefetch,
            "fault": self.fault,
            "load": self.cfg.load,
            "reshard_at": self.cfg.reshard_at,
            "zero1_grad_reduce": self.zero1_grad_reduce,
            "packed_numel": self.unit_plan.packed_numel,
            "units": len(self.unit_plan.units),
            **({"matrix_layout": self.matrix_layout} if self.matrix_layout is not None else {}),
        }


def _default_rpn(strategy: ShardingStrategy, world_size: int) -> int:
    """A hybrid run without --ranks-per-node puts one shard group on each node."""
    if strategy.is_hybrid and strategy.intra_node_size:
        return strategy.intra_node_size
    return world_size


def _model_config(cfg: RunConfig) -> SimModelConfig:
    overrides: dict[str, Any] = {}
    for name in ("batch_size", "seq_len"):
        v = getattr(cfg, name)
        if v is not None:
            overrides[name] = require_positive_int(name, v)
    if isinstance(cfg.model, SimModelConfig):
        return replace(cfg.model, **overrides)
    if not isinstance(cfg.model, str):
        raise ConfigError("model", cfg.model, "expected a preset name or a SimModelConfig")
    if cfg.model not in PRESETS:
        raise ConfigError("model", cfg.model, f"unknown preset; known: {', '.join(PRESETS)}")
    require_simulator_preset(cfg.model)  # a GPT-2 layout is refused: the simulator runs block models only
    m = SimModelConfig.from_preset(cfg.model, **overrides)
    if m.vocab_size * m.d_model * (m.n_layer + 2) > 2_000_000_000:
        raise ConfigError(
            "model", cfg.model,
            f"too large to simulate in one process (use {' or '.join(simulator_presets())})",
        )
    return m


def _strategy(cfg: RunConfig) -> ShardingStrategy:
    if isinstance(cfg.strategy, ShardingStrategy):
        return cfg.strategy
    return ShardingStrategy.parse(str(cfg.strategy), cfg.ranks_per_node)


def _optimizer_spec(cfg: RunConfig) -> OptimizerSpec:
    if isinstance(cfg.optimizer, OptimizerSpec):
        spec = cfg.optimizer
        if cfg.lr is not None:
            spec = replace(spec, lr=cfg.lr)
        return spec
    overrides: dict[str, Any] = {"max_grad_norm": cfg.max_grad_norm}
    if cfg.lr is not None:
        if (
            isinstance(cfg.lr, bool)
            or not isinstance(cfg.lr, (int, float))
            or not math.isfinite(cfg.lr)
            or cfg.lr <= 0
        ):
            raise ConfigError("lr", cfg.lr, "must be a positive number")
        overrides["lr"] = cfg.lr
    if not isinstance(cfg.optimizer, str):
        raise ConfigError(
            "optimizer", cfg.optimizer, "expected a name (sgd, adam, adamw, muon, adafactor) or a spec"
        )
    name = cfg.optimizer.lower()
    if name == "sgd" and "momentum" not in cfg.extra:
        overrides["momentum"] = 0.9
    for key in whole_tensor.EXTRA_OPTIONS:
        if key in cfg.extra:
            overrides[key] = cfg.extra[key]
    return OptimizerSpec.parse(name, **overrides)
