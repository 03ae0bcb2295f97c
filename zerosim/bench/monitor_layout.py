"""The monitor's C-ZERO-001 layout check at scale:
:func:`zerosim.checks.owned_intervals.owned_intervals_verdict` timed on the owned ranges of a Llama-like
70B model (80 layers of 9 tensors, embedding, final norm and head: 723 tensors, 70.55e9 parameters)
on ``world`` ranks, as ``zerosim bench monitor`` reports it:

* FSDP2 over all ranks (every tensor cut on dim 0 into ``world`` row ranges, as DTensor ``Shard(0)``);
* HSDP, ``world / 8`` replicas of 8 shards (rank r holds shard r % 8);
* the same FSDP2 layout with one rank's range of one tensor moved (a gap and an overlap), which must
  fail naming that tensor.

The ranges are built before the clock starts; the time is the check's alone.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ..checks.owned_intervals import owned_intervals_verdict

HSDP_SHARD = 8


def llama_70b_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a Llama-like 70B model (grouped-query attention, 8 key/value heads)."""
    d, ff, kv, vocab = 8192, 28672, 1024, 128256
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    for i in range(80):
        p = f"layers.{i}."
        shapes.update({p + "q.weight": (d, d), p + "k.weight": (kv, d), p + "v.weight": (kv, d),
                       p + "o.weight": (d, d), p + "gate.weight": (ff, d), p + "up.weight": (ff, d),
                       p + "down.weight": (d, ff), p + "attn_norm.weight": (d,), p + "mlp_norm.weight": (d,)})
    shapes["norm.weight"] = (d,)
    shapes["head.weight"] = (vocab, d)
    return shapes


def dim0_ranges(shapes: dict[str, tuple[int, ...]], world: int, shard: int) -> dict[int, dict[str, list]]:
    """Each rank's owned flat ranges when every tensor is cut on dim 0 into ``shard`` row ranges and rank
    r holds range r % shard."""
    owned: dict[int, dict[str, list]] = {r: {} for r in range(world)}
    for name, shape in shapes.items():
        rows, row = shape[0], math.prod(shape[1:])
        per = -(-rows // shard)
        cuts = [(min(g * per, rows) * row, min((g + 1) * per, rows) * row) for g in range(shard)]
        for r in range(world):
            a, b = cuts[r % shard]
            owned[r][name] = [(a, b)] if b > a else []
    return owned


def layout_check_times(world: int) -> dict[str, Any]:
    """Seconds of the C-ZERO-001 check on the three layouts of the module docstring, and what each found."""
    shapes = llama_70b_shapes()
    numels = {n: math.prod(s) for n, s in shapes.items()}
    result: dict[str, Any] = {"world": world, "tensors": len(numels), "parameters": sum(numels.values())}
    cases = {"fsdp2": dim0_ranges(shapes, world, world)}
    if world % HSDP_SHARD == 0 and world > HSDP_SHARD:
        cases[f"hsdp {world // HSDP_SHARD}x{HSDP_SHARD}"] = dim0_ranges(shapes, world, HSDP_SHARD)
    broken = dim0_ranges(shapes, world, world)
    moved = "layers.3.q.weight"
    a, b = broken[min(5, world - 1)][moved][0]
    broken[min(5, world - 1)][moved] = [(a - 10, b - 10)]
    cases["fsdp2, one range moved"] = broken
    for label, owned in cases.items():
        started = time.perf_counter()
        verdict, layout = owned_intervals_verdict(owned, numels)
        result[label] = {"seconds": time.perf_counter() - started, "ranges": verdict.details["ranges"],
                         "layout": layout, "passed": verdict.passed,
                         "violations": [str(v) for v in verdict.violations[:2]]}
    return result
