"""What one rank contributes to a check: one int64 row for the check's single all-gather (C-ZERO-002's live
clauses and C-ZERO-003's digests, :mod:`zerosim.monitor.exchange` lays the row out).

:class:`RowBuilder` keeps what stays fixed while the layout does (the digest buffers of
:class:`~zerosim.monitor.digest.PieceDigests`, the layout's fingerprint) and measures at each check,
with a handful of fused operators whatever the number of tensors:

* the digests of the held pieces another rank holds too (one copy of the small pieces into a word
  buffer and one row reduction per chunk length and device; large pieces reduced where they sit): a
  piece no other rank holds has nothing to be compared with and is not read;
* optimizer state present for every owned element (sizes compared, no data read), the step counters'
  least and largest value;
* one ``_foreach_norm`` per device and dtype over the floating optimizer state (in its own dtype) and
  one over the reduced gradient's owned pieces (accumulated as
  :func:`~zerosim.checks.tolerance.norm_accumulation` says: float32, float64 for a float64 gradient),
  read back in one host copy: the state is finite where its norm is (confirmed element by element
  where a norm is not finite), the gradient's sum of squares is the float64 sum of its norms squared.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import numpy as np
import torch

from ..checks.tolerance import norm_accumulation
from .digest import PieceDigests
from .exchange import SUMMARY, float_bits
from .layouts import LiveLayout


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class RowBuilder:
    """Builds this rank's row at each check (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._digests: PieceDigests | None = None
        self._signature: Any = None
        self.fingerprint = 0
        self.keys: dict[str, Any] = {}
        self._chosen: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _index(self, chosen: list[int]) -> torch.Tensor:
        """``chosen`` as an index tensor on the exchange's device (made again only when it changes)."""
        if self._chosen is None or self._chosen[0] != tuple(chosen):
            self._chosen = (tuple(chosen), torch.tensor(chosen, dtype=torch.int64, device=self.device))
        return self._chosen[1]

    def layout_keys(self, layout: LiveLayout) -> tuple[dict[str, Any], int]:
        """The layout's keys (names and ranges, :meth:`LiveLayout.keys`) and their fingerprint, computed
        again only when the layout's names, ranges or sizes differ from the last check's."""
        signature = (layout.adapter, tuple(layout.numels.items()),
                     tuple((n, a, b) for n, a, b, _ in layout.held),
                     tuple((k, tuple(v)) for k, v in layout.owned.items()))
        if signature != self._signature:
            self._signature = signature
            self.keys = layout.keys()
            self.fingerprint = zlib.crc32(json.dumps(self.keys, separators=(",", ":")).encode())
        return self.keys, self.fingerprint

    def digests(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The digests of ``pieces``, shape (pieces, 2), on the exchange's device."""
        if self._digests is None or not self._digests.fits(pieces):
            self._digests = PieceDigests(pieces, self.device)
        return self._digests.compute(pieces)

    def row(self, layout: LiveLayout, width: int, step: int, fingerprint: int, loss: float | None,
            grad_norm: float | None, digested: list[bool] | None = None) -> torch.Tensor:
        """This rank's row: ``width`` digest lanes (two per held piece, zeros after and for the pieces
        ``digested`` marks False: None digests every piece), then the summary
        (:data:`~zerosim.monitor.exchange.SUMMARY`)."""
        row = torch.zeros(width + len(SUMMARY), dtype=torch.int64, device=self.device)
        count = min(len(layout.held), width // 2)
        chosen = [i for i in range(count) if digested is None or digested[i]]
        if chosen:
            lanes = self.digests([layout.held[i][3] for i in chosen])
            target = row[: 2 * count].view(count, 2)
            if len(chosen) == count:
                target.copy_(lanes)
            else:
                target[self._index(chosen)] = lanes
        summary = {"fingerprint": fingerprint, "n_held": len(layout.held), "step": step,
                   **_norm_summary(layout),
                   "has_norm": int(grad_norm is not None), "grad_norm": float_bits(grad_norm or 0.0),
                   "has_loss": int(loss is not None), "loss": float_bits(loss or 0.0)}
        row[width:] = torch.from_numpy(np.fromiter((summary[k] for k in SUMMARY), np.int64, len(SUMMARY)))
        return row


def _state_summary(layout: LiveLayout) -> tuple[dict[str, int], list[torch.Tensor], list[str]]:
    """C-ZERO-002's state fields that need no data read: owned pieces without state for every element,
    and the step counters (each with the index of the first tensor concerned); and the floating state
    tensors (with their tensor's name) whose finiteness :func:`_norms` measures."""
    names = layout.numels
    missing_names: list[str] = []
    step_values: list[Any] = []
    step_names: list[str] = []
    tensors: list[torch.Tensor] = []
    owners: list[str] = []
    stateless: list[str] = []
    for owned in layout.states:
        values = owned.values or {}
        held = [_local(v) for k, v in values.items() if k != "step" and isinstance(v, torch.Tensor)]
        if not held:
            stateless.append(owned.name)
            continue
        if any(v.numel() != owned.numel for v in held):
            missing_names.append(owned.name)
        if "step" in values:
            step_values.append(_local(values["step"]))
            step_names.append(owned.name)
        for value in held:
            if value.is_floating_point() or value.is_complex():
                tensors.append(value)
                owners.append(owned.name)
    counters = list(zip(_scalars(step_values), step_names, strict=True))
    if stateless and len(stateless) < len(layout.states):  # some owned pieces keep state, these none
        missing_names += stateless
    index = {n: i for i, n in enumerate(names)}
    low = min(counters, key=lambda c: c[0]) if counters else (0, "")  # the first tensor at the least
    first_missing = min((index[n] for n in missing_names), default=-1)
    return ({"missing": len(missing_names), "missing_idx": first_missing,
             "has_counters": int(bool(counters)), "step_min": low[0],
             "step_max": max(c for c, _ in counters) if counters else 0,
             "step_min_idx": index[low[1]] if counters else -1}, tensors, owners)


def _scalars(values: list[Any]) -> list[int]:
    """Step counters (Python numbers or one-element tensors) as ints: the tensors of one device and
    dtype read back in one host copy."""
    out: list[int] = [0] * len(values)
    by_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault((v.device, v.dtype), []).append(i)
        else:
            out[i] = int(v)
    for members in by_device.values():
        read = torch.stack([values[i].reshape(()) for i in members]).tolist()
        for i, v in zip(members, read, strict=True):
            out[i] = int(v)
    return out


def grad_accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient piece's norm is accumulated in (C-ZERO-002 ``grad_norm``):
    :func:`~zerosim.checks.tolerance.norm_accumulation` of its dtype."""
    return getattr(torch, norm_accumulation(str(dtype).removeprefix("torch.")))


def _norms(tensors: list[torch.Tensor], wide: int) -> list[float]:
    """The 2-norm of every tensor, the first ``wide`` accumulated in their own dtype (enough to see a
    non-finite element), the rest (gradient pieces) in :func:`grad_accumulation` of theirs: one
    ``_foreach_norm`` per device, dtype and accumulation, one host copy per device."""
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype | None], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.dtype, grad_accumulation(t.dtype) if i >= wide else None),
                              []).append(i)
    norms = [0.0] * len(tensors)
    by_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for (device, _, accumulation), members in groups.items():
        values = torch._foreach_norm([tensors[i] for i in members], 2, dtype=accumulation)
        indices, found = by_device.setdefault(device, ([], []))
        indices += members
        found.append(torch.stack(values).to(torch.float64))
    for indices, found in by_device.values():
        for i, v in zip(indices, torch.cat(found).tolist(), strict=True):
            norms[i] = v
    return norms


def _norm_summary(layout: LiveLayout) -> dict[str, int]:
    """The state summary (:func:`_state_summary`) with its non-finite count, and the gradient's: the
    norms of the state tensors (in their dtype) and the float64 norms of the owned gradient pieces,
    read back together. A state tensor whose norm is not finite is confirmed element by element (so
    an overflow of the squares is never reported); the gradient's float64 sum of squares is the sum of
    its norms squared."""
    fields, tensors, owners = _state_summary(layout)
    grads = [_local(g) for g in layout.grads] if layout.grads is not None else []
    norms = _norms(tensors + grads, len(tensors))
    bad_names = {owners[i] for i, v in enumerate(norms[: len(tensors)])
                 if not math.isfinite(v) and not bool(torch.isfinite(tensors[i]).all())}
    index = {n: i for i, n in enumerate(layout.numels)}
    bad = sorted(bad_names, key=index.__getitem__)
    fields.update(nonfinite=len(bad), nonfinite_idx=index[bad[0]] if bad else -1)
    if layout.grads is None and layout.grad_squares is not None:  # measured by the reader inside the step
        squares, numel = layout.grad_squares
        fields.update(has_grad=1, grad_sq=float_bits(squares), grad_numel=numel)
    elif layout.grads is None:
        fields.update(has_grad=0, grad_sq=float_bits(0.0), grad_numel=0)
    else:
        grad_sq = math.fsum(v * v for v in norms[len(tensors):]) if grads else 0.0
        fields.update(has_grad=1, grad_sq=float_bits(grad_sq), grad_numel=sum(g.numel() for g in grads))
    return fields
