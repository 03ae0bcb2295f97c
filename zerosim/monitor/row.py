"""What one rank contributes to a check: one int64 row for the check's single all-gather (C-ZERO-002's live
clauses and C-ZERO-003's digests, :mod:`zerosim.monitor.exchange` lays the row out).

:class:`RowBuilder` keeps what stays fixed while the layout does (the digest buffers of
:class:`~zerosim.monitor.digest.PieceDigests`, the layout's fingerprint) and measures at each check,
with a handful of fused operators whatever the number of tensors:

* the digests of the held pieces another rank holds too (one copy of the small pieces into a word
  buffer and one row reduction per chunk length and device; large pieces reduced where they sit): a
  piece no other rank holds has nothing to be compared with and is not read;
* optimizer state present for every owned element (sizes compared, no data read: an entry of the
  piece's size, or factors whose shapes broadcast to it, as Adafactor's row and column statistics),
  the step counters' least and largest value;
* one ``_foreach_norm`` per device and dtype over the floating optimizer state and one over the
  reduced gradient's owned pieces (accumulated as :func:`~zerosim.checks.tolerance.norm_accumulation`
  says: float32, float64 for a float64 gradient): a state tensor is finite where its norm is, the
  gradient's sum of squares is the float64 sum of its norms squared.

What a summary field needs from a tensor on an accelerator is computed there and written into the
row there: a check reads nothing back to the host, so it never makes the host wait for the device
(the training loop keeps its lead over the GPU). On an accelerator the state's norm is its largest
magnitude (finite exactly where every element is, and it cannot overflow); on the CPU, where that
reduction is several times slower than the 2-norm, the 2-norm in the state's dtype, and a norm that is
not finite is confirmed element by element (so an overflow of the squares is never reported).
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import torch

from ..checks.tolerance import norm_accumulation
from .digest import PieceDigests
from .exchange import CHECK, PHASE, SUMMARY, float_bits
from .layouts import LiveLayout, local_tensor

#: a summary value: an int known on the host, or a 0-dim int64 tensor computed where its data lives
Field = int | torch.Tensor


class RowBuilder:
    """Builds this rank's row at each check (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._digests: PieceDigests | None = None
        self.counters = StepCounters()
        self._signature: Any = None
        self.fingerprint = 0
        self.keys: dict[str, Any] = {}
        #: index tensors on the exchange's device, by their values (the digested pieces, the summary
        #: positions measured on the device): made once, not at every check
        self._indices: dict[tuple[int, ...], torch.Tensor] = {}

    def _index(self, values: list[int]) -> torch.Tensor:
        """``values`` as an index tensor on the exchange's device (made once per distinct list)."""
        key = tuple(values)
        found = self._indices.get(key)
        if found is None:
            found = self._indices[key] = to_device(torch.tensor(values, dtype=torch.int64), self.device)
        return found

    def layout_keys(self, layout: LiveLayout) -> tuple[dict[str, Any], int]:
        """The layout's keys (names and ranges, :meth:`LiveLayout.keys`) and their fingerprint, computed
        again only when the layout's names, ranges or sizes differ from the last check's."""
        signature = (layout.adapter, tuple(layout.numels.items()),
                     tuple((n, a, b) for n, a, b, _ in layout.held),
                     tuple((k, tuple(v)) for k, v in layout.owned.items()),
                     tuple((k, tuple(v)) for k, v in (layout.grad_ranges or {}).items()))
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

    def row(self, layout: LiveLayout, width: int, step: int, fingerprint: int, loss: Any,
            grad_norm: Any, digested: list[bool] | None = None) -> torch.Tensor:
        """This rank's row: ``width`` digest lanes (two per held piece, zeros after and for the pieces
        ``digested`` marks False: None digests every piece), then the summary
        (:data:`~zerosim.monitor.exchange.SUMMARY`). ``loss`` and ``grad_norm``: None, a number, or a
        one-element tensor (left where it is: its bits are copied into the row on the device)."""
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
        fields: dict[str, Field] = {
            "fingerprint": fingerprint, "n_held": len(layout.held), "step": step, "phase": CHECK,
            **_norm_summary(layout, self.device, self.counters),
            "has_norm": int(grad_norm is not None), "grad_norm": _bits(grad_norm),
            "has_loss": int(loss is not None), "loss": _bits(loss)}
        host = torch.tensor([v if isinstance(v, int) else 0 for v in (fields[k] for k in SUMMARY)],
                            dtype=torch.int64)
        row[width:].copy_(host, non_blocking=True)  # host to device: staged, the host does not wait
        measured = [i for i, k in enumerate(SUMMARY) if isinstance(fields[k], torch.Tensor)]
        if measured:
            values = torch.stack([to_device(fields[SUMMARY[i]], self.device)  # type: ignore[arg-type]
                                  for i in measured])
            row[width:][self._index(measured)] = values
        return row


    def marker(self, width: int, phase: int) -> torch.Tensor:
        """A row that carries no check, only ``phase`` (:data:`~zerosim.monitor.exchange.CLOSING` or
        :data:`~zerosim.monitor.exchange.OFF`): what a rank sends where the others may send a check."""
        row = torch.zeros(width + len(SUMMARY), dtype=torch.int64)
        row[width + PHASE] = phase
        return to_device(row, self.device)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: without making the host wait where it goes from the host to an accelerator
    (the copy is staged), and waiting for the data where it comes back to the host (a non-blocking copy
    into host memory could be read before it lands)."""
    return t.to(device, non_blocking=t.device.type == "cpu")


def _bits(value: Any) -> Field:
    """A float summary value as its float64 bits: a number's, or a host tensor's, on the host; an
    accelerator tensor's on its device."""
    if value is None:
        return 0
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            return value.reshape(1).to(torch.float64).view(torch.int64).reshape(())
    return float_bits(float(value))


