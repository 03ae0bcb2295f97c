"""Dtype names used across zerosim, with their sizes. Strings, so layouts stay plain values."""

from __future__ import annotations

from .errors import ConfigError

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
}

_ALIASES = {
    "fp64": "float64", "double": "float64",
    "fp32": "float32", "float": "float32",
    "fp16": "float16", "half": "float16",
    "bf16": "bfloat16",
}


def canonical_dtype(name: str, field: str = "dtype") -> str:
    """Return the canonical dtype name for ``name`` (accepts fp32/bf16/torch.float32 style aliases)."""
    key = str(name).removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in ITEMSIZE:
        raise ConfigError(field, name, f"unknown dtype; known: {sorted(ITEMSIZE)}")
    return key


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return ITEMSIZE[canonical_dtype(name)]
