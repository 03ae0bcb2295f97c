"""A deliberate corruption as a value: which hook point of the engine, which rank and step, and how.

A contract that cannot fail is a defect, so every step contract has a test where an engine fault
makes it fail with a useful diagnostic. A fault is not a kind of engine: it is an
:class:`EngineFault` held by a rank's :class:`~zerosim.engine.rank_state.RankState` (``fault=``);
the step functions consult it at their hook points and behave as the reference engine everywhere
else. The catalogue
(:mod:`zerosim.engine.fault_catalog`) names each fault, the configurations where it acts and what it
touches; :func:`~zerosim.engine.fault_catalog.engine_fault` gives the value a run's engine is handed.

Each hook point is one place of the step where real sharding code shipped a bug (bug classes are
numbered as in docs/references.md); the corruptions a hook knows are listed with it in :class:`Hook`.
Plain data: nothing here imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Hook(Enum):
    """Where the engine consults a fault, with the corruptions it knows there."""

    #: the reduction of gradients across ranks; ``sum`` instead of the mean (bug class 1)
    GRAD_REDUCE_OP = "grad_reduce_op"
    #: dividing the micro-batch accumulation by M; ``skip`` (bug class 2)
    ACCUMULATION_AVERAGE = "accumulation_average"
    #: the global gradient norm's sum of squares; ``rank-local`` (bug class 3) or ``world``, summed
    #: over every replica again (bug class 4)
    GLOBAL_NORM = "global_norm"
    #: hybrid: the replicate-group all-reduce of the gradient shard; ``sum`` (bug class 1, hybrid form)
    #: or ``skip`` (bug class 5)
    REPLICATE_REDUCE = "replicate_reduce"
    #: the parameters a gather delivers; ``stale``: the rank keeps those of step 0 (ZeRO-3) or ignores
    #: the post-step all-gather (ZeRO-1/2) (bug class 7); ``drop-last-chunk``: the post-step all-gather
    #: writes back every chunk but the last rank's (bug class 7, partial)
    GATHERED_PARAMS = "gathered_params"
    #: the working shard refreshed after the step; ``skip-copy-back``: the offloaded master's update
    #: never reaches the device shard (bug class 12)
    PARAM_REFRESH = "param_refresh"
    #: the optimizer step; ``count-twice``: the step counter advances twice (bug class 11)
    OPTIMIZER_STEP = "optimizer_step"
    #: the group the rank-0 load broadcasts over; ``shard-group`` instead of the world (bug class 6)
    LOAD_BROADCAST = "load_broadcast"
    #: where each rank's shard sits in a full-state-dict assembly; ``reversed`` rank order (bug class 10)
    STATE_ASSEMBLY = "state_assembly"
    #: freeing a gathered block; ``keep``: it is never freed
    RELEASE = "release"
    #: the state a rank holds; ``hidden-full-copy``: a full float32 copy beside the optimizer shard
    HOLDINGS = "holdings"
    #: the step's collectives; ``extra-all-gather``: one all-gather of the shards too many
    STEP_COLLECTIVES = "step_collectives"
    #: what packed gradient padding is filled with; ``ones`` (bug class 8)
    PADDING = "padding"


#: every corruption each hook knows (a fault naming another is refused when it is made)
CORRUPTIONS: dict[Hook, tuple[str, ...]] = {
    Hook.GRAD_REDUCE_OP: ("sum",),
    Hook.ACCUMULATION_AVERAGE: ("skip",),
    Hook.GLOBAL_NORM: ("rank-local", "world"),
    Hook.REPLICATE_REDUCE: ("sum", "skip"),
    Hook.GATHERED_PARAMS: ("stale", "drop-last-chunk"),
    Hook.PARAM_REFRESH: ("skip-copy-back",),
    Hook.OPTIMIZER_STEP: ("count-twice",),
    Hook.LOAD_BROADCAST: ("shard-group",),
    Hook.STATE_ASSEMBLY: ("reversed",),
    Hook.RELEASE: ("keep",),
    Hook.HOLDINGS: ("hidden-full-copy",),
    Hook.STEP_COLLECTIVES: ("extra-all-gather",),
    Hook.PADDING: ("ones",),
}


@dataclass(frozen=True)
class EngineFault:
    """One corruption the engine applies: at ``hook``, ``corruption``, on world rank ``rank`` (None:
    every rank) at optimizer step ``step`` (None: every step). A rank beyond the world is the last
    rank (a world of one rank has only rank 0 to break)."""

    hook: Hook
    corruption: str
    rank: int | None = None
    step: int | None = None

    def __post_init__(self) -> None:
        if self.corruption not in CORRUPTIONS[self.hook]:
            raise ValueError(f"hook {self.hook.value} knows the corruptions {CORRUPTIONS[self.hook]}, "
                             f"not {self.corruption!r}")

    def acts(self, hook: Hook, rank: int, world_size: int, step: int) -> bool:
        """Whether this fault corrupts ``hook`` on world rank ``rank`` at ``step``."""
        if hook is not self.hook:
            return False
        if self.rank is not None and rank != min(self.rank, world_size - 1):
            return False
        return self.step is None or step == self.step

