"""One collective of the in-process simulator: the *rendezvous* where a group's members meet.

Each member's call (collective, op, root, array signature) is registered at the rendezvous of its
group and call number. A reduction folds each member's array into one accumulator as soon as every
lower member's is in (``((x0 op x1) op x2) ...``, so a run is bitwise reproducible and a pending
reduction holds one buffer rather than one per rank); the last member to arrive completes the
rendezvous, which computes every member's result or the mismatch that stops them all. The world that
schedules the ranks around it is :mod:`zerosim.comm.sim_world`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CollectiveError
from .collective_arrays import combine_into, concat, copy_array, is_torch, read_only, signature


class CollectiveAbandoned(CollectiveError):
    """Peers wait in a collective that some members can never join (they finished or wait elsewhere)."""

    def __init__(self, collective: str, missing_ranks: list[int], group: str, detail: str = ""):
        self.collective = collective
        self.missing_ranks = list(missing_ranks)
        self.group = group
        super().__init__(
            f"{collective} on group {group} can never complete; ranks that never arrived: "
            f"{self.missing_ranks}{' (' + detail + ')' if detail else ''}"
        )


class CollectiveMismatch(CollectiveError):
    """Members of one group called different collectives (or shapes, dtypes, ops, roots) at the same point."""


@dataclass
class Group:
    gid: int
    name: str
    global_ranks: tuple[int, ...]


@dataclass
class Call:
    collective: str
    op: str | None
    array: Any
    root: int | None
    extra: Any = None
    donated: bool = False  # the caller never reads ``array`` again: it may become the accumulator
    signature: Any = None  # (type, shape, dtype) of ``array``, kept after a fold drops the array

    def __post_init__(self) -> None:
        if self.array is not None:
            self.signature = signature(self.array)

    def matches(self, other: Call) -> bool:
        return (self.collective, self.op, self.root, self.signature) == (
            other.collective, other.op, other.root, other.signature)


#: the collectives whose members' arrays are folded into one accumulator as they arrive
FOLDED = ("all_reduce", "reduce_scatter")


@dataclass
class Rendezvous:
    group: Group
    seq: int
    calls: dict[int, Call] = field(default_factory=dict)  # group rank -> call
    results: dict[int, Any] = field(default_factory=dict)
    error: BaseException | None = None
    done: bool = False
    acc: Any = None  # reductions: ((x0 op x1) op x2) ... of the members folded so far
    folded: int = 0  # members 0 .. folded-1 are in ``acc`` (their arrays dropped)

    def fold(self) -> None:
        """Reductions: add every member whose predecessors are all in, in rank order, as soon as it
        arrives (the same additions, in the same order, as reducing at the end), and drop its array.
        A member that arrives while it is still hot in cache is added then, and the rendezvous holds
        one accumulator instead of every member's buffer. A call that does not match member 0's stops
        the folding; completing the rendezvous then reports the mismatch."""
        first = self.calls.get(0)
        if first is None or first.collective not in FOLDED:
            return
        while self.folded in self.calls:
            call = self.calls[self.folded]
            if not call.matches(first):
                return
            x = call.array
            if self.folded == 0:
                self.acc = x if call.donated else copy_array(x)
            else:
                combine_into(self.acc, x, first.op or "sum")
            call.array = None
            self.folded += 1

    @property
    def collective(self) -> str:
        return next(iter(self.calls.values())).collective if self.calls else "?"

    def missing(self) -> list[int]:
        return [g for i, g in enumerate(self.group.global_ranks) if i not in self.calls]

    def complete(self, new_group: Callable[[str, tuple[int, ...]], Group]) -> dict[int, Any]:
        """Every member's result once the last member has arrived (``new_group`` makes the groups of a
        split); CollectiveMismatch when the members' calls disagree."""
        calls = [self.calls[i] for i in range(len(self.group.global_ranks))]
        first = calls[0]
        for i, c in enumerate(calls):
            if (c.collective, c.op, c.root) != (first.collective, first.op, first.root):
                raise CollectiveMismatch(
                    f"group {self.group.name} call #{self.seq}: rank {self.group.global_ranks[0]} called "
                    f"{first.collective}(op={first.op}, root={first.root}) but rank "
                    f"{self.group.global_ranks[i]} "
                    f"called {c.collective}(op={c.op}, root={c.root})"
                )
        kind = first.collective
        n = len(calls)
        if kind == "barrier":
            return {i: None for i in range(n)}
        if kind == "split":
            return _complete_split(self.group, self.seq, [c.extra for c in calls], new_group)
        sigs = [c.signature for c in calls]
        if any(s != sigs[0] for s in sigs):
            ranks = self.group.global_ranks
            detail = ", ".join(f"rank {ranks[i]}: {(tuple(int(d) for d in s[1]), str(s[2]))}"
                               for i, s in enumerate(sigs))
            raise CollectiveMismatch(
                f"{kind} on group {self.group.name} call #{self.seq}: shapes/dtypes differ ({detail})"
            )
        if kind in FOLDED:
            # every member matched, so every member was folded into ``acc`` in rank order as it arrived
            assert self.folded == n, (self.folded, n)
            total = self.acc
            if first.op == "avg":
                total /= n
        if kind == "all_reduce":
            return {i: (total if i == n - 1 else copy_array(total)) for i in range(n)}
        if kind == "reduce_scatter":
            length = sigs[0][1][0] if sigs[0][1] else 0
            chunk = length // n
            # the whole buffer reduced in rank order once (element by element the same arithmetic as
            # reducing each chunk apart), then rank j gets its own chunk of it: n adds of the buffer,
            # not n * n slices
            return {j: total[j * chunk:(j + 1) * chunk] for j in range(n)}
        xs = [call.array for call in calls]
        if kind == "all_gather":
            out = concat(xs)
            if is_torch(out):
                return {i: (out if i == n - 1 else copy_array(out)) for i in range(n)}
            read_only(out)
            return {i: out for i in range(n)}
        if kind == "broadcast":
            src = xs[first.root or 0]
            return {i: (xs[i] if i == first.root else copy_array(src)) for i in range(n)}
        raise CollectiveError(f"unknown collective {kind!r}")


def _complete_split(parent: Group, seq: int, tokens: list[Any],
                new_group: Callable[[str, tuple[int, ...]], Group]) -> dict[int, Any]:
    """One new group per color, members ordered by (key, parent rank); each member gets its group."""
    by_color: dict[int, list[tuple[Any, int, str | None]]] = {}
    for grank, (color, key, name) in enumerate(tokens):
        if color is not None:
            by_color.setdefault(color, []).append((key, grank, name))
    table: dict[int, Group] = {}
    for color, members in sorted(by_color.items()):
        members.sort(key=lambda m: (m[0], m[1]))
        names = {m[2] for m in members}
        if len(names) > 1:
            raise CollectiveMismatch(
                f"split of group {parent.name}: members of color {color} disagree on "
                f"the group name: {sorted(str(n) for n in names)}"
            )

        name = names.pop() or f"{parent.name}/split{seq}:{color}"
        table[color] = new_group(name, tuple(parent.global_ranks[m[1]] for m in members))
    return {grank: (None if tok[0] is None else table[tok[0]]) for grank, tok in enumerate(tokens)}
