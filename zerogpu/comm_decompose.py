"""How a reduce-scatter and an all-gather travel on torch.distributed: native, or decomposed.

``reduce_scatter=`` and ``all_gather=`` (``"auto"`` by default) choose the path. On NCCL ``auto`` is
the backend's own collective. On gloo it is a decomposition into point-to-root collectives, because
gloo's own ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are several times slower than
the same bytes moved otherwise (2 ranks, 50M float32 elements, 2-core CPU: reduce-scatter 0.43 s
against 0.20 s as reduces, all-gather 0.34 s against 0.10 s as broadcasts; at 4 ranks 0.78 s
against 0.33 s and 0.57 s against 0.20 s). A reduce-scatter of fewer than
:data:`DECOMPOSE_REDUCE_SCATTER_MIN` elements stays gloo's own: there the reduces' round trips, not
the bytes, are the cost (see the constant).

- ``"reduce"``: one ``reduce`` per chunk to the rank that owns it, all started before any is
  waited for (:func:`reduce_scatter_via_reduce`). Each rank receives ``(n-1)/n * S``, the
  reduce-scatter's volume. gloo uses a non-root's buffer as scratch space, so each chunk is
  reduced in a copy, unless the caller donates its input (``donate=True``).
- ``"broadcast"``: one ``broadcast`` per chunk from the rank that owns it, all started together
  (:func:`all_gather_via_broadcast`, :func:`all_gather_into_via_broadcast`). Each rank receives
  ``(n-1)/n * S``, the all-gather's volume; the values are copies, exact.
- ``"all_reduce"`` (reduce-scatter only): the full buffer is all-reduced and this rank's chunk
  sliced out (:func:`reduce_scatter_via_all_reduce`). Same values (the same sum per element), about
  twice the bytes (``2 (n-1)/n * S``); the communicator counts such calls as fallbacks so a report
  can say so. ``"auto"`` falls back to it where the backend refuses its own reduce-scatter.
- ``"native"``: the backend's own collective, whatever it costs (:func:`native_all_gather`,
  :func:`native_reduce_scatter`).

Over two ranks every path adds the same two values and is bitwise equal to the others. Each
function takes the group's :class:`~zerogpu.comm_watchdog.GroupWatch` (bounded waits) and the
group's global ranks; the traffic of the collective the engine asked for is recorded by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zerosim.errors import CollectiveError

from .comm_watchdog import Call, GroupWatch

REDUCE_SCATTER_MODES = ("auto", "native", "reduce", "all_reduce")
ALL_GATHER_MODES = ("auto", "native", "broadcast")
#: on gloo, ``auto`` decomposes a reduce-scatter into reduces from this many elements up; below it
#: gloo's own is faster (2 ranks, idle 2-core CPU, median of 200 calls in two runs: 6,000 float32
#: elements 0.41-0.49 ms own against 0.65 ms as reduces, 12,320 0.45-0.52 against 0.53-0.59,
#: 65,536 0.80 against 0.76-0.86, 262,144 1.8-1.9 against 1.5-1.7, 1,048,576 5.7-6.7 against 5.0-5.1)
DECOMPOSE_REDUCE_SCATTER_MIN = 1 << 15
# all_gather_into on gloo: views at least this long are broadcast into directly; shorter ones of a
# rank share one staging buffer (a broadcast costs a round trip whatever its size)
DIRECT_GATHER_MIN = 65_536

#: the backend op of each engine op (``avg`` is the sum, divided afterwards by the caller)
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def native_all_gather(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed's single-tensor all-gather, looked up per call (so a wrapper installed later,
    such as ``zerosim verify``'s traffic counter, sees the call)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)


def native_reduce_scatter(*args: Any, **kwargs: Any) -> Any:
    """torch.distributed's single-tensor reduce-scatter, looked up per call (as the all-gather is)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def reduce_scatter_via_reduce(watch: GroupWatch, rank: int, t: torch.Tensor, op: str, c: int,
                              donate: bool) -> torch.Tensor:
    """One reduce per chunk to its owner, all in flight together. Each chunk is reduced in a copy
    (gloo uses a non-root's buffer as scratch), or in place in a donated input; this rank keeps
    the chunk it owns (the sum a reduce-scatter gives it)."""
    ranks = watch.global_ranks
    chunks = [t[i * c:(i + 1) * c] if donate else t[i * c:(i + 1) * c].clone() for i in range(len(ranks))]
    watch.issue_each("reduce_scatter", [
        (dist.reduce, (chunk,), {"dst": ranks[i], "op": OPS[op]}) for i, chunk in enumerate(chunks)
    ])
    return chunks[rank]