def _state_summary(layout: LiveLayout, counters: StepCounters) -> tuple[dict[str, Field], list[torch.Tensor],
                                                                       list[int]]:
    """C-ZERO-002's state fields that need no data read: owned pieces the optimizer steps
    (:attr:`OwnedState.stepped`) without state for every element, and the step counters of those it
    steps, each counted from when it joined (:class:`StepCounters`); and the floating state tensors
    with the index of their tensor's name, whose finiteness :func:`_finite_fields` measures."""
    index = {n: i for i, n in enumerate(layout.numels)}
    missing: list[int] = []
    counted: list[tuple[Any, str, int]] = []
    tensors: list[torch.Tensor] = []
    owners: list[int] = []
    stateless: list[int] = []
    expected = 0
    for owned in layout.states:
        name = index[owned.name]
        values = owned.values or {}
        expected += owned.stepped
        held = [local_tensor(v) for k, v in values.items() if k != "step" and isinstance(v, torch.Tensor)]
        if not held:
            if owned.stepped:
                stateless.append(name)
            continue
        if owned.stepped and not _covers([v for v in held if v.numel() != owned.numel], owned.numel):
            missing.append(name)
        if owned.stepped and "step" in values:
            counted.append((local_tensor(values["step"]), owned.name, name))
        for value in held:
            if value.is_floating_point() or value.is_complex():
                tensors.append(value)
                owners.append(name)
    if stateless and len(stateless) < expected:  # some stepped pieces keep state, these none
        missing += stateless
    fields: dict[str, Field] = {"missing": len(missing), "missing_idx": min(missing, default=-1),
                                "has_counters": int(bool(counted)), **counters.fields(counted)}
    return fields, tensors, owners


def _covers(odd: list[torch.Tensor], numel: int) -> bool:
    """Whether state entries not of the piece's size still cover it: none, or factors whose shapes
    broadcast to the piece's size (Adafactor's row and column statistics of a matrix)."""
    if not odd:
        return True
    try:
        shape = torch.broadcast_shapes(*(v.shape for v in odd))
    except RuntimeError:
        return False
    return len(odd) > 1 and math.prod(shape) == numel


