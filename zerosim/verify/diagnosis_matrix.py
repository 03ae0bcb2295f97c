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
"""

from __future__ import annotations

import numpy as np

from zerosim.observe import TrainerObservation

from .observation import StepRecord
from .optimizers import is_elementwise
from .outcome import Diagnosis


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
        listed = ", ".join(failing[:3]) + (f" and {len(failing) - 3} more" if len(failing) > 3 else "")
        tail = f"; the {len(whole)} tensor(s) one rank owns whole match" if whole else ""
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
