"""C-ZERO-001 violations of a ``zerosim check partition`` sweep, grouped by kind for the terminal.

A partitioner that is wrong is usually wrong the same way in many cases (the last rank holding the
remainder breaks the balance clause at every world size that does not divide the total), so one line
per violation buries the summary under near-identical lines. A *kind* is the clause and the message
with its numbers taken out (``shard holds # elements, not within # of total // world_size = #``); each
kind prints one line with its count, then its first few cases in full. ``--json`` keeps every
violation as it was.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..values.verdict import Violation

#: cases listed under each kind unless ``--limit`` says otherwise
DEFAULT_CASES_PER_KIND = 3
_NUMBER = re.compile(r"-?\d[\d_,]*(\.\d+)?(e[+-]?\d+)?")


def kind_of(violation: Violation) -> tuple[str, str, str]:
    """``(contract, clause, message with every number replaced by #)``: what makes two violations alike."""
    return violation.contract, violation.clause, _NUMBER.sub("#", violation.message)


def grouped_lines(violations: Sequence[Violation], per_kind: int | None, not_kept: int = 0) -> list[str]:
    """One line per kind (its count and clause, in order of first appearance), each followed by its first
    ``per_kind`` cases in full (every case when None); ``not_kept``: violations counted but not kept,
    said on a last line."""
    groups: dict[tuple[str, str, str], list[Violation]] = {}
    for v in violations:
        groups.setdefault(kind_of(v), []).append(v)
    lines: list[str] = []
    for (contract, clause, pattern), members in groups.items():
        count = "1 violation" if len(members) == 1 else f"{len(members):,} violations alike"
        lines.append(f"{contract} {clause}: {count} ({pattern})")
        shown = members if per_kind is None else members[:per_kind]
        lines += [f"  {v}" for v in shown]
        if len(members) > len(shown):
            lines.append(f"  ... and {len(members) - len(shown):,} more like it (--limit 0 lists every case, "
                         "--json every field)")
    if not_kept:
        lines.append(f"... {not_kept:,} more violations counted but not kept")
    return lines