class StepCounters:
    """The step counters of the owned tensors the optimizer steps, each counted from when it joined, so
    that tensors stepped since different steps (a parameter group added, a layer unfrozen) compare
    equal when each has been stepped at every step since: a tensor's counter plus its shift, the shift
    fixed when it is first seen (or seen again after a check without it) so that it equals the
    largest shifted counter of the tensors this rank already counted (0 where none). A counter that
    falls behind or resets after it joined still shows (C-ZERO-002 ``step_counter``). Host counters
    are read on the host; counters on an accelerator are shifted there (no host read)."""

    def __init__(self) -> None:
        self.shift: dict[str, Any] = {}

    def fields(self, counters: list[tuple[Any, str, int]]) -> dict[str, Field]:
        """``step_min``, ``step_max`` and ``step_min_idx`` (the name index of the first tensor at the least)
        of the shifted ``counters`` (value, tensor name, name index)."""
        present = {name for _, name, _ in counters}
        self.shift = {n: v for n, v in self.shift.items() if n in present}
        if not counters:
            return {"step_min": 0, "step_max": 0, "step_min_idx": -1}
        on_device = next((v.device for v, _, _ in counters
                          if isinstance(v, torch.Tensor) and v.device.type != "cpu"), None)
        if on_device is None:
            return self._on_host(counters)
        return self._on_device(counters, on_device)

    def _on_host(self, counters: list[tuple[Any, str, int]]) -> dict[str, Field]:
        known = [int(v) + self.shift[n] for v, n, _ in counters if n in self.shift]
        reference = max(known) if known else None
        for v, n, _ in counters:
            if n not in self.shift:
                self.shift[n] = 0 if reference is None else reference - int(v)
        values = [(int(v) + self.shift[n], i) for v, n, i in counters]
        low = min(values, key=lambda c: c[0])
        return {"step_min": low[0], "step_max": max(v for v, _ in values), "step_min_idx": low[1]}

    def _on_device(self, counters: list[tuple[Any, str, int]], device: torch.device) -> dict[str, Field]:
        steps = torch.stack([torch.as_tensor(v, dtype=torch.float64).reshape(()).to(device, torch.float64,
                                                                                   non_blocking=True)
                             for v, _, _ in counters])
        known = [i for i, (_, n, _) in enumerate(counters) if n in self.shift]
        fresh = [i for i, (_, n, _) in enumerate(counters) if n not in self.shift]
        if known:
            # each counter taken by an int index (a view): a list index would be copied to the device
            # from pageable memory, which makes the host wait
            reference = torch.stack([steps[i] + self.shift[counters[i][1]] for i in known]).max()
        else:
            reference = None
        for i in fresh:
            self.shift[counters[i][1]] = torch.zeros((), dtype=torch.float64, device=device) \
                if reference is None else reference - steps[i]
        shifted = steps + torch.stack([self.shift[n] for _, n, _ in counters])
        names = to_device(torch.tensor([i for _, _, i in counters], dtype=torch.int64), device)
        least = shifted.min()
        first = torch.where(shifted == least, torch.arange(len(counters), device=device),
                            len(counters)).min()
        return {"step_min": least.to(torch.int64), "step_max": shifted.max().to(torch.int64),
                "step_min_idx": names.gather(0, first.reshape(1)).reshape(())}  # indexed on the device


def grad_accumulation(dtype: torch.dtype) -> torch.dtype:
    """The dtype a gradient piece's norm is accumulated in (C-ZERO-002 ``grad_norm``):
    :func:`~zerosim.checks.tolerance.norm_accumulation` of its dtype."""
    return getattr(torch, norm_accumulation(str(dtype).removeprefix("torch.")))


