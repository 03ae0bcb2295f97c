"""The handful of array operations a collective of the in-process simulator needs, on numpy arrays
and torch tensors alike: copy, concatenate, combine in place, and what a group's members compare
(type, shape, dtype) before they meet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def copy_array(x: Any) -> Any:
    return x.clone() if is_torch(x) else x.copy()


def concat(xs: Sequence[Any]) -> Any:
    if is_torch(xs[0]):
        import torch

        return torch.cat(list(xs))
    import numpy as np

    return np.concatenate(list(xs))


def combine_into(acc: Any, x: Any, op: str) -> None:
    """``acc = acc op x`` in place (``avg`` adds: the division comes once, at the end)."""
    if op != "max":
        acc += x
    elif is_torch(acc):
        import torch

        torch.maximum(acc, x, out=acc)
    else:
        import numpy as np

        np.maximum(acc, x, out=acc)


def is_floating(x: Any) -> bool:
    """Whether ``x`` holds floating or complex values (what ``avg`` can divide without truncating)."""
    if is_torch(x):
        return bool(x.is_floating_point() or x.is_complex())
    return x.dtype.kind in "fcV"  # V: ml_dtypes' bfloat16


def read_only(x: Any) -> Any:
    """numpy results shared by every rank are made read-only, so a rank cannot corrupt its peers."""
    if not is_torch(x):
        x.flags.writeable = False
    return x


def nbytes(x: Any) -> int:
    if is_torch(x):
        return int(x.numel() * x.element_size())
    return int(x.nbytes)


def signature(x: Any) -> tuple[type, tuple[int, ...], Any]:
    """(array type, shape, dtype) of a collective's array, compared across the group's members: the
    dtype object itself, cheap to compare (only a mismatch message spells out its name); the type
    first, so dtypes of different array libraries are never compared with each other."""
    return type(x), tuple(x.shape), x.dtype
