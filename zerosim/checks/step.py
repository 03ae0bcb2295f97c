"""Step contracts C-ZERO-002..005: pure functions from observations to verdicts.

Inputs are plain data: :class:`~zerosim.observe.RankObservation` lists (numpy arrays, intervals,
traffic counters), a reference (:class:`~zerosim.engine.reference.Reference`: full unsharded state
per step), the plan, the unit plan and the communication estimate. No backend, no live array.

* C-ZERO-002 equivalence (:func:`check_equivalence`): every rank's shard of the float32 master and
  of every optimizer state equals the reference at the same global positions, every step: bitwise
  against the same-reduction-order reference, within the per-element rounding bound the independent
  ground truth carries (:mod:`zerosim.checks.rounding`) against it. Padding stays exactly zero. Step
  counters agree exactly, grad norm and clip factor within their bounds. Where the reference went
  non-finite, the comparison stops (outcome "diverged", not a violation).
* C-ZERO-003 post-gather identity (:func:`check_post_gather_identity`): after each step every rank's
  gathered working parameters are bitwise equal, and equal the working-dtype cast of the master
  assembled from the shards (so ranks that are all equally stale fail too).
* C-ZERO-004 ownership (:func:`check_ownership`): what each rank holds (measured from its live
  arrays) is exactly the plan's intervals, with the engine's packing padding, at the right bytes;
  the memory tracker agrees; transient buffers are freed at the end of the step; under ZeRO-3 the
  peak of live parameter bytes stays within the shard plus ``(1 + prefetch)`` gathered units.
* C-ZERO-005 communication (:func:`check_communication`): each rank's data traffic per step, per
  group kind and collective (calls, bytes sent, bytes received), equals the ring model exactly.

Diagnostics name contract, clause, step, rank, tensor, flat element range, expected vs got.

Why one module of this length: the four step contracts share the clause collector and the
mismatch diagnostics (tensor name, element, bits) that make their violations read alike; each
contract has its own banner below.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ..dtypes import itemsize
from ..intervals import first_difference
from ..layout import ParamLayout
from ..observe import RankObservation, ShardValues, digest
from ..verdict import Verdict
from ..xp import numpy_namespace
from .collect import ViolationCollector
from .tolerance import EQUIVALENCE_TOLERANCE, Tolerance

MAX_PER_CLAUSE = 8

# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def _clauses(contract: str, context: dict[str, Any] | None = None) -> ViolationCollector:
    """The collector of a step contract: at most MAX_PER_CLAUSE violations kept per clause."""
    return ViolationCollector(contract, context, per_clause=MAX_PER_CLAUSE)


def _done(col: ViolationCollector, **details: Any) -> Verdict:
    """The collected verdict; the findings not kept are counted per clause in ``violations_not_listed``."""
    hidden = col.not_listed_by_clause()
    if hidden:
        details["violations_not_listed"] = hidden
    return col.verdict(**details)


def tensor_at(layout: ParamLayout | None, index: int) -> tuple[str | None, int]:
    """(tensor name, offset of the tensor) of a global flat index."""
    if layout is None or not layout.tensors:
        return None, 0
    offsets = layout.offsets
    i = max(bisect.bisect_right(offsets, index) - 1, 0)
    return layout.tensors[i].name, offsets[i]


def _first_run(mask: np.ndarray) -> tuple[int, int]:
    """[start, end) of the first run of True values in ``mask``."""
    start = int(np.argmax(mask))
    rest = mask[start:]
    stop = int(np.argmin(rest)) if not rest.all() else len(rest)
    return start, start + stop


def _values_at(sv: ShardValues) -> tuple[np.ndarray, np.ndarray]:
    """(global indices, values) of the real elements of a shard, in storage order."""
    idx = [np.arange(g0, g1, dtype=np.int64) for g0, g1, _ in sv.pieces]
    vals = [sv.values[pos:pos + g1 - g0] for g0, g1, pos in sv.pieces]
    if not idx:
        return np.zeros(0, dtype=np.int64), sv.values[:0]
    return np.concatenate(idx), np.concatenate(vals)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1) if a.size else a.view(np.uint8)


def _same_bits(got: np.ndarray, exp: np.ndarray) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes (one comparison of their elements
    as unsigned integers of the same width; -0.0 vs 0.0 and NaN payloads differ)."""
    size = got.dtype.itemsize
    if size not in (1, 2, 4, 8):
        return bool(np.array_equal(_bits(got), _bits(exp)))
    view = np.dtype(f"u{size}")
    return bool(np.array_equal(np.ascontiguousarray(got).view(view), np.ascontiguousarray(exp).view(view)))