def _groups(tensors: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """The positions of the non-empty ``tensors`` by device and dtype (one fused reduction each)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(i)
    return groups


def _finite_fields(tensors: list[torch.Tensor], owners: list[int], names: int,
                   device: torch.device) -> dict[str, Field]:
    """``nonfinite`` (how many tensor names hold a non-finite state value) and ``nonfinite_idx`` (the
    first such name's index, -1 if none): one ``_foreach_norm`` per device and dtype, read on the host
    for tensors in host memory (the 2-norm, confirmed element by element where it is not finite) and
    reduced on ``device`` for tensors on an accelerator (the largest magnitude; see the module
    docstring)."""
    bad: set[int] = set()
    flags: list[torch.Tensor] = []
    order: list[int] = []
    for (dev, _), members in _groups(tensors).items():
        group = [tensors[i] for i in members]
        if dev.type == "cpu":
            for i, norm in zip(members, torch.stack(torch._foreach_norm(group, 2)).tolist(), strict=True):
                if not math.isfinite(norm) and not bool(torch.isfinite(tensors[i]).all()):
                    bad.add(owners[i])
        else:
            flags.append(to_device(~torch.isfinite(torch.stack(torch._foreach_norm(group, math.inf))),
                                   device))
            order += members
    if not flags:
        return {"nonfinite": len(bad), "nonfinite_idx": min(bad, default=-1)}
    owner = to_device(torch.tensor([owners[i] for i in order], dtype=torch.int64), device)
    per_name = torch.zeros(names, dtype=torch.int64, device=device).scatter_reduce_(
        0, owner, torch.cat(flags).to(torch.int64), "amax")
    if bad:
        per_name[to_device(torch.tensor(sorted(bad), dtype=torch.int64), device)] = 1
    first = torch.where(per_name > 0, torch.arange(names, device=device), names).min()
    return {"nonfinite": per_name.sum(), "nonfinite_idx": torch.where(first < names, first, -1)}


def _grad_fields(layout: LiveLayout, device: torch.device) -> dict[str, Field]:
    """``has_grad``, ``grad_sq`` (the float64 bits of the sum of squares of the owned gradient pieces:
    each piece's norm accumulated as :func:`grad_accumulation` says, squared and summed in float64, on
    the host for pieces in host memory and on ``device`` for pieces on an accelerator) and
    ``grad_numel``."""
    if layout.grads is None and layout.grad_squares is not None:  # measured by the reader inside the step
        squares, numel = layout.grad_squares
        return {"has_grad": 1, "grad_sq": float_bits(squares), "grad_numel": numel}
    if layout.grads is None:
        return {"has_grad": 0, "grad_sq": 0, "grad_numel": 0}
    grads = [local_tensor(g) for g in layout.grads]
    on_host = 0.0
    measured: list[torch.Tensor] = []
    for (dev, dtype), members in _groups(grads).items():
        norms = torch.stack(torch._foreach_norm([grads[i] for i in members], 2,
                                                dtype=grad_accumulation(dtype))).to(torch.float64)
        if dev.type == "cpu":
            on_host += math.fsum(v * v for v in norms.tolist())
        else:
            measured.append(to_device(norms.pow(2).sum(), device))
    numel = sum(g.numel() for g in grads)
    if not measured:
        return {"has_grad": 1, "grad_sq": float_bits(on_host), "grad_numel": numel}
    total = torch.stack(measured).sum() + on_host
    return {"has_grad": 1, "grad_sq": total.reshape(1).view(torch.int64).reshape(()), "grad_numel": numel}


def _norm_summary(layout: LiveLayout, device: torch.device, counters: StepCounters) -> dict[str, Field]:
    """The state summary (:func:`_state_summary`) with its non-finite fields (:func:`_finite_fields`) and
    the gradient's (:func:`_grad_fields`)."""
    fields, tensors, owners = _state_summary(layout, counters)
    fields.update(_finite_fields(tensors, owners, len(layout.numels), device))
    fields.update(_grad_fields(layout, device))
    return fields


def logged_number(value: Any) -> Any:
    """A logged value as the row takes it: None, a float, or a one-element tensor left on its device
    (read there, so that logging a loss or norm that is still a device tensor makes nobody wait)."""
    if isinstance(value, torch.Tensor) and hasattr(value, "full_tensor"):
        value = value.full_tensor()  # a DTensor norm (FSDP2's clip_grad_norm_): its value on every rank
    if value is None or isinstance(value, torch.Tensor):
        return value
    return float(value)
