"""The digests of the tensor pieces a rank holds, computed where they live (C-ZERO-003 on a live run).

A piece's digest is two 64-bit lanes over its bytes, zero-padded to whole blocks of
:data:`BLOCK_WORDS` 8-byte words and read as int64 words; with ``s_j`` the wrapped sum of block ``j``:

* lane 0: ``sum_j s_j`` (every word summed) -- any change confined to one word changes it, since a
  word changes by a non-zero amount below 2^64 in magnitude;
* lane 1: ``sum_j (j + 1) s_j`` -- a block moved to another place changes it too.

Integer sums are exact modulo 2^64 and independent of the reduction order, so equal bytes give equal
digests on every rank and device (byte order is the device's: compare digests of one kind of device).

:class:`PieceDigests` computes the digests of many pieces at once, without a per-piece chain of
operators: small pieces are copied (one ``_foreach_copy_`` per device) into a zero-padded word buffer
whose layout is fixed while the pieces' sizes stay the same; one blocked reduction over the buffer
and one ``index_add_`` give every piece's two lanes. Pieces of :data:`IN_PLACE_BYTES` or more are
reduced where they sit (a view of their storage; no copy). Both paths give the same digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

BLOCK_WORDS = 64
BLOCK_BYTES = 8 * BLOCK_WORDS
#: a piece at least this large is digested in place rather than copied into the shared buffer
IN_PLACE_BYTES = 1 << 20


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view (a contiguous copy of a strided tensor)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES)


def _lanes(block_sums: torch.Tensor) -> torch.Tensor:
    weights = torch.arange(1, block_sums.numel() + 1, dtype=torch.int64, device=block_sums.device)
    return torch.stack([block_sums.sum(), (block_sums * weights).sum()])


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The two-lane digest of ``tensor`` (see the module docstring), reduced in place: an int64 tensor
    of shape (2,) on ``tensor``'s device."""
    raw = _bytes_of(tensor)
    whole = (raw.numel() // BLOCK_BYTES) * BLOCK_BYTES
    main = raw[:whole]
    if whole and main.data_ptr() % 8:
        main = main.clone()  # a storage offset that is not 8-byte aligned
    sums = main.view(torch.int64).view(-1, BLOCK_WORDS).sum(dim=1) if whole else \
        torch.zeros(0, dtype=torch.int64, device=raw.device)
    if raw.numel() > whole:
        tail = torch.zeros(BLOCK_WORDS, dtype=torch.int64, device=raw.device)
        tail.view(torch.uint8)[: raw.numel() - whole].copy_(raw[whole:])
        sums = torch.cat([sums, tail.sum().reshape(1)])
    return _lanes(sums)


class PieceDigests:
    """The digests of a fixed list of pieces (their byte sizes and devices fixed; the tensors may be
    new objects at every call): :meth:`compute` returns an int64 tensor of shape (pieces, 2) on
    ``device``. Rebuild it when :meth:`fits` says the pieces changed size or device."""

    def __init__(self, pieces: Sequence[torch.Tensor], device: torch.device):
        self.device = device
        self.signature = self._signature(pieces)
        self.in_place: list[int] = []
        # per device: (piece indices, as a tensor, the buffer's byte range of each, the word buffer,
        # each block's piece, each block's weight)
        self.groups: list[tuple[list[int], torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor,
                                torch.Tensor]] = []
        by_device: dict[torch.device, list[int]] = {}
        for i, (nbytes, dev, _, _) in enumerate(self.signature):
            if nbytes >= IN_PLACE_BYTES:
                self.in_place.append(i)
            elif nbytes:
                by_device.setdefault(dev, []).append(i)
        for dev, members in by_device.items():
            offsets: list[int] = []
            owner: list[int] = []
            weights: list[int] = []
            blocks = 0
            for slot, i in enumerate(members):
                count = _blocks(self.signature[i][0])
                offsets.append(blocks * BLOCK_BYTES)
                owner += [slot] * count
                weights += range(1, count + 1)
                blocks += count
            buffer = torch.zeros(blocks * BLOCK_WORDS, dtype=torch.int64, device=dev)
            raw = buffer.view(torch.uint8)
            # each piece's place in the buffer, typed and shaped as the piece (one copy_ fills it)
            targets = [raw[o: o + self.signature[i][0]].view(self.signature[i][2]).view(self.signature[i][3])
                       for o, i in zip(offsets, members, strict=True)]
            self.groups.append((members, torch.tensor(members, device=self.device), targets, buffer,
                                torch.tensor(owner, dtype=torch.int64, device=dev),
                                torch.tensor(weights, dtype=torch.int64, device=dev)))

    @staticmethod
    def _signature(pieces: Sequence[torch.Tensor]) -> list[tuple[int, torch.device, torch.dtype, Any]]:
        return [(t.numel() * t.element_size(), t.device, t.dtype, t.shape) for t in pieces]

    def fits(self, pieces: Sequence[torch.Tensor]) -> bool:
        return self._signature(pieces) == self.signature

    @torch.no_grad()
    def compute(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(pieces), 2, dtype=torch.int64, device=self.device)
        for members, index, targets, buffer, owner, weights in self.groups:
            torch._foreach_copy_(targets, [pieces[i] for i in members])
            sums = buffer.view(-1, BLOCK_WORDS).sum(dim=1)
            lanes = torch.zeros(len(members), 2, dtype=torch.int64, device=buffer.device)
            lanes.index_add_(0, owner, torch.stack([sums, sums * weights], dim=1))
            out[index] = lanes.to(self.device)
        for i in self.in_place:
            out[i] = tensor_digest(pieces[i]).to(self.device)
        return out


def digest_text(lanes: tuple[int, int]) -> str:
    """The hex text of a digest's two lanes (as unsigned 64-bit numbers)."""
    return "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in lanes)
