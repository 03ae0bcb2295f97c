"""The diagnosis ``matrix-optimizer-on-shard``: a matrix optimizer (Adafactor, Muon, a user's) stepped
on slices of its tensors instead of whole tensors.

Adafactor factors a matrix's second moment into row and column statistics and scales its step by the
tensor's RMS; Muon orthogonalises each whole 2-D update. Given a row block or a flat slice of a
matrix as if it were the tensor, both compute another update, silently (DeepSpeed #8443: ZeRO-3 ran
Muon's orthogonalisation on its partitions). The signature, at the first step C-ZERO-002 fails in
such a phase:

* with ``local_shards()``: every tensor beyond the bound is split among ranks (some rank owns part of
  it, not all), and every tensor one rank owns whole is within it; or, where the layout cuts tensors
  but tensors held whole are off too, a flat buffer's partitions stepped each as one 1-D tensor (ZeRO-1
  and 2 with a client optimizer);
* without: (Muon) every tensor beyond the bound is 2-D, Muon's, while every other tensor (AdamW's,
  elementwise, so any split is exact) is within it.

A Muon phase in which only tensors of the AdamW half are off (none 2-D) is never this class: the
AdamW half is elementwise, so no split explains it.

A Muon phase whose off tensors are split can also be right up to rounding: a trainer that runs the
Newton-Schulz iteration on whole tensors whose pieces live on several ranks (DTensor's matmuls)
rounds its bfloat16 iteration in another order than the reference. :func:`muon_update_origin` tells
the two apart at the first failing step: it recomputes, in float64, Muon of each whole tensor and
Muon of each row block the ranks own (from the reference's gradient and momentum at that step), and
names the one the trainer's update is nearer to, ``muon-rounding-order`` (whole tensors) or
``matrix-optimizer-on-shard`` (row blocks), with the distances and the reference's own distance
from float64 (its bfloat16 rounding) beside them.
"""

from __future__ import annotations

import numpy as np

from zerosim.values.observe import TrainerObservation

from .observation import StepRecord
from .optimizers import is_elementwise
from .outcome import Diagnosis

_NS_DEFAULT = (3.4445, -4.775, 2.0315)


def _failing_tensors(rec: StepRecord, obs: TrainerObservation) -> list[str]:
    """The tensors with a parameter element beyond its bound at ``rec``."""
    out = []
    for name, exp in rec.ref.params.items():
        err = np.abs(obs.params[name].astype(np.float64).reshape(-1) - exp.reshape(-1))
        if (err > rec.bounds.params[name].reshape(-1)).any():
            out.append(name)
    return out


def split_tensors(rec: StepRecord) -> set[str] | None:
    """Tensors some rank owns part of but not all, from every rank's ``local_shards()`` (None: a rank
    exposes none)."""
    if any(obs.shards is None for obs in rec.ranks):
        return None
    split = set()
    for name, exp in rec.ref.params.items():
        size = int(np.size(exp))
        for obs in rec.ranks:
            owned = sum(stop - start for start, stop in (obs.shards or {}).get(name, []))
            if 0 < owned < size:
                split.add(name)
    return split


def matrix_optimizer_on_shard(first_bad: StepRecord) -> list[Diagnosis]:
    """``matrix-optimizer-on-shard`` when ``first_bad`` (the first failing step) shows the signature of
    the module docstring."""
    optimizer = first_bad.phase
    if is_elementwise(optimizer):
        return []
    obs = first_bad.ranks[0]
    failing = _failing_tensors(first_bad, obs)
    if not failing:
        return []
    if optimizer == "muon" and not any(np.ndim(first_bad.ref.params[n]) == 2 for n in failing):
        return []  # only tensors of Muon's AdamW half (elementwise: exact under any split) are off
    where = f"at step {first_bad.step} ({optimizer})"
    advice = (f"{optimizer} combines the elements of each tensor, so a slice stepped as if it were the "
              "tensor gets another update: give each tensor, with its optimizer state, whole to one rank")
    split = split_tensors(first_bad)
    if split is not None:
        whole = [n for n in first_bad.ref.params if n not in split]
        if not set(failing) <= split:
            if not split:
                return []
            # a flat-buffer layout (ZeRO-1/2 partitions of one concatenated buffer): the optimizer steps
            # each rank's partition as one 1-D tensor, so tensors it holds whole are off too (Adafactor
            # scales a tensor's step by that tensor's RMS, which is the partition's there)
            listed = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
            return [Diagnosis("matrix-optimizer-on-shard",
                              f"{where} {len(failing)} tensor(s) are beyond the bound ({listed}) and the "
                              f"layout cuts {len(split)} tensor(s) among ranks (local_shards): a flat "
                              "partition stepped as one tensor changes the update of every tensor in it; "
                              f"{advice}")]
        origin = muon_update_origin(first_bad, failing) if optimizer == "muon" else None
        if origin is not None and origin.bug_class == "muon-rounding-order":
            return [origin]
        listed = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
        tail = f"; the {len(whole)} tensor(s) one rank owns whole match" if whole else ""
        if origin is not None:
            tail += f"; {origin.evidence}"
        return [Diagnosis("matrix-optimizer-on-shard",
                          f"{where} the {len(failing)} tensor(s) beyond the bound ({listed}) are each split "
                          f"among ranks (local_shards){tail}: {advice}")]
    if optimizer != "muon":
        return []
    matrices = [n for n, p in first_bad.ref.params.items() if np.ndim(p) == 2]
    others = [n for n in first_bad.ref.params if n not in matrices]
    if not set(failing) <= set(matrices):
        return []
    return [Diagnosis("matrix-optimizer-on-shard",
                      f"{where} {len(failing)} of the {len(matrices)} 2-D tensors (Muon's) are beyond the "
                      "bound "
                      f"while the {len(others)} other tensors (AdamW's: elementwise, exact under any split) "
                      f"match: {advice}")]


