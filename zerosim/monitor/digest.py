"""The digests of the tensor pieces a rank holds, computed where they live (C-ZERO-003 on a live run).

A piece's digest is two 64-bit lanes over its bytes, read as int64 words (the last word zero-padded),
cut into :data:`CHUNKS` equal contiguous chunks of ``m = ceil(words / CHUNKS)`` words each (the last
chunks zero-padded); with ``s_j`` the wrapped sum of chunk ``j``:

* lane 0: ``sum_j s_j`` (every word summed) -- any change confined to one word changes it, since a
  word changes by a non-zero amount below 2^64 in magnitude;
* lane 1: ``sum_j (j + 1) s_j`` -- a chunk moved to another chunk's place (two chunks of different
  sums swapped, the bytes rotated by whole chunks) changes it too.

Integer sums are exact modulo 2^64 and independent of the reduction order, so equal bytes give equal
digests on every rank and device (byte order is the device's: compare digests of one kind of device).
Each chunk is one long contiguous row, so the chunk sums are one vectorised row reduction over the
piece read where it sits: about one read of its bytes, no copy (a strided or misaligned piece is made
contiguous first).

:class:`PieceDigests` computes the digests of many pieces at once, without a per-piece chain of
operators: small pieces are copied (one ``_foreach_copy_`` per device) into a zero-padded word buffer
whose layout is fixed while the pieces' sizes stay the same, pieces of equal chunk length ``m`` side by
side, so one row reduction per chunk length gives their chunk sums. Pieces of :data:`IN_PLACE_BYTES`
or more are reduced where they sit. Both paths give the same digest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

CHUNKS = 64
WORD_BYTES = 8
#: a piece at least this large is digested in place rather than copied into the shared buffer
IN_PLACE_BYTES = 1 << 20


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 view (a contiguous copy of a strided tensor)."""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def chunk_words(nbytes: int) -> int:
    """``m``: the words in each of a piece's :data:`CHUNKS` chunks (at least 1)."""
    words = -(-nbytes // WORD_BYTES)
    return max(1, -(-words // CHUNKS))


_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """``1 .. CHUNKS`` as int64 on ``device`` (made once per device)."""
    found = _WEIGHTS.get(device)
    if found is None:
        found = _WEIGHTS[device] = torch.arange(1, CHUNKS + 1, dtype=torch.int64, device=device)
    return found


def lanes_of(chunk_sums: torch.Tensor) -> torch.Tensor:
    """The two lanes of each row of chunk sums, shape (..., CHUNKS) -> (..., 2)."""
    return torch.stack([chunk_sums.sum(-1), (chunk_sums * _weights(chunk_sums.device)).sum(-1)], dim=-1)


def chunk_sums(tensor: torch.Tensor) -> torch.Tensor:
    """The :data:`CHUNKS` wrapped int64 chunk sums of ``tensor``'s bytes, reduced where they sit."""
    raw = _bytes_of(tensor)
    if raw.numel() % (WORD_BYTES * CHUNKS) == 0 and raw.data_ptr() % WORD_BYTES == 0:
        return raw.view(torch.int64).view(CHUNKS, -1).sum(dim=1)  # whole words, 64 equal chunks
    m = chunk_words(raw.numel())
    whole = raw.numel() // WORD_BYTES
    words = raw[: whole * WORD_BYTES]
    if whole and words.data_ptr() % WORD_BYTES:
        words = words.clone()  # a storage offset that is not 8-byte aligned
    words = words.view(torch.int64)
    full = whole // m  # chunks made of whole words only
    sums = torch.zeros(CHUNKS, dtype=torch.int64, device=raw.device)
    if full:
        sums[:full] = words[: full * m].view(full, m).sum(dim=1)
    if full < CHUNKS:  # the one partial chunk: the words left and the zero-padded last word
        rest = torch.zeros(m, dtype=torch.int64, device=raw.device)
        left = whole - full * m
        rest[:left] = words[full * m:]
        tail = raw.numel() - whole * WORD_BYTES
        if tail:
            rest[left: left + 1].view(torch.uint8)[:tail].copy_(raw[whole * WORD_BYTES:])
        sums[full] = rest.sum()
    return sums


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The two-lane digest of ``tensor`` (see the module docstring), reduced in place: an int64 tensor
    of shape (2,) on ``tensor``'s device."""
    return lanes_of(chunk_sums(tensor))


class PieceDigests:
    """The digests of a fixed list of pieces (their byte sizes and devices fixed; the tensors may be
    new objects at every call): :meth:`compute` returns an int64 tensor of shape (pieces, 2) on
    ``device``. Rebuild it when :meth:`fits` says the pieces changed size or device."""

    def __init__(self, pieces: Sequence[torch.Tensor], device: torch.device):
        self.device = device
        self.signature = self._signature(pieces)
        # per device: the indices of the pieces reduced where they sit (a list, and a tensor on ``device``)
        self.in_place: list[tuple[list[int], torch.Tensor]] = []
        in_place: dict[torch.device, list[int]] = {}
        # per device: (piece indices in buffer order, as a tensor on ``device``, each piece's place in
        # the buffer typed and shaped as the piece, per chunk length m: (the buffer's word range, m))
        self.groups: list[tuple[list[int], torch.Tensor, list[torch.Tensor],
                                list[tuple[torch.Tensor, int]]]] = []
        by_device: dict[torch.device, dict[int, list[int]]] = {}
        for i, (nbytes, dev, _, _) in enumerate(self.signature):
            if nbytes >= IN_PLACE_BYTES:
                in_place.setdefault(dev, []).append(i)
            elif nbytes:
                by_device.setdefault(dev, {}).setdefault(chunk_words(nbytes), []).append(i)
        for dev, by_length in by_device.items():
            total = sum(CHUNKS * m * len(members) for m, members in by_length.items())
            buffer = torch.zeros(total, dtype=torch.int64, device=dev)
            order: list[int] = []
            targets: list[torch.Tensor] = []
            spans: list[tuple[torch.Tensor, int]] = []
            at = 0
            for m, members in by_length.items():
                spans.append((buffer[at: at + CHUNKS * m * len(members)], m))
                for i in members:
                    nbytes, _, dtype, shape = self.signature[i]
                    raw = buffer[at: at + CHUNKS * m].view(torch.uint8)
                    targets.append(raw[:nbytes].view(dtype).view(shape))
                    order.append(i)
                    at += CHUNKS * m
            self.groups.append((order, torch.tensor(order, device=self.device), targets, spans))
        self.in_place = [(members, torch.tensor(members, device=self.device))
                         for members in in_place.values()]

    @staticmethod
    def _signature(pieces: Sequence[torch.Tensor]) -> list[tuple[int, torch.device, torch.dtype, Any]]:
        return [(t.numel() * t.element_size(), t.device, t.dtype, t.shape) for t in pieces]

    def fits(self, pieces: Sequence[torch.Tensor]) -> bool:
        return self._signature(pieces) == self.signature

    @torch.no_grad()
    def compute(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(len(pieces), 2, dtype=torch.int64, device=self.device)
        for order, index, targets, spans in self.groups:
            torch._foreach_copy_(targets, [pieces[i] for i in order])
            sums = torch.cat([span.view(-1, m).sum(dim=1) for span, m in spans]).view(-1, CHUNKS)
            out[index] = lanes_of(sums).to(self.device)
        for members, index in self.in_place:  # one lanes_of per device over the stacked chunk sums
            sums = torch.stack([chunk_sums(pieces[i]) for i in members])
            out[index] = lanes_of(sums).to(self.device)
        return out


def digest_text(lanes: tuple[int, int]) -> str:
    """The hex text of a digest's two lanes (as unsigned 64-bit numbers)."""
    return "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in lanes)
