"""The catalogue of deliberately broken variants (mutants): names, what each breaks, where it acts.

A contract that cannot fail is a defect, so each bug class real sharding code shipped has a mutant
here, switched on only by naming it (``RunConfig(fault=...)``, ``zerosim simulate --fault NAME``,
``zerosim mutants``). Three places can be broken, one mechanism for all of them:

* ``engine``: an :class:`~zerosim.engine.faults.EngineFault` value (hook point, corruption, rank,
  step) the engine consults at one hook (reduction, norm, gather, optimizer, offload copy);
* ``partitioner``: the run's partition rule passed through one of
  :data:`zerosim.partition.mutations.MUTATIONS` (boundary bugs; C-ZERO-001 stops the run before
  training);
* ``state-dict``: an engine fault value that breaks the rank-0 load broadcast (``load="broadcast"``)
  or the full-state-dict round trip (``reshard_at``).

Each entry also says when it can act (:attr:`Fault.cannot_act` returns the reason a configuration
gives it nothing to break, so ``--fault padding-leak`` on a plan without padding is refused instead
of passing silently), a configuration where it does act (:attr:`Fault.example`), and which ranks and
elements it touches (:attr:`Fault.touches`), which the diagnostics of the first failing contract
must name. Plain data plus small functions of the resolved run: nothing here imports the engine;
:func:`engine_fault` is the value a run's engine is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..values.strategy import StrategyKind
from .faults import EngineFault, Hook

FAULTY_RANK = 1  # the rank that misbehaves in single-rank faults (rank 0 when the world has one rank)

Interval = tuple[int, int]


@dataclass(frozen=True)
class Touched:
    """What a fault breaks: world ranks (None: every rank) and global flat intervals (None: any element)."""

    ranks: tuple[int, ...] | None = None
    intervals: tuple[Interval, ...] | None = None


@dataclass(frozen=True)
class Fault:
    name: str
    where: str  # "engine" | "partitioner" | "state-dict"
    implementation: str  # a partitioner fault's mutation name ("" for the others)
    description: str
    catches: tuple[str, ...]  # the contracts it fails (a test keeps this exact)
    cannot_act: Callable[[Any], str | None]  # resolved run -> why the fault has nothing to break there
    example: dict[str, Any]  # RunConfig fields of a configuration where it acts
    touches: Callable[[Any], Touched] = field(default=lambda run: Touched())
    bug_class: str = ""  # the bug class in docs/references.md it reproduces, when it has a number
    corrupts: EngineFault | None = None  # engine and state-dict faults: what the engine is handed

    def example_flags(self) -> str:
        """The example configuration as ``zerosim simulate`` options."""
        return " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                        for k, v in self.example.items())


# ---- when a fault can act (None: it can; otherwise the reason) -------------------------------------

def _faulty_rank(run: Any) -> int:
    return min(FAULTY_RANK, run.world_size - 1)


def _needs_ranks(run: Any) -> str | None:
    return None if run.world_size > 1 else "a world of one rank has nothing to reduce"


def _needs_shard_group(run: Any) -> str | None:
    return None if run.k > 1 else f"the shard group has one rank (strategy {run.strategy.name})"


def _needs_replicas(run: Any) -> str | None:
    if not run.strategy.is_hybrid:
        return f"needs a hybrid strategy, not {run.strategy.name}"
    return None if run.replicas > 1 else "the hybrid run has a single replica group"


def _needs_clip(run: Any) -> str | None:
    return None if run.spec.max_grad_norm is not None else "gradient clipping is off (max_grad_norm none)"


def _all(*conditions: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    def check(run: Any) -> str | None:
        for c in conditions:
            reason = c(run)
            if reason:
                return reason
        return None
    return check


def _sharded_grads(run: Any) -> str | None:
    return None if run.strategy.shards_grads else f"{run.strategy.name} does not shard gradients"


def _sharded_optim(run: Any) -> str | None:
    return None if run.strategy.shards_optimizer else f"{run.strategy.name} does not shard the optimizer"


def _zero12(run: Any) -> str | None:
    s = run.strategy
    if s.shards_optimizer and not s.shards_params:
        return None
    return f"needs a strategy that all-gathers parameters after the step (ZeRO-1/2), not {s.name}"


def _gathers(run: Any) -> str | None:
    if run.strategy.kind is StrategyKind.NO_SHARD:
        return "NO_SHARD gathers nothing"
    return _needs_shard_group(run)


def _micro(run: Any) -> str | None:
    return None if run.micro_batches > 1 else "one micro-batch: there is nothing to average"


def _has_padding(run: Any) -> str | None:
    if run.unit_plan.packed_numel > run.layout.total_numel:
        return None
    return f"the plan has no padding ({run.layout.total_numel} elements split evenly over {run.k} ranks)"


def _more_units_than_window(run: Any) -> str | None:
    if not run.strategy.shards_params:
        return f"{run.strategy.name} gathers no blocks"
    if len(run.unit_plan.units) <= 1 + run.prefetch:
        return "every block fits in the gather window anyway"
    return None


def _offload(run: Any) -> str | None:
    return None if run.cfg.offload else "CPU offload is off (--offload)"


def _broadcast_load(run: Any) -> str | None:
    if run.cfg.load != "broadcast":
        return "the initial weights are not loaded by broadcast (--load broadcast)"
    return None


def _reshard(run: Any) -> str | None:
    at = run.cfg.reshard_at
    if at is None:
        return "no full-state-dict round trip (--reshard-at STEP)"
    if at >= run.steps - 1:
        return f"--reshard-at {at} leaves no later step to observe (steps={run.steps})"
    return None


def _partition_changes(mutation: str) -> Callable[[Any], str | None]:
    def check(run: Any) -> str | None:
        from ..partition import get_partitioner
        from ..partition.mutations import MUTATIONS

        rule = get_partitioner(run.partitioner)
        if MUTATIONS[mutation](rule.fn, run.layout, run.k).shards == rule(run.layout, run.k).shards:
            return f"the {run.partitioner} plan over {run.k} ranks gives this bug nothing to change"
        return None
    return check


# ---- what a fault touches ---------------------------------------------------------------------------

def _rank_touch(run: Any) -> Touched:
    return Touched((_faulty_rank(run),))


def _owned(run: Any, local: int) -> tuple[Interval, ...]:
    return tuple((g0, g1) for g0, g1, _ in run.unit_plan.owned_global(local))


def _faulty_rank_shard_everywhere(run: Any) -> Touched:
    return Touched(None, _owned(run, _faulty_rank(run) % run.k))


def _last_rank_shard(run: Any) -> Touched:
    return Touched(None, _owned(run, run.k - 1))


def _other_groups(run: Any) -> Touched:
    return Touched(tuple(range(run.k, run.world_size)))


def _partition_touch(mutation: str) -> Callable[[Any], Touched]:
    def touch(run: Any) -> Touched:
        """The elements whose owners the mutation changed (and the ranks that own them either way)."""
        from ..partition import get_partitioner
        from ..partition.mutations import MUTATIONS
        from ..values.intervals import merge_adjacent

        rule = get_partitioner(run.partitioner)
        good = rule(run.layout, run.k)
        bad = MUTATIONS[mutation](rule.fn, run.layout, run.k)
        ranks, changed = set(), []
        for g, b in zip(good.shards, bad.shards, strict=True):
            if g.intervals != b.intervals:
                ranks.add(g.rank)
                changed += _symmetric_difference(g.intervals, b.intervals)
        return Touched(tuple(sorted(ranks)), tuple(merge_adjacent(sorted(changed))))
    return touch


def _symmetric_difference(a: tuple[Interval, ...], b: tuple[Interval, ...]) -> list[Interval]:
    points = sorted({p for iv in (*a, *b) for p in iv})
    out = []
    for lo, hi in zip(points, points[1:], strict=False):
        in_a = any(s <= lo and hi <= e for s, e in a)
        in_b = any(s <= lo and hi <= e for s, e in b)
        if in_a != in_b:
            out.append((lo, hi))
    return out


_ZERO3 = {"strategy": "zero3", "world_size": 4}
_HYBRID = {"strategy": "hybrid_shard:2", "world_size": 4}

FAULTS: dict[str, Fault] = {
    f.name: f
    for f in (
        # ---- reductions and norms -----------------------------------------------------------------
        Fault("sum-instead-of-avg", "engine", "",
              "gradients summed across ranks, not averaged", ("C-ZERO-002",),
              _needs_ranks, _ZERO3, bug_class="1",
              corrupts=EngineFault(Hook.GRAD_REDUCE_OP, "sum")),
        Fault("wrong-group-divisor", "engine", "",
              "hybrid gradients averaged over the shard group only: the replicate group sums them, so the "
              "divisor is the shard group size, not the world", ("C-ZERO-002",),
              _needs_replicas, _HYBRID, bug_class="1",
              corrupts=EngineFault(Hook.REPLICATE_REDUCE, "sum")),
        Fault("no-accum-average", "engine", "",
              "micro-batch accumulation not divided by M", ("C-ZERO-002",),
              _micro, {**_ZERO3, "micro_batches": 2}, bug_class="2",
              corrupts=EngineFault(Hook.ACCUMULATION_AVERAGE, "skip")),
        Fault("local-norm-clip", "engine", "",
              "clip with the rank-local norm of the shard", ("C-ZERO-002",),
              _all(_sharded_optim, _needs_shard_group, _needs_clip),
              {**_ZERO3, "max_grad_norm": 0.05}, bug_class="3",
              corrupts=EngineFault(Hook.GLOBAL_NORM, "rank-local")),
        Fault("norm-over-replicas", "engine", "",
              "hybrid grad norm summed over the whole world, counting every replica again", ("C-ZERO-002",),
              _all(_needs_replicas, _needs_clip), {**_HYBRID, "max_grad_norm": 0.05}, bug_class="4",
              corrupts=EngineFault(Hook.GLOBAL_NORM, "world")),
        Fault("skip-replicate-allreduce", "engine", "",
              "hybrid without the replicate-group all-reduce", ("C-ZERO-002", "C-ZERO-003", "C-ZERO-005"),
              _needs_replicas, _HYBRID, bug_class="5",
              corrupts=EngineFault(Hook.REPLICATE_REDUCE, "skip")),
        # ---- gathers and the working copy ----------------------------------------------------------
        Fault("stale-params", "engine", "",
              "rank 1 computes with parameters from before an update", ("C-ZERO-002", "C-ZERO-003"),
              _gathers, _ZERO3, _rank_touch, bug_class="7",
              corrupts=EngineFault(Hook.GATHERED_PARAMS, "stale", rank=FAULTY_RANK)),
        Fault("partial-all-gather", "engine", "",
              "the post-step all-gather writes back every rank's chunk but the last one's: that range "
              "stays stale on every rank", ("C-ZERO-002", "C-ZERO-003"),
              _all(_zero12, _needs_shard_group), {"strategy": "zero2", "world_size": 4},
              _last_rank_shard, bug_class="7",
              corrupts=EngineFault(Hook.GATHERED_PARAMS, "drop-last-chunk")),
        Fault("offload-copy-back-skipped", "engine", "",
              "ZeRO-3 CPU offload: rank 1 steps its host master but never copies the update back to its "
              "device shard", ("C-ZERO-002", "C-ZERO-003"),
              _all(_offload, _needs_shard_group), {**_ZERO3, "offload": True}, _faulty_rank_shard_everywhere,
              bug_class="12",
              corrupts=EngineFault(Hook.PARAM_REFRESH, "skip-copy-back", rank=FAULTY_RANK)),
        Fault("keep-gathered", "engine", "", "ZeRO-3 never frees gathered blocks",
              ("C-ZERO-004",), _more_units_than_window, _ZERO3,
              corrupts=EngineFault(Hook.RELEASE, "keep")),
        Fault("hidden-full-copy", "engine", "", "rank 0 keeps a full fp32 copy",
              ("C-ZERO-004",), _sharded_optim, {"strategy": "zero2", "world_size": 4},
              lambda run: Touched((0,)),
              corrupts=EngineFault(Hook.HOLDINGS, "hidden-full-copy", rank=0)),
        Fault("extra-all-gather", "engine", "", "one all-gather too many per step",
              ("C-ZERO-005",), _all(_sharded_optim, _needs_shard_group), _ZERO3,
              corrupts=EngineFault(Hook.STEP_COLLECTIVES, "extra-all-gather")),
        # ---- optimizer state -------------------------------------------------------------------------
        Fault("padding-leak", "engine", "",
              "gradient padding filled with ones, so it leaks into the state", ("C-ZERO-002",),
              _all(_sharded_grads, _has_padding), {"strategy": "zero3", "world_size": 5}, bug_class="8",
              corrupts=EngineFault(Hook.PADDING, "ones")),
        Fault("step-counter-drift", "engine", "",
              "rank 1's optimizer step counter advances twice on the first step (per-shard counters "
              "drift apart; Adam's bias correction of its shard is wrong from then on)", ("C-ZERO-002",),
              _needs_shard_group, _ZERO3, _rank_touch, bug_class="11",
              corrupts=EngineFault(Hook.OPTIMIZER_STEP, "count-twice", rank=FAULTY_RANK, step=0)),
        # ---- partition boundaries (C-ZERO-001 stops the run before training) -------------------------
        Fault("shard-off-by-one", "partitioner", "off_by_one",
              "every shard but the last ends one element early: an element between neighbours has no "
              "owner", ("C-ZERO-001",),
              _all(_needs_shard_group, _partition_changes("off_by_one")), _ZERO3,
              _partition_touch("off_by_one")),
        Fault("overlapping-shards", "partitioner", "overlapping",
              "every shard but the first starts one element early: boundary elements have two owners",
              ("C-ZERO-001",), _all(_needs_shard_group, _partition_changes("overlapping")), _ZERO3,
              _partition_touch("overlapping")),
        Fault("dropped-remainder", "partitioner", "dropped_remainder",
              "the remainder of an even split (total % ranks elements at the end) is dropped",
              ("C-ZERO-001",), _all(_needs_shard_group, _partition_changes("dropped_remainder")),
              {"strategy": "zero3", "world_size": 5}, _partition_touch("dropped_remainder"), bug_class="9"),
        Fault("trailing-shard-unowned", "partitioner", "trailing_unowned",
              "the plan is made for one rank too many: the trailing shard is owned by no rank",
              ("C-ZERO-001",), _partition_changes("trailing_unowned"), _ZERO3,
              _partition_touch("trailing_unowned"), bug_class="9"),
        # ---- state-dict path -----------------------------------------------------------------------
        Fault("load-broadcast-misses-group", "state-dict", "",
              "rank-0 load: the weights are broadcast inside rank 0's shard group only; the other "
              "replica groups keep uninitialised (zero) weights", ("C-ZERO-002", "C-ZERO-003"),
              _all(_broadcast_load, _needs_replicas), {**_HYBRID, "load": "broadcast"}, _other_groups,
              bug_class="6",
              corrupts=EngineFault(Hook.LOAD_BROADCAST, "shard-group")),
        Fault("reshard-wrong-order", "state-dict", "",
              "full-state-dict round trip that assembles the gathered shards in reverse rank order, so "
              "every rank reloads another rank's shard", ("C-ZERO-002",),
              _all(_reshard, _sharded_optim, _needs_shard_group), {**_ZERO3, "reshard_at": 0},
              bug_class="10",
              corrupts=EngineFault(Hook.STATE_ASSEMBLY, "reversed")),
    )
}


def refusal(fault: Fault, run: Any) -> str | None:
    """Why ``fault`` cannot act in ``run``, with a configuration where it does; None when it acts."""
    reason = fault.cannot_act(run)
    if reason is None:
        return None
    return (f"cannot act here ({reason}), so the run would pass without testing anything; it acts in "
            f"e.g. `zerosim simulate --fault {fault.name} {fault.example_flags()}`")


def engine_fault(run: Any) -> EngineFault | None:
    """The fault value a run's engine is handed: its catalogued fault's corruption (None for no fault
    and for a partitioner fault, which breaks the plan the reference engine then trains on)."""
    return None if run.fault is None else FAULTS[run.fault].corrupts