def _bitwise_diff(got: np.ndarray, exp: np.ndarray) -> np.ndarray:
    """Mask of elements whose bytes differ (so -0.0 vs 0.0 and NaN payloads count)."""
    if got.dtype != exp.dtype:
        return np.ones(got.shape[0], dtype=bool)
    if got.shape == exp.shape and _same_bits(got, exp):  # the common case, in one comparison
        return np.zeros(got.shape[0], dtype=bool)
    g, e = _bits(got), _bits(exp)
    return (g != e).any(axis=1) if g.ndim == 2 else g != e


def _describe_mismatch(layout: ParamLayout | None, idx: np.ndarray, mask: np.ndarray, got: np.ndarray,
                       exp: np.ndarray) -> tuple[str | None, tuple[int, int], Any, Any, str]:
    a, b = _first_run(mask)
    g0 = int(idx[a])
    tensor, toff = tensor_at(layout, g0)
    # the run may cross tensors or pieces: cut it where the global indices stop being consecutive
    end = a + 1
    while end < b and idx[end] == idx[end - 1] + 1 and tensor_at(layout, int(idx[end]))[0] == tensor:
        end += 1
    interval = (g0, int(idx[end - 1]) + 1)
    diff = np.abs(got[mask].astype(np.float64) - exp[mask].astype(np.float64))
    with np.errstate(invalid="ignore"):
        maxdiff = float(np.nanmax(diff)) if diff.size and not np.isnan(diff).all() else float("nan")
    where = f" (elements [{interval[0] - toff}, {interval[1] - toff}) of the tensor)" if tensor else ""
    msg = f"{int(mask.sum())} of {mask.size} elements differ{where}; max |diff| {maxdiff:.3g}"
    return tensor, interval, float(exp[a]), float(got[a]), msg


# ---------------------------------------------------------------------------------------------------
# C-ZERO-002 equivalence
# ---------------------------------------------------------------------------------------------------


