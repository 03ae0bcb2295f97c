"""Sub-groups of a torch.distributed group: ``split``'s agreement and the ``new_group`` calls it makes.

``split(color, key, name)`` (``MPI_Comm_split``): the members agree on the split with one small
all-gather of ``(color, key, global rank, name hash, groups registered)``; then for a split of the
world **every** rank creates **every** new group with ``new_group`` in color order (torch requires
all processes to enter ``new_group`` in the same order), members ordered by ``(key, rank)``. A
split of a sub-group uses ``new_group(use_local_synchronization=True)``: only that group's members
take part. torch names such groups by their ranks and the count of groups each process registered
before, so members whose counts differ are aligned first (:func:`align_group_names`). Members of one
color that disagree on the group's name are refused (CollectiveError), as is a key order torch
cannot express.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from zerosim.errors import CollectiveError

from .comm_decompose import native_all_gather
from .comm_setup import name_hash, pg_count
from .comm_watchdog import GroupWatch

_NEW_GROUP_PARAMS = set(inspect.signature(dist.new_group).parameters)


def split_group(watch: GroupWatch, rank: int, world_size: int, is_world: bool, device: torch.device,
                color: int | None, key: int | None, name: str | None) -> tuple[Any, tuple[int, ...]] | None:
    """Agree on the split and create the new process groups; ``(this rank's group, its global ranks)``,
    or None for ``color=None`` (the rank opts out, but still enters every world-wide ``new_group``)."""
    mine = [-1 if color is None else color, rank if key is None else key, watch.global_rank,
            name_hash(name), pg_count()]
    table = torch.empty(world_size * len(mine), dtype=torch.int64, device=device)
    watch.issue("split", native_all_gather, table, torch.tensor(mine, dtype=torch.int64, device=device))
    rows = table.reshape(world_size, len(mine)).tolist()
    by_color: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for grank, (c, k, g, h, count) in enumerate(rows):
        if c >= 0:
            by_color.setdefault(c, []).append((k, grank, g, h, count))
    for c, members in by_color.items():
        if len({m[3] for m in members}) > 1:
            raise CollectiveError(
                f"split of group {watch.group_name}: members of color {c} disagree on the "
                f"group name (rank {watch.global_rank} passed {name!r})"
            )
        members.sort(key=lambda m: (m[0], m[1]))
    if not is_world and color is not None:
        align_group_names(watch, [m[4] for m in by_color[color]])
    mine_pg: Any = None
    my_ranks: tuple[int, ...] = ()
    for c in sorted(by_color):
        ranks = [m[2] for m in by_color[c]]
        if not is_world and c != color:
            continue  # local synchronisation: only the members create their group
        pg = new_group(watch, ranks, name if c == color else None, local=not is_world)
        if c == color:
            mine_pg, my_ranks = pg, tuple(ranks)
    if color is None:
        return None
    return mine_pg, my_ranks


def align_group_names(watch: GroupWatch, counts: list[int]) -> None:
    """Before a locally synchronised ``new_group``: torch names such a group by hashing its ranks
    with the number of groups the process registered so far, so members that registered different
    numbers (one sat out an earlier split) would wait under different names. The behind ones
    register single-rank placeholder groups (local, no peers, no communication) to catch up."""
    if min(counts) < 0:
        return  # torch does not expose the count: nothing to align
    for _ in range(max(counts) - pg_count()):
        dist.new_group([watch.global_rank], use_local_synchronization=True, timeout=watch.timeout)


def new_group(watch: GroupWatch, ranks: list[int], name: str | None, *, local: bool) -> Any:
    """``dist.new_group`` for ``ranks`` in that order, bounded by the group's timeout."""
    kwargs: dict[str, Any] = {"timeout": watch.timeout}
    if ranks != sorted(ranks):
        if "sort_ranks" not in _NEW_GROUP_PARAMS:
            raise CollectiveError(
                f"split of group {watch.group_name}: a key order that differs from rank order "
                f"needs new_group(sort_ranks=False) (torch {torch.__version__} has none)"
            )
        kwargs["sort_ranks"] = False
    if local:
        kwargs["use_local_synchronization"] = True
    if name is not None and "group_desc" in _NEW_GROUP_PARAMS:
        kwargs["group_desc"] = name
    try:
        return dist.new_group(ranks, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"split of group {watch.group_name}: new_group({ranks}) failed on rank "
                              f"{watch.global_rank}: {e}") from e
