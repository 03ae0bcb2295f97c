"""Half-open integer intervals ``[start, end)`` of the flat parameter space.

Everything here is O(k log k) in the number of intervals and never touches individual elements, so
C-ZERO-001 can be checked on a 10^12-parameter plan as fast as on a 10-parameter one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

Interval = tuple[int, int]


def length(intervals: Iterable[Interval]) -> int:
    """Number of elements in ``intervals`` (each counted once per listing; overlaps count twice)."""
    return sum(e - s for s, e in intervals if e > s)


def merge_adjacent(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Sort, drop empty intervals and join intervals that touch (``[a, b) + [b, c) -> [a, c)``).

    Overlapping intervals are *not* merged: a partitioner that lists an element twice must stay
    visible to the disjointness check.
    """
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return tuple(out)


def union(intervals: Iterable[Interval]) -> tuple[Interval, ...]:
    """Sorted union: overlapping and touching intervals joined, empty ones dropped."""
    out: list[Interval] = []
    for s, e in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return tuple(out)


def clip(interval: Interval, lo: int, hi: int) -> Interval | None:
    """``interval`` restricted to ``[lo, hi)``, or None when nothing is left."""
    s, e = max(interval[0], lo), min(interval[1], hi)
    return (s, e) if e > s else None


def outside(interval: Interval, lo: int, hi: int) -> list[Interval]:
    """The parts of ``interval`` that fall outside ``[lo, hi)`` (below ``lo`` first)."""
    s, e = interval
    parts = []
    if s < lo:
        parts.append((s, min(e, lo)))
    if e > hi:
        parts.append((max(s, hi), e))
    return [p for p in parts if p[1] > p[0]]


def first_difference(a: Sequence[Interval], b: Sequence[Interval]) -> Interval | None:
    """The first sub-interval held by exactly one of ``a`` and ``b`` (compared as sets), or None."""
    ua, ub = union(a), union(b)
    if ua == ub:
        return None
    points = sorted({p for iv in ua + ub for p in iv})
    ia = ib = 0
    for lo, hi in zip(points, points[1:], strict=False):
        while ia < len(ua) and ua[ia][1] <= lo:
            ia += 1
        while ib < len(ub) and ub[ib][1] <= lo:
            ib += 1
        in_a = ia < len(ua) and ua[ia][0] <= lo
        in_b = ib < len(ub) and ub[ib][0] <= lo
        if in_a != in_b:
            return (lo, hi)
    return None  # pragma: no cover - unions differ, so some elementary piece differs


@dataclass
class Coverage:
    """Result of :func:`sweep`: gaps (owned by nobody) and overlaps (owned twice), with owners.

    ``gaps`` holds ``(start, end, left_owner, right_owner)`` (None at the edges of the space);
    ``overlaps`` holds ``(start, end, owner_a, owner_b)``. Only the first ``limit`` of each are kept;
    the counts and element totals are always complete.
    """

    gaps: list[tuple[int, int, Hashable | None, Hashable | None]] = field(default_factory=list)
    overlaps: list[tuple[int, int, Hashable, Hashable]] = field(default_factory=list)
    gap_count: int = 0
    gap_elements: int = 0
    overlap_count: int = 0
    overlap_elements: int = 0


def sweep(labelled: Iterable[tuple[int, int, Hashable]], lo: int, hi: int, limit: int = 20) -> Coverage:
    """Find every gap in and every double ownership of ``[lo, hi)`` by the labelled intervals.

    One sort plus one pass: O(k log k) for k intervals, whatever the size of the space. Intervals
    are expected to lie inside ``[lo, hi)`` (clip them first); empty ones are ignored.
    """
    items = sorted(((s, e, label) for s, e, label in labelled if e > s), key=lambda t: (t[0], t[1]))
    cov = Coverage()
    cursor, owner = lo, None
    for s, e, label in items:
        if s > cursor:
            cov.gap_count += 1
            cov.gap_elements += s - cursor
            if len(cov.gaps) < limit:
                cov.gaps.append((cursor, s, owner, label))
        elif s < cursor:
            end = min(e, cursor)
            cov.overlap_count += 1
            cov.overlap_elements += end - s
            if len(cov.overlaps) < limit:
                cov.overlaps.append((s, end, owner, label))
        if e > cursor:
            cursor, owner = e, label
    if cursor < hi:
        cov.gap_count += 1
        cov.gap_elements += hi - cursor
        if len(cov.gaps) < limit:
            cov.gaps.append((cursor, hi, owner, None))
    return cov


def sweep_arrays(starts: Any, ends: Any, labels: Any, lo: int, hi: int, limit: int = 20) -> Coverage:
    """:func:`sweep` on numpy int64 arrays: the same gaps, overlaps, owners and counts, array arithmetic only.

    The intervals are ordered by (start, end) with a stable sort (skipped when already in order), the
    running end of everything before each interval is a cumulative maximum, and an interval starts
    a gap when it begins after that end and an overlap when it begins before it. O(k log k) for k
    intervals with no Python work per interval; element totals are summed as Python ints.
    """
    import numpy as np

    starts, ends, labels = np.asarray(starts), np.asarray(ends), np.asarray(labels)
    keep = ends > starts
    if not keep.all():
        starts, ends, labels = starts[keep], ends[keep], labels[keep]
    cov = Coverage()
    n = len(starts)
    if n == 0:
        if hi > lo:
            cov.gap_count, cov.gap_elements = 1, hi - lo
            if limit > 0:
                cov.gaps.append((lo, hi, None, None))
        return cov
    ties = (starts[1:] == starts[:-1]) & (ends[1:] >= ends[:-1])
    in_order = bool(np.all((starts[1:] > starts[:-1]) | ties))
    if not in_order:
        order = np.lexsort((ends, starts))
        starts, ends, labels = starts[order], ends[order], labels[order]
    run_max = np.maximum.accumulate(ends)
    cursor = np.empty(n, dtype=run_max.dtype)
    cursor[0] = lo
    np.maximum(run_max[:-1], lo, out=cursor[1:])
    idx = np.arange(n)
    # the owner of the cursor is the first interval that pushed the running end to its value
    pushed = np.empty(n, dtype=bool)
    pushed[0] = ends[0] > lo
    pushed[1:] = ends[1:] > cursor[1:]
    last_push = np.maximum.accumulate(np.where(pushed, idx, -1))

    def owner_before(i: int) -> Hashable | None:
        j = int(last_push[i - 1]) if i > 0 else -1
        return None if j < 0 else labels[j].item()

    gap_at = np.flatnonzero(starts > cursor)
    cov.gap_count = len(gap_at)
    cov.gap_elements = sum(int(s) - int(c) for s, c in zip(starts[gap_at], cursor[gap_at], strict=True))
    for i in gap_at[:limit].tolist():
        cov.gaps.append((int(cursor[i]), int(starts[i]), owner_before(i), labels[i].item()))
    over_at = np.flatnonzero(starts < cursor)
    cov.overlap_count = len(over_at)
    over_end = np.minimum(ends[over_at], cursor[over_at])
    cov.overlap_elements = sum(int(e) - int(s) for s, e in zip(starts[over_at], over_end, strict=True))
    for i, e in zip(over_at[:limit].tolist(), over_end[:limit].tolist(), strict=False):
        cov.overlaps.append((int(starts[i]), int(e), owner_before(i), labels[i].item()))
    end = max(int(run_max[-1]), lo)
    if end < hi:
        cov.gap_count += 1
        cov.gap_elements += hi - end
        if len(cov.gaps) < limit:
            cov.gaps.append((end, hi, owner_before(n), None))
    return cov
