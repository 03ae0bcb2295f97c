"""What one rank contributes to a check: one int64 row for the check's single all-gather (C-ZERO-002's live
clauses and C-ZERO-003's digests, :mod:`zerosim.monitor.exchange` lays the row out).

:class:`RowBuilder` keeps what stays fixed while the layout does (the digest buffers of
:class:`~zerosim.monitor.digest.PieceDigests`, the layout's fingerprint) and measures at each check,
with a handful of fused operators whatever the number of tensors:

* the held pieces' digests (one copy into a word buffer and one blocked reduction per device);
* optimizer state present for every owned element (sizes compared, no data read) and finite (one
  ``_foreach_norm`` per device and dtype, confirmed element by element where a norm is not finite);
* the step counters' least and largest value;
* the float64 sum of squares of the reduced gradient over the owned elements (one ``_foreach_norm``).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from .digest import PieceDigests
from .exchange import SUMMARY, float_bits
from .layouts import LiveLayout


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _local_value(v: Any) -> Any:
    return _local(v).item() if isinstance(v, torch.Tensor) else v


class RowBuilder:
    """Builds this rank's row at each check (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._digests: PieceDigests | None = None
        self._signature: Any = None
        self.fingerprint = 0
        self.keys: dict[str, Any] = {}

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

    def digests(self, layout: LiveLayout, count: int) -> torch.Tensor:
        """The digests of the first ``count`` held pieces, shape (count, 2), on the exchange's device."""
        pieces = [t for *_, t in layout.held[:count]]
        if self._digests is None or not self._digests.fits(pieces):
            self._digests = PieceDigests(pieces, self.device)
        return self._digests.compute(pieces)

    def row(self, layout: LiveLayout, width: int, step: int, fingerprint: int, loss: float | None,
            grad_norm: float | None) -> torch.Tensor:
        """This rank's row: ``width`` digest lanes (two per held piece, zeros after), then the summary
        (:data:`~zerosim.monitor.exchange.SUMMARY`)."""
        row = torch.zeros(width + len(SUMMARY), dtype=torch.int64, device=self.device)
        count = min(len(layout.held), width // 2)
        if count:
            row[: 2 * count] = self.digests(layout, count).reshape(-1)
        summary = {"fingerprint": fingerprint, "n_held": len(layout.held), "step": step,
                   **_state_summary(layout), **_grad_summary(layout),
                   "has_norm": int(grad_norm is not None), "grad_norm": float_bits(grad_norm or 0.0),
                   "has_loss": int(loss is not None), "loss": float_bits(loss or 0.0)}
        row[width:] = torch.tensor([summary[k] for k in SUMMARY], dtype=torch.int64)
        return row


def _state_summary(layout: LiveLayout) -> dict[str, int]:
    """C-ZERO-002's state fields: owned pieces without state for every element, with a non-finite
    value, and the step counters (each with the index of the first tensor concerned)."""
    names = list(layout.numels)
    missing_names: list[str] = []
    counters: list[tuple[int, str]] = []
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
            counters.append((int(_local_value(values["step"])), owned.name))
        for value in held:
            if value.is_floating_point() or value.is_complex():
                tensors.append(value)
                owners.append(owned.name)
    if stateless and len(stateless) < len(layout.states):  # some owned pieces keep state, these none
        missing_names += stateless
    bad = sorted({owners[i] for i in _nonfinite(tensors)}, key=names.index)
    low = min(counters, key=lambda c: c[0]) if counters else (0, "")  # the first tensor at the least
    first_missing = min((names.index(n) for n in missing_names), default=-1)
    return {"missing": len(missing_names), "missing_idx": first_missing, "nonfinite": len(bad),
            "nonfinite_idx": names.index(bad[0]) if bad else -1, "has_counters": int(bool(counters)),
            "step_min": low[0], "step_max": max(c for c, _ in counters) if counters else 0,
            "step_min_idx": names.index(low[1]) if counters else -1}


def _nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """The indices of the tensors holding a non-finite element: one 2-norm per tensor, fused per device
    and dtype (non-finite when an element is, or when finite squares overflow: a tensor whose norm is
    not finite is then confirmed element by element, so an overflow is never reported)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(i)
    bad: list[int] = []
    for members in groups.values():
        norms = torch._foreach_norm([tensors[i] for i in members], 2)
        finite = torch.isfinite(torch.stack(norms))
        if not bool(finite.all()):
            suspects = [members[j] for j in torch.nonzero(~finite).flatten().tolist()]
            bad += [i for i in suspects if not bool(torch.isfinite(tensors[i]).all())]
    return bad


def _grad_summary(layout: LiveLayout) -> dict[str, int]:
    """The float64 sum of squares of the reduced gradient over the owned elements, and its size (as the
    layout's reader measured it, where the framework frees the gradient inside its step)."""
    if layout.grads is None:
        if layout.grad_squares is not None:  # measured by the reader inside the step
            squares, numel = layout.grad_squares
            return {"has_grad": 1, "grad_sq": float_bits(squares), "grad_numel": numel}
        return {"has_grad": 0, "grad_sq": float_bits(0.0), "grad_numel": 0}
    local = [_local(g) for g in layout.grads]
    grad_sq = 0.0
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in local:
        by_device.setdefault(g.device, []).append(g)
    for grads in by_device.values():
        norms = torch._foreach_norm(grads, 2, dtype=torch.float64)
        grad_sq += float((torch.stack(norms) ** 2).sum())
    return {"has_grad": 1, "grad_sq": float_bits(grad_sq), "grad_numel": sum(g.numel() for g in local)}