def newton_schulz64(g: np.ndarray, coefficients: tuple[float, float, float], steps: int,
                    eps: float) -> np.ndarray:
    """torch.optim.Muon's orthogonalisation (``_zeropower_via_newtonschulz``) in float64, without its
    cast to bfloat16."""
    a, b, c = coefficients
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / max(float(np.linalg.norm(x)), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def _muon_step64(g: np.ndarray, optim: dict, lr: float) -> np.ndarray:
    """The parameter change Muon's orthogonalised update makes to a 2-D tensor ``g`` (its Newton-Schulz
    input), in float64: ``adjusted_lr x NS(g)`` (torch's ``_adjust_lr``, "original")."""
    rows, cols = g.shape
    coefficients = tuple(optim.get("ns_coefficients") or _NS_DEFAULT)
    ortho = newton_schulz64(g, coefficients, int(optim.get("ns_steps", 5)), float(optim.get("eps", 1e-7)))
    return lr * max(1.0, rows / cols) ** 0.5 * ortho


def _row_blocks(rec: StepRecord, name: str, cols: int) -> list[tuple[int, int]] | None:
    """The distinct row blocks (first row, last row + 1) the ranks own of a 2-D tensor, or None where a
    range does not start and end on a row."""
    blocks = set()
    for obs in rec.ranks:
        for start, stop in (obs.shards or {}).get(name, []):
            if start % cols or stop % cols:
                return None
            blocks.add((start // cols, stop // cols))
    return sorted(blocks)


def muon_update_origin(rec: StepRecord, failing: list[str]) -> Diagnosis | None:
    """Which Muon the trainer computed at ``rec`` (see the module docstring), over the failing 2-D tensors
    that the ranks own in row blocks; None where it cannot be told (no momentum state in the
    reference, a learning-rate rule other than "original", ranges that cut rows)."""
    optim = rec.optim or {}
    if optim.get("adjust_lr_fn") not in (None, "original"):
        return None
    lr, wd, momentum = float(optim.get("lr", 0.0)), float(optim.get("weight_decay", 0.0)), \
        float(optim.get("momentum", 0.95))
    sums = {"whole": 0.0, "blocks": 0.0, "reference": 0.0, "norm": 0.0}
    names = []
    for name in failing:
        exp = rec.ref.params[name]
        buf = (rec.ref.state.get(name) or {}).get("momentum_buffer")
        if np.ndim(exp) != 2 or buf is None:
            continue
        blocks = _row_blocks(rec, name, exp.shape[1])
        if blocks is None:
            return None
        g = rec.ref.grad[name].reshape(exp.shape)
        buf = np.asarray(buf, dtype=np.float64).reshape(exp.shape)
        update_in = g + momentum * (buf - g) if optim.get("nesterov", True) else buf
        decayed = rec.ref.params_before[name].reshape(exp.shape) * (1 - lr * wd)
        observed = decayed - rec.ranks[0].params[name].astype(np.float64).reshape(exp.shape)
        whole = _muon_step64(update_in, optim, lr)
        by_blocks = np.zeros_like(whole)
        for r0, r1 in blocks:
            by_blocks[r0:r1] = _muon_step64(update_in[r0:r1], optim, lr)
        sums["whole"] += float(np.sum((observed - whole) ** 2))
        sums["blocks"] += float(np.sum((observed - by_blocks) ** 2))
        sums["reference"] += float(np.sum((decayed - exp.reshape(whole.shape) - whole) ** 2))
        sums["norm"] += float(np.sum(whole**2))
        names.append(name)
    if not names or sums["norm"] == 0.0:
        return None
    d = {k: (sums[k] / sums["norm"]) ** 0.5 for k in ("whole", "blocks", "reference")}
    figures = (f"relative to Muon in float64, the trainer's update of the {len(names)} failing 2-D tensor(s) "
               f"is {d['whole']:.2g} from Muon of each whole tensor and {d['blocks']:.2g} from Muon of each "
               f"row block the ranks own; the reference's own bfloat16 update is {d['reference']:.2g} from "
               "the whole-tensor one")
    where = f"at step {rec.step} (muon)"
    if d["whole"] < d["blocks"]:
        return Diagnosis("muon-rounding-order",
                         f"{where} {figures}: the orthogonalisation ran on whole tensors, rounded in "
                         "another order than the reference's bfloat16 iteration (not a sharding bug; the "
                         "bound assumes a CPU rounds it as the reference does)")
    return Diagnosis("matrix-optimizer-on-shard", f"{where} {figures}: the update is Muon of the row blocks")