def check_equivalence(
    observations: Sequence[RankObservation],
    reference: Any,
    *,
    layout: ParamLayout | None = None,
    bitwise: bool = False,
    tolerance: Tolerance | None = None,
    contract: str = "C-ZERO-002",
) -> Verdict:
    """Sharded master weights and optimizer state equal the reference at every step.

    ``reference.steps[s]`` holds the full ``master``, ``state`` (by name), ``optimizer_step``,
    ``grad_norm``, ``clip_coef`` and optionally ``grads``. ``bitwise`` demands identical bits
    (same reduction order). Otherwise a step that carries per-element ``bounds`` (by kind: "master",
    "optimizer.<name>"; the ground truth's, :mod:`zerosim.checks.rounding`) and ``grad_norm_bound`` /
    ``clip_coef_bound`` is judged by them, and one without by ``tolerance`` (the normwise fallback,
    :data:`EQUIVALENCE_TOLERANCE`). A reference with ``diverged_at = s`` (it went non-finite at step
    s) is compared on the steps before s only; the verdict's outcome is then "diverged".
    """
    tol = tolerance or EQUIVALENCE_TOLERANCE["fp32"]
    mode = "bitwise" if bitwise else "allclose"
    col = _clauses(contract, {"reference": getattr(reference, "name", "?"), "mode": mode})
    diverged_at = getattr(reference, "diverged_at", None)
    checked = 0
    max_abs: dict[str, float] = {}
    max_rel: dict[str, float] = {}
    max_over_bound: dict[str, float] = {}
    derived = False
    failed_kinds: set[tuple[int, str]] = set()
    for obs in observations:
        for so in obs.steps:
            if diverged_at is not None and so.step >= diverged_at:
                continue  # the reference is not finite from here on: nothing to compare against
            if so.step >= len(reference.steps):
                col.add(
                    "steps",
                    f"the reference has {len(reference.steps)} steps; rank observed step {so.step}",
                    step=so.step,
                    ranks=(obs.rank,),
                )
                continue
            ref = reference.steps[so.step]
            bounds = None if bitwise else getattr(ref, "bounds", None)
            derived = derived or bounds is not None
            kinds: list[tuple[str, ShardValues | None, np.ndarray | None]] = [
                ("master", so.master, ref.master)
            ]
            kinds += [(f"optimizer.{n}", so.optimizer.get(n), ref.state.get(n)) for n in sorted(ref.state)]
            if bitwise and getattr(ref, "grads", None) is not None:
                kinds.append(("grads", so.grads, ref.grads))
            for kind, sv, full in kinds:
                if sv is None or full is None:
                    continue
                checked += 1
                idx, got = _values_at(sv)
                exp = full[idx]
                pad_pos = sv.padding_positions()
                pad = sv.values[pad_pos]
                # -0.0 is zero: an AdamW decay factor 1 - lr * wd below zero turns a zero into -0.0
                with np.errstate(invalid="ignore"):
                    nz = np.flatnonzero(~(pad == 0)) if pad.size else pad_pos[:0]
                if nz.size:
                    p0 = int(pad_pos[nz[0]])
                    run = 1
                    while run < nz.size and pad_pos[nz[run]] == p0 + run:
                        run += 1
                    col.add(
                        "padding",
                        f"{kind}: {nz.size} padding elements are not zero (padding leaked into "
                        f"values), first at shard positions [{p0}, {p0 + run})",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=kind,
                        expected=0.0,
                        got=float(pad[nz[0]]),
                        context={"state": kind, "shard_positions": (p0, p0 + run)},
                    )
                if (obs.rank, kind) in failed_kinds:
                    continue  # report the first step a kind diverges on each rank, not every later step
                allowed: np.ndarray | float | None = None
                if bitwise:
                    mask = _bitwise_diff(got, exp)
                else:
                    g64, e64 = got.astype(np.float64), exp.astype(np.float64)
                    scale = float(np.max(np.abs(full))) if full.size else 0.0
                    err = np.abs(g64 - e64)
                    if bounds is not None and kind in bounds:
                        allowed = bounds[kind][idx]
                    else:
                        allowed = tol.atol_scale * scale
                    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                        mask = ~(err <= allowed)
                        if err.size and isinstance(allowed, np.ndarray):
                            ratio = np.where(err > 0, err / allowed, 0.0)
                            max_over_bound[kind] = max(
                                max_over_bound.get(kind, 0.0),
                                float(np.nanmax(ratio)) if not np.isnan(ratio).all() else float("inf"),
                            )
                        if err.size:
                            max_abs[kind] = max(
                                max_abs.get(kind, 0.0),
                                float(np.nanmax(err)) if not np.isnan(err).all() else float("inf"),
                            )
                            rel = err / np.maximum(np.abs(e64), scale * 1e-30 + 1e-45)
                            max_rel[kind] = max(
                                max_rel.get(kind, 0.0),
                                float(np.nanmax(rel)) if not np.isnan(rel).all() else float("inf"),
                            )
                if mask.any():
                    failed_kinds.add((obs.rank, kind))
                    tensor, interval, e, g, msg = _describe_mismatch(layout, idx, mask, got, exp)
                    if isinstance(allowed, np.ndarray):
                        msg += f"; derived bound at the first {float(allowed[int(np.argmax(mask))]):.3g}"
                    col.add(
                        mode,
                        f"{kind} differs from the reference: {msg}",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                        context={"state": kind},
                    )
            if so.optimizer_step != ref.optimizer_step:
                col.add("step_counter", "optimizer step counter differs from the reference", step=so.step,
                        ranks=(obs.rank,), expected=ref.optimizer_step, got=so.optimizer_step)
            nr = tol.norm_rtol if not bitwise else 0.0
            norm_bound = getattr(ref, "grad_norm_bound", None) if not bitwise else None
            clip_bound = getattr(ref, "clip_coef_bound", None) if not bitwise else None
            allowed_norm = nr * abs(ref.grad_norm) if norm_bound is None else norm_bound
            allowed_clip = nr * abs(ref.clip_coef) if clip_bound is None else clip_bound
            if not abs(so.grad_norm - ref.grad_norm) <= allowed_norm:
                col.add("grad_norm", "global gradient norm differs from the reference", step=so.step,
                        ranks=(obs.rank,), expected=ref.grad_norm, got=so.grad_norm,
                        context={"bound": allowed_norm})
            if not abs(so.clip_coef - ref.clip_coef) <= allowed_clip:
                col.add(
                    "clip_coef",
                    "clip coefficient differs from the reference (norm not global?)",
                    step=so.step,
                    ranks=(obs.rank,),
                    expected=ref.clip_coef,
                    got=so.clip_coef,
                    context={"bound": allowed_clip},
                )
    extra: dict[str, Any] = {}
    if derived:
        extra = {"bound": "derived per-element rounding bound (zerosim.checks.rounding)",
                 "max_error_over_bound": max_over_bound}
    if diverged_at is not None:
        extra["diverged_at"] = diverged_at
        extra["diverged"] = (f"the reference went non-finite (loss or state) at step {diverged_at}: "
                             f"compared steps before it only")
    tolerance_json = None if bitwise or derived else tol.to_json()
    v = _done(col, mode=mode, tolerance=tolerance_json, max_abs_error=max_abs, max_rel_error=max_rel, **extra)
    v.diverged_at = diverged_at
    v.checked = checked
    return v


