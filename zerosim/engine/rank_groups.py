"""The sub-communicators one rank of the engine uses, split once at start-up.

A world of ``n`` ranks in shard groups of ``k`` (``r = n / k`` replicas): the shard group carries the
all-gathers and reduce-scatters (C-ZERO-005 counts them there), the replicate group the hybrid
all-reduce of gradient shards, the control groups the finite votes, the norm's scalar all-reduce and
barriers (no data traffic), and the observe group the full-parameter views taken outside the timed
step. Every rank calls the same splits in the same order (they are collectives).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..comm.base import Communicator


@dataclass(frozen=True)
class RankGroups:
    """One rank's groups; None where the strategy needs none."""

    shard: Communicator | None  # gathers and reduce-scatters (ZeRO-1/2/3, hybrid)
    replicate: Communicator | None  # the hybrid (or pure data-parallel) gradient all-reduce
    control: Communicator  # the whole world, no data traffic
    shard_control: Communicator  # the shard group, no data traffic (the global norm)
    observe: Communicator | None  # ZeRO-3 full-parameter views, outside the step's traffic

    def members(self, world: Communicator) -> dict[str, tuple[int, ...]]:
        """Global ranks of every group by name (the observation's ``groups``), the world first."""
        out: dict[str, tuple[int, ...]] = {}
        for comm in (world, self.shard, self.replicate, self.control, self.shard_control, self.observe):
            if comm is not None:
                out[comm.group_name] = tuple(comm.global_ranks)
        return out


def make_groups(comm: Communicator, k: int, replicas: int, sharded_optim: bool,
                sharded_params: bool) -> RankGroups:
    """Split ``comm`` into this rank's groups for shard groups of ``k`` ranks."""
    n = comm.world_size
    g, j = divmod(comm.rank, k)
    shard: Communicator | None = None
    if k == n:
        shard = comm
    elif sharded_optim:
        shard = comm.split(g, name=f"shard[{g}]")
    replicate: Communicator | None = None
    if replicas > 1:
        replicate = comm if k == 1 else comm.split(j, name=f"replicate[{j}]")
    control = comm.split(0, name="world.control")
    shard_control = control if k == n else comm.split(g, name=f"shard[{g}].control")
    observe = None
    if sharded_params:
        observe = comm.split(g, name="world.observe" if k == n else f"shard[{g}].observe")
    return RankGroups(shard, replicate, control, shard_control, observe)