def reduce_scatter_via_all_reduce(watch: GroupWatch, rank: int, t: torch.Tensor, op: str, c: int,
                                  donate: bool) -> torch.Tensor:
    """Fallback: all-reduce the whole buffer, keep this rank's chunk (the reduce-scatter's values)."""
    full = t if donate else t.clone()
    watch.issue("reduce_scatter", dist.all_reduce, full, op=OPS[op])
    mine = full[rank * c:(rank + 1) * c]
    return mine if donate else mine.clone()


def all_gather_via_broadcast(watch: GroupWatch, rank: int, t: torch.Tensor, out: torch.Tensor) -> None:
    """Every rank's ``t`` into ``out`` (rank-major), one broadcast per chunk from its owner."""
    chunks = out.split(t.shape[0])
    chunks[rank].copy_(t)
    watch.issue_each("all_gather", [
        (dist.broadcast, (chunk,), {"src": watch.global_ranks[i]}) for i, chunk in enumerate(chunks)
    ])


def all_gather_into_via_broadcast(watch: GroupWatch, rank: int, x: torch.Tensor,
                                  destinations: list[list[tuple[int, torch.Tensor]]]) -> None:
    """The broadcast path of ``all_gather_into``: each view of at least :data:`DIRECT_GATHER_MIN`
    elements is broadcast into from its owner, so nothing lands in a buffer that then has to be
    copied; the smaller views of a rank travel together in one staging buffer."""
    calls: list[Call] = []
    staged: list[tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = []
    for j, pieces in enumerate(destinations):
        src = watch.global_ranks[j]
        small = [(off, view) for off, view in pieces if view.numel() < DIRECT_GATHER_MIN]
        for off, view in (p for p in pieces if p[1].numel() >= DIRECT_GATHER_MIN):
            if j == rank:
                view.copy_(x[off:off + view.numel()].view(view.shape))
            calls.append((dist.broadcast, (view,), {"src": src}))
        if small:
            staging = torch.empty(sum(v.numel() for _, v in small), dtype=x.dtype, device=x.device)
            if j == rank:
                torch.cat([x[off:off + v.numel()] for off, v in small], out=staging)
            calls.append((dist.broadcast, (staging,), {"src": src}))
            staged.append((staging, small))
    watch.issue_each("all_gather", calls)
    for staging, small in staged:
        at = 0
        for _, view in small:
            view.copy_(staging[at:at + view.numel()].view(view.shape))
            at += view.numel()


def check_destinations(group_name: str, x: torch.Tensor, destinations: list[list[tuple[int, torch.Tensor]]],
                       world_size: int) -> None:
    """``all_gather_into``'s destinations: one list per rank, each view a contiguous view of ``x``'s
    dtype inside a chunk (CollectiveError naming the group and the offset otherwise)."""
    if len(destinations) != world_size:
        raise CollectiveError(f"all_gather_into on group {group_name}: {len(destinations)} "
                              f"destination lists for {world_size} ranks")
    for pieces in destinations:
        for off, view in pieces:
            if view.dtype != x.dtype or not view.is_contiguous() or off + view.numel() > x.shape[0]:
                raise CollectiveError(f"all_gather_into on group {group_name}: the destination at "
                                      f"offset {off} is not a contiguous {x.dtype} view inside a chunk")


def scatter_gathered(gathered: torch.Tensor, chunk: int,
                     destinations: list[list[tuple[int, torch.Tensor]]]) -> None:
    """Copy a packed all-gather result (``chunk`` elements per rank) out to ``all_gather_into``'s views."""
    for j, pieces in enumerate(destinations):
        for off, view in pieces:
            view.copy_(gathered[j * chunk + off:j * chunk + off + view.numel()].view(view.shape))