# ---------------------------------------------------------------------------------------------------
# C-ZERO-003 post-gather identity
# ---------------------------------------------------------------------------------------------------


def assemble(observations: Sequence[RankObservation], step: int, kind: str = "master",
             ranks: Sequence[int] | None = None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The full array of ``kind`` at ``step`` assembled from the shards of ``ranks`` (default all), and
    a mask of the elements nobody covered (None when no observation has values)."""
    out: np.ndarray | None = None
    covered: np.ndarray | None = None
    for obs in observations:
        if ranks is not None and obs.rank not in ranks:
            continue
        so = next((s for s in obs.steps if s.step == step), None)
        if so is None:
            continue
        sv = so.master if kind == "master" else so.optimizer.get(kind.removeprefix("optimizer."))
        if sv is None:
            return None, None
        if out is None or covered is None:
            total = max((g1 for _, g1, _ in sv.pieces), default=0)
            for o in observations:
                s2 = next((s for s in o.steps if s.step == step), None)
                if s2 is not None and s2.master is not None:
                    total = max(total, max((g1 for _, g1, _ in s2.master.pieces), default=0))
            out = np.zeros(total, dtype=sv.values.dtype)
            covered = np.zeros(total, dtype=bool)
        for g0, g1, pos in sv.pieces:
            out[g0:g1] = sv.values[pos:pos + g1 - g0]
            covered[g0:g1] = True
    return out, (None if covered is None else ~covered)


def check_post_gather_identity(observations: Sequence[RankObservation], *, layout: ParamLayout | None = None,
                               contract: str = "C-ZERO-003") -> Verdict:
    """After each step, every rank's gathered working parameters are bitwise identical, and equal the
    working-dtype cast of the float32 master assembled from its shard group's shards."""
    col = _clauses(contract)
    checked = 0
    steps = sorted({s.step for o in observations for s in o.steps})
    by_rank = {o.rank: o for o in observations}
    for step in steps:
        rows = [
            (o.rank, next(s for s in o.steps if s.step == step))
            for o in observations
            if any(s.step == step for s in o.steps)
        ]
        if not rows:
            continue
        base_rank, base = rows[0]
        for rank, so in rows[1:]:
            checked += 1
            if so.gathered is not None and base.gathered is not None:
                mask = _bitwise_diff(so.gathered, base.gathered)
                if mask.any():
                    idx = np.arange(mask.size)
                    tensor, interval, e, g, msg = _describe_mismatch(
                        layout, idx, mask, so.gathered, base.gathered
                    )
                    col.add(
                        "identical",
                        f"rank {rank}'s gathered weights differ from rank {base_rank}'s: {msg}",
                        step=step,
                        ranks=(base_rank, rank),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                    )
            else:
                bad = sorted(t for t, d in so.gathered_digest.items() if base.gathered_digest.get(t) != d)
                if bad:
                    col.add(
                        "identical",
                        f"rank {rank}'s gathered weights differ from rank {base_rank}'s in "
                        f"{len(bad)} tensors (digests)",
                        step=step,
                        ranks=(base_rank, rank),
                        tensor=bad[0],
                    )
        # the gathered weights must be the current master (not equally stale everywhere)
        groups: dict[int, list[int]] = {}
        for rank, _ in rows:
            groups.setdefault(by_rank[rank].shard_group, []).append(rank)
        for members in groups.values():
            master, missing = assemble(observations, step, "master", members)
            if master is None or missing is None or missing.any():
                continue
            for rank in members:
                so = next(s for s in by_rank[rank].steps if s.step == step)
                if so.gathered is None:
                    if so.gathered_digest and layout is not None and "params" in so.holdings:
                        checked += 1
                        cast = master.astype(numpy_namespace().dtype(so.holdings["params"].dtype))
                        want = {t.name: digest(cast[g0:g0 + t.numel])
                                for t, g0 in zip(layout.tensors, layout.offsets, strict=True)}
                        bad = sorted(t for t, d in so.gathered_digest.items() if want.get(t) != d)
                        if bad:
                            col.add(
                                "matches_master",
                                f"rank {rank} computes with weights that are not the updated "
                                f"master of its shard group (stale?) in {len(bad)} tensors (digests)",
                                step=step,
                                ranks=(rank,),
                                tensor=bad[0],
                            )
                    continue
                checked += 1
                expected = master.astype(so.gathered.dtype)
                mask = _bitwise_diff(so.gathered, expected)
                if mask.any():
                    idx = np.arange(mask.size)
                    tensor, interval, e, g, msg = _describe_mismatch(layout, idx, mask, so.gathered, expected)
                    col.add(
                        "matches_master",
                        f"rank {rank} computes with weights that are not the updated master "
                        f"of its shard group (stale?): {msg}",
                        step=step,
                        ranks=(rank,),
                        tensor=tensor,
                        interval=interval,
                        expected=e,
                        got=g,
                    )
    observed = any(s.gathered is not None or s.gathered_digest for o in observations for s in o.steps)
    if not observed:
        v = _done(col, skipped="no gathered weights were observed (observe='none')")
    else:
        v = _done(col, steps=len(steps), ranks=len(observations))
    v.checked = checked
    return v


# ---------------------------------------------------------------------------------------------------
# C-ZERO-004 ownership
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OwnershipExpectation:
    """What the plan says a rank must hold, and the byte rules of the run (built by the engine's evaluate)."""

    plan: Any                 # zerosim.plan.StatePlan
    padding: dict[str, list[int]]  # kind -> per-rank padding the engine's packing stores
    bytes_per_element: dict[str, int]  # kind -> bytes per stored element summed over arrays of that kind
    peak_live_param_bound: list[int] | None = None  # per rank (sharded params only)
    prefetch: int = 0


def check_ownership(observations: Sequence[RankObservation], expect: OwnershipExpectation, *,
                    layout: ParamLayout | None = None, contract: str = "C-ZERO-004") -> Verdict:
    """What each rank holds matches the plan; memory accounting agrees; transients freed; ZeRO-3 peak bound.
    """
    col = _clauses(contract)
    checked = 0
    plan = expect.plan
    for obs in observations:
        rs = plan.rank(obs.rank)
        for so in obs.steps:
            for kind in ("params", "grads", "optimizer"):
                h = so.holdings.get(kind)
                if h is None:
                    col.add("intervals", f"rank reports no {kind} holding", step=so.step, ranks=(obs.rank,))
                    continue
                checked += 1
                want = rs.holding(kind)
                diff = first_difference(h.intervals, want.intervals)
                if diff is not None:
                    tensor, _ = tensor_at(layout, diff[0])
                    holds = any(s <= diff[0] < e for s, e in h.intervals)
                    col.add(
                        "intervals",
                        f"{kind}: rank {'holds' if holds else 'is missing'} elements the plan "
                        f"{'does not give it' if holds else 'assigns to it'}",
                        step=so.step,
                        ranks=(obs.rank,),
                        tensor=tensor,
                        interval=diff,
                        expected=f"{want.numel} elements",
                        got=f"{h.real_numel} elements",
                        context={"kind": kind},
                    )
                exp_pad = expect.padding[kind][obs.rank]
                if h.padding != exp_pad:
                    col.add("padding", f"{kind}: stored padding differs from the packing rule", step=so.step,
                            ranks=(obs.rank,), expected=exp_pad, got=h.padding, context={"kind": kind,
                            "partitioner_padding": want.padding})
                exp_bytes = h.stored_numel * expect.bytes_per_element[kind]
                if h.nbytes != exp_bytes:
                    col.add(
                        "bytes",
                        f"{kind}: live bytes differ from stored elements x bytes per element",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=exp_bytes,
                        got=h.nbytes,
                        context={"kind": kind},
                    )
            mem = so.memory
            if mem is None:
                continue
            live = {c: sum(mem.live_at_end.get(loc, {}).get(c, 0) for loc in mem.live_at_end) for c in
                    ("params", "grads", "optimizer", "gathered", "grad_buffers", "activations")}
            for kind in ("params", "grads", "optimizer"):
                h = so.holdings.get(kind)
                if h is not None and live[kind] != h.nbytes:
                    col.add(
                        "tracker",
                        f"{kind}: the memory tracker reports {live[kind]} live bytes, the live arrays "
                        f"hold {h.nbytes}",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=h.nbytes,
                        got=live[kind],
                    )
            for cat in ("gathered", "grad_buffers", "activations"):
                if live[cat]:
                    buffers = list(getattr(mem, "live_keys_at_end", {}).get(cat, []))
                    col.add(
                        "transients_freed",
                        f"{live[cat]} bytes of {cat} still live at the end of the step "
                        f"({len(buffers)} buffer(s))",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=0,
                        got=live[cat],
                        tensor=buffers[0].split(":")[1] if buffers and ":" in buffers[0] else None,
                        context={"category": cat, "buffers": buffers},
                    )
            if expect.peak_live_param_bound is not None:
                bound = expect.peak_live_param_bound[obs.rank]
                if mem.peak_live_params > bound:
                    col.add(
                        "peak_bound",
                        "peak live parameter bytes (shard + gathered blocks) exceed the plan's "
                        f"bound (shard + {1 + expect.prefetch} largest gathered unit(s))",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected=bound,
                        got=mem.peak_live_params,
                    )
    v = _done(col,
        peaks={o.rank: [s.memory.peak_live_params for s in o.steps if s.memory] for o in observations}
    )
    v.checked = checked
    return v


# ---------------------------------------------------------------------------------------------------
# C-ZERO-005 communication
# ---------------------------------------------------------------------------------------------------


def check_communication(observations: Sequence[RankObservation], estimate: Any, *,
                        contract: str = "C-ZERO-005") -> Verdict:
    """Each rank's measured data traffic per step equals the ring model, per group kind and collective."""
    col = _clauses(contract, {"strategy": estimate.strategy})
    expected = estimate.expected()
    checked = 0
    for obs in observations:
        for so in obs.steps:
            got = so.traffic_by_collective()
            keys = sorted(set(expected) | set(got))
            checked += max(1, len(keys))  # no traffic expected and none measured is a check too
            for key in keys:
                e = expected.get(key, (0, Fraction(0), Fraction(0)))
                g = got.get(key, (0, Fraction(0), Fraction(0)))
                if e != g:
                    what = "missing" if g[0] == 0 else ("unexpected" if e[0] == 0 else "differs")
                    col.add(
                        "ring_model",
                        f"{key[1]} on the {key[0]} group: traffic {what} (calls {g[0]} vs {e[0]} expected)",
                        step=so.step,
                        ranks=(obs.rank,),
                        expected={"calls": e[0], "bytes_sent": float(e[1]), "bytes_received": float(e[2])},
                        got={"calls": g[0], "bytes_sent": float(g[1]), "bytes_received": float(g[2])},
                        context={"group_kind": key[0], "collective": key[1]},
                    )
    measured_total = [float(s.bytes_sent()) for o in observations[:1] for s in o.steps]
    v = _done(col,
        model_bytes_sent_per_rank=float(estimate.bytes_sent),
        measured_bytes_sent_rank0=measured_total,
        paper_elements_per_rank=float(estimate.paper_elements()),
        padding_elements=estimate.padding,
    )
    v.checked = checked
    return v


def itemsizes(precision: Any) -> dict[str, int]:
    """Bytes per element of the working params and of float32 state."""
    return {"params": itemsize(precision.param_dtype), "float32": 4}
