"""The evidence every diagnosis reads off the step records: which elements of a rank lie beyond the
bound, the first failing step, the parameters most ranks hold, and the gradient the first SGD update
implies (lr and weight decay recovered from the reference's own step).

Pure functions of :class:`~zerosim.verify.observation.StepRecord` values, shared by the diagnoses of
C-ZERO-001, C-ZERO-002, C-ZERO-003 and C-ZERO-008 (:mod:`zerosim.verify.diagnosis`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from zerosim.values.observe import TrainerObservation

from .observation import StepRecord


def failing(rec: StepRecord, obs: TrainerObservation) -> dict[str, np.ndarray]:
    """Per tensor, the mask of elements of ``obs`` beyond the bound at ``rec``."""
    out = {}
    for name, exp in rec.ref.params.items():
        err = np.abs(obs.params[name].astype(np.float64).reshape(-1) - exp.reshape(-1))
        mask = err > rec.bounds.params[name].reshape(-1)
        if mask.any():
            out[name] = mask
    return out


def _state_failing(rec: StepRecord, obs: TrainerObservation) -> bool:
    for name, entry in (obs.state or {}).items():
        ref = rec.ref.state.get(name, {})
        for key, got in entry.items():
            if key not in ref:
                continue
            if key == "step":
                if float(np.asarray(got).reshape(-1)[0]) != float(np.asarray(ref[key]).reshape(-1)[0]):
                    return True
                continue
            bound = rec.bounds.state.get(name, {}).get(key)
            if bound is not None and (np.abs(np.asarray(got, dtype=np.float64) - ref[key]) > bound).any():
                return True
    return False


def record_fails(rec: StepRecord) -> bool:
    return any(failing(rec, o) or _state_failing(rec, o) for o in rec.ranks)


def majority(rec: StepRecord) -> TrainerObservation:
    """The observation most ranks hold bitwise (ties: the lowest rank)."""
    keys = [b"".join(np.ascontiguousarray(o.params[n]).tobytes() for n in rec.ref.params) for o in rec.ranks]
    counts = {k: keys.count(k) for k in keys}
    best = max(range(len(keys)), key=lambda i: (counts[keys[i]], -i))
    return rec.ranks[best]


def ranks_agree(rec: StepRecord) -> bool:
    first = rec.ranks[0]
    return all(
        np.array_equal(
            np.ascontiguousarray(o.params[n]).view(np.uint8),
            np.ascontiguousarray(first.params[n]).view(np.uint8),
        )
        for o in rec.ranks[1:]
        for n in rec.ref.params
    )


def params_key(rec: StepRecord, obs: TrainerObservation) -> bytes:
    """The bytes of every parameter ``obs`` holds (equal keys: bitwise the same values)."""
    return b"".join(np.ascontiguousarray(obs.params[n]).tobytes() for n in rec.ref.params)


def ranges(mask: np.ndarray, limit: int = 3) -> str:
    padded = np.concatenate([[False], mask, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])
    pairs = [f"[{a}:{b}]" for a, b in zip(edges[::2][:limit], edges[1::2][:limit], strict=True)]
    more = len(edges) // 2 - limit
    return ", ".join(pairs) + (f" and {more} more range(s)" if more > 0 else "")


def phase_records(records: Sequence[StepRecord], phase: str) -> list[StepRecord]:
    return [r for r in records if r.phase == phase]


def first_sgd_update(records: Sequence[StepRecord]) -> tuple[StepRecord, np.ndarray] | None:
    """The first SGD step when it fails, and the gradient its majority update implies (the update
    divided by the learning rate, weight decay taken off), flattened in parameter order."""
    rec = next((r for r in records if r.phase == "sgd" and r.ref.phase_step == 1), None)
    if rec is None or not record_fails(rec):
        return None
    obs = majority(rec)
    lr = _sgd_lr(rec)
    wd = _sgd_wd(rec)
    if lr is None:
        return None
    got = []
    for n, before in rec.ref.params_before.items():
        decay = wd * before.reshape(-1)
        got.append((before.reshape(-1) - obs.params[n].astype(np.float64).reshape(-1)) / lr - decay)
    return rec, np.concatenate(got)


def flat(grads: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray:
    return np.concatenate([grads[n].reshape(-1) for n in names])


def _sgd_lr(rec: StepRecord) -> float | None:
    # lr from the reference's own step: p_before - p_after = lr (g + wd p_before) at SGD's first step;
    # a tensor whose gradient was None is left out: torch.optim does not step it, decay included
    num = den = 0.0
    wd = _sgd_wd(rec)
    for n, before in rec.ref.params_before.items():
        if not np.any(rec.ref.grad[n]):
            continue
        d = before.reshape(-1) - rec.ref.params[n].reshape(-1)
        s = rec.ref.grad[n].reshape(-1) + wd * before.reshape(-1)
        num += float(d @ s)
        den += float(s @ s)
    return num / den if den > 0 else None


def _sgd_wd(rec: StepRecord) -> float:
    # weight decay from the momentum buffer after the first step: buf = g + wd p_before
    num = den = 0.0
    for n, before in rec.ref.params_before.items():
        buf = rec.ref.state.get(n, {}).get("momentum_buffer")
        if buf is None:
            continue
        num += float((buf.reshape(-1) - rec.ref.grad[n].reshape(-1)) @ before.reshape(-1))
        den += float(before.reshape(-1) @ before.reshape(-1))
    return num / den if den > 0 else 0.0

