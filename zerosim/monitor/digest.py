"""The digest of a tensor's bytes, computed where the tensor lives (C-ZERO-003 on a live run).

Two 64-bit lanes over the tensor's bytes read as integers, summed modulo 2^64 on the tensor's own device
(no host copy; the result is two int64 scalars there):

* lane 0: the sum of every 8-byte word (the bytes read as int64) -- any change confined to one word
  changes it, since a word changes by a non-zero amount below 2^64 in magnitude;
* lane 1: the sum of 64 block sums, each weighted by its block's position -- so a piece moved to
  another place changes it too.

The words are read through a view (no copy) when the tensor's bytes are 8-byte aligned, through an
aligned copy otherwise; the bytes after the last whole word are widened one element at a time (and
weighted by position in lane 1). Integer sums are
exact and independent of the reduction order, so equal bytes give equal digests on every rank and
device. Byte order is the device's: compare digests of one kind of device only.
"""

from __future__ import annotations

import torch

BLOCKS = 64
_WEIGHTS: dict[tuple[int, int, str], torch.Tensor] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def integer_words(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor``'s bytes as int64 words (a view of its storage where it is 8-byte aligned, else an aligned
    copy: the words never depend on where the tensor sits in memory), and the elements after the last
    whole word widened to int64 (fewer than 8 bytes' worth)."""
    flat = tensor.detach().reshape(-1)
    size = flat.element_size()
    per_word = max(1, 8 // size)
    whole = (flat.numel() // per_word) * per_word
    main = flat[:whole].view(_INT_OF_SIZE[size])
    if size < 8:
        try:
            main = main.view(torch.int64)
        except RuntimeError:  # a storage offset that is not 8-byte aligned
            main = main.clone().view(torch.int64)
    tail = flat[whole:].view(_INT_OF_SIZE[size]).to(torch.int64)
    return main, tail


def _weights(start: int, count: int, device: torch.device) -> torch.Tensor:
    """``arange(start, start + count)`` as int64 on ``device``, made once per (start, count, device)."""
    key = (start, count, str(device))
    found = _WEIGHTS.get(key)
    if found is None:
        found = _WEIGHTS[key] = torch.arange(start, start + count, dtype=torch.int64, device=device)
    return found


def tensor_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The two-lane digest of ``tensor`` (see the module docstring): an int64 tensor of shape (2,) on
    ``tensor``'s device."""
    words, tail = integer_words(tensor)
    n = words.numel()
    if n >= BLOCKS:
        per = n // BLOCKS
        blocks = words[: per * BLOCKS].view(BLOCKS, per).sum(dim=1)
        rest = words[per * BLOCKS:].sum()
        total = blocks.sum() + rest
        positional = (blocks * _weights(1, BLOCKS, words.device)).sum() + rest * (BLOCKS + 1)
    else:
        total = words.sum()
        positional = (words * _weights(1, n, words.device)).sum()
    if tail.numel():
        total = total + tail.sum()
        positional = positional + (tail * _weights(BLOCKS + 2, tail.numel(), tail.device)).sum()
    return torch.stack([total, positional])


def digest_text(lanes: tuple[int, int]) -> str:
    """The hex text of a digest's two lanes (as unsigned 64-bit numbers)."""
    return "".join(f"{v & 0xFFFFFFFFFFFFFFFF:016x}" for v in lanes)
