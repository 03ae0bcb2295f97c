"""Example partition functions to check with ``zerosim check partition --impl``.

Each is ``fn(rank, world_size, total) -> (start, end)`` (or a list of such ranges): the flat range
of the parameter vector that ``rank`` owns. Try, from the repository root::

    zerosim check partition --impl examples.my_partitioner:even_split
    zerosim check partition --impl examples.my_partitioner:last_rank_takes_remainder
    zerosim check partition --impl examples.my_partitioner:float_split
"""

from __future__ import annotations


def even_split(rank: int, world_size: int, total: int) -> tuple[int, int]:
    """Correct: ``total // world_size`` each, the first ``total % world_size`` ranks one more."""
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def last_rank_takes_remainder(rank: int, world_size: int, total: int) -> tuple[int, int]:
    """What the seed's doc comment describes ("last shard absorbs any remainder").

    Covers everything exactly once, but the last shard can hold up to ``world_size - 1`` extra
    elements: C-ZERO-001's balance clause (every shard within 1 of ``total // world_size``) fails.
    """
    base = total // world_size
    start = rank * base
    end = total if rank == world_size - 1 else start + base
    return start, end


def float_split(rank: int, world_size: int, total: int) -> tuple[int, int]:
    """Buggy: boundaries computed in floating point, ``round(rank * total / world_size)``.

    Neighbouring ranks still meet (they compute the same boundary), but beyond 2**53 the last
    boundary is no longer ``total``: the last rank claims elements past the end (padding counted
    as data) or leaves the tail owned by nobody.
    """
    start = round(rank * (total / world_size))
    end = round((rank + 1) * (total / world_size))
    return start, end

