"""Diagnoses that name a group of tensors: the bug touched some of the model's tensors, not all.

A model's tensors fall into groups by name: ``moe.experts.3.fc.weight`` belongs to ``moe``,
``moe.experts``, ``moe.experts.*`` (an index stands for every index) and ``moe.experts.*.fc``. A bug
in how one kind of tensor is reduced (experts fed by an all-to-all exchange, a router reduced apart
from the other dense tensors) shows on exactly one such group. The classes, at the first failing step
(where the reference's gradient is known):

* ``gradient-scale`` on a group: the first SGD update of the tensors beyond the bound is the
  reference's gradient step times one constant factor, and every other tensor matches. At factor =
  world the group's gradients were summed over ranks, not averaged (experts: the exchange already sums
  every rank's tokens into the owner's gradient; Megatron-LM PR #5956, pytorch #160285).
* ``gradient-not-reduced``: at a failing SGD step the ranks hold different values of one group of
  tensors, their mean is the reference's, and every other tensor matches on every rank: each rank
  stepped that group with its own micro-batch's gradient (the router under expert parallelism,
  transformers #48687).
* ``logged-norm`` on a group: the logged norm is the norm of the reference's gradient over every
  tensor but one group (experts left out of the norm, Megatron-LM PR #5916).

The group named is the most specific one (fewest tensors; then the longest name) holding every
affected tensor, where its other tensors had no gradient at that step (an expert no token reached);
else the tensors themselves are listed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zerosim.values.verdict import Verdict

from .observation import StepRecord
from .outcome import Diagnosis

FACTOR_AGREEMENT = 0.9  # share of the large-gradient elements that must show the same factor (within 1%)
NORM_MATCH = 1e-6  # relative agreement of a logged norm with a group's complement norm


def common_factor(g: np.ndarray, r: np.ndarray) -> tuple[float, float] | None:
    """(the factor f with g = f r on the large elements of r, the share of them within 1% of it), or None
    when r has fewer than three large elements."""
    if r.size == 0 or not np.any(r):
        return None
    big = np.abs(r) > 0.1 * np.max(np.abs(r))
    if big.sum() < 3:
        return None
    ratio = g[big] / r[big]
    factor = float(np.median(ratio))
    return factor, float(np.mean(np.abs(ratio - factor) <= 0.01 * abs(factor)))


def _starred(name: str) -> tuple[str, ...]:
    return tuple("*" if part.isdigit() else part for part in name.split("."))


def name_group(names: Sequence[str], every: Sequence[str], idle: set[str]) -> str:
    """The most specific group (module docstring) holding all of ``names`` whose other tensors are all in
    ``idle`` (no gradient at the step), as ``prefix (k tensors)``; else the names themselves."""
    chosen = set(names)
    best: tuple[int, int, str] | None = None
    for name in names:
        parts = _starred(name)
        for depth in range(1, len(parts)):
            prefix = parts[:depth]
            members = {n for n in every if _starred(n)[:depth] == prefix}
            if chosen <= members and members - chosen <= idle and members != set(every):
                key = (len(members), -depth, ".".join(prefix))
                best = key if best is None or key < best else best
    if best is not None:
        return f"{best[2]} ({best[0]} tensors)"
    listed = ", ".join(list(names)[:3])
    return listed + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _beyond(rec: StepRecord, params: dict[str, np.ndarray], name: str) -> bool:
    err = np.abs(np.asarray(params[name], dtype=np.float64).reshape(-1) - rec.ref.params[name].reshape(-1))
    return bool((err > rec.bounds.params[name].reshape(-1)).any())


def _idle(rec: StepRecord) -> set[str]:
    """Tensors with no gradient at ``rec`` (zero everywhere in the reference)."""
    return {n for n, g in rec.ref.grad.items() if not np.any(g)}


def group_gradient_scale(rec: StepRecord, implied: np.ndarray,
                         params: dict[str, np.ndarray]) -> list[Diagnosis]:
    """``gradient-scale`` on a group (module docstring) at the first SGD step ``rec``: ``implied`` is the
    gradient the majority's update implies, flattened in parameter order, ``params`` that majority's
    parameters."""
    names = list(rec.ref.params_before)
    spans, lo = {}, 0
    for n in names:
        spans[n] = (lo, lo + rec.ref.params_before[n].size)
        lo = spans[n][1]
    reference = np.concatenate([rec.ref.grad[n].reshape(-1) for n in names])
    whole = common_factor(implied, reference)
    if whole is not None and whole[1] >= FACTOR_AGREEMENT:
        return []  # the whole model's update is scaled: the model-wide gradient-scale says it
    off = [n for n in names if _beyond(rec, params, n)]
    if not off or len(off) == len(names):
        return []
    pick = np.concatenate([np.arange(*spans[n]) for n in off])
    fit = common_factor(implied[pick], reference[pick])
    if fit is None or fit[1] < FACTOR_AGREEMENT or abs(fit[0] - 1) < 1e-3:
        return []
    factor, share = fit
    world = len(rec.ranks)
    group = name_group(off, names, _idle(rec))
    meaning = ""
    if abs(factor - world) <= 0.01 * world:
        meaning = (f" = the world size {world}: their gradients were summed over ranks, not averaged (an "
                   "expert's gradient after an all-to-all exchange already sums every rank's tokens: divide "
                   "it by the expert-parallel size)")
    elif abs(factor - 1 / world) <= 0.01 / world:
        meaning = f" = 1/world (world {world}): their gradients were divided by the world size twice"
    return [Diagnosis(
        "gradient-scale",
        f"the first SGD update (step {rec.step}) of {group} is the reference's gradient step times "
        f"{factor:.4g} on {share:.0%} of their large-gradient elements{meaning}; every other tensor matches",
    )]


def group_not_reduced(rec: StepRecord) -> list[Diagnosis]:
    """``gradient-not-reduced`` (module docstring) at the first failing step ``rec``."""
    if rec.phase != "sgd" or len(rec.ranks) < 2:  # SGD's step is linear: the ranks' mean is the reference's
        return []
    names = list(rec.ref.params)
    first = rec.ranks[0]
    differ = [n for n in names if any(
        not np.array_equal(np.ascontiguousarray(o.params[n]).view(np.uint8),
                           np.ascontiguousarray(first.params[n]).view(np.uint8)) for o in rec.ranks[1:])]
    if not differ or len(differ) == len(names):
        return []
    for n in names:
        if n in differ:
            exp = rec.ref.params[n]
            mean = np.mean([np.asarray(o.params[n], dtype=np.float64) for o in rec.ranks], axis=0)
            slack = rec.bounds.params[n] + 4 * np.finfo(np.float64).eps * np.abs(exp)
            if (np.abs(mean - exp) > slack).any():
                return []
        elif _beyond(rec, first.params, n):
            return []
    group = name_group(differ, names, _idle(rec))
    return [Diagnosis(
        "gradient-not-reduced",
        f"at step {rec.step} ({rec.phase}) the {len(rec.ranks)} ranks hold different values of {group} and "
        "their mean is the reference's, while every other tensor matches on every rank: each rank stepped "
        "those tensors with its own micro-batch's gradient; their all-reduce (mean over ranks) is missing",
    )]


def group_logged_norm(records: Sequence[StepRecord], outcome: Verdict | None) -> list[Diagnosis]:
    """``logged-norm`` naming the group left out (module docstring), when the logged norm is the norm of
    the reference's gradient over every tensor but one group."""
    if outcome is None or outcome.status != "fail":
        return []
    first = outcome.first_violation or {}
    step, rank = first.get("step"), first.get("rank")
    rec = next((r for r in records if r.step == step), None)
    if rec is None or rank is None or rank >= len(rec.ranks) or rec.ranks[rank].grad_norm is None:
        return []
    logged = float(rec.ranks[rank].grad_norm or 0.0)
    names = list(rec.ref.grad)
    squares = {n: float(np.sum(np.square(rec.ref.grad[n]))) for n in names}
    candidates: dict[tuple[str, ...], set[str]] = {}
    for n in names:
        parts = _starred(n)
        for depth in range(1, len(parts)):
            candidates.setdefault(parts[:depth], set()).add(n)
    for prefix, members in sorted(candidates.items(), key=lambda kv: (len(kv[1]), -len(kv[0]))):
        if len(members) == len(names) or not any(squares[n] for n in members):
            continue
        kept = sum(squares[n] for n in names if n not in members) ** 0.5
        if abs(kept - logged) <= NORM_MATCH * max(kept, 1e-300):
            group = ".".join(prefix)
            return [Diagnosis(
                "logged-norm",
                f"rank {rank} logged {logged:.6g} at step {step}: the norm of the reference's gradient over "
                f"every tensor but {group} ({len(members)} tensors), not over all of them "
                f"({rec.ref.grad_norm:.6g}): the norm leaves {group} out",
            )]
    return []
