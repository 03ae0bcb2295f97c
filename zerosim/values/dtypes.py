"""Dtype names used across zerosim, with their sizes. Strings, so layouts stay plain values."""

from __future__ import annotations

from ..errors import ConfigError

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


#: the short name of each floating dtype, the spelling a precision option (``--precision bf16``) uses
SHORT_NAMES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def canonical_dtype(name: str, field: str = "dtype", allowed: tuple[str, ...] | None = None) -> str:
    """Return the canonical dtype name for ``name`` (accepts fp32/bf16/torch.float32 style aliases);
    ConfigError naming ``field`` when it is unknown, or outside ``allowed`` (canonical names) if given."""
    key = str(name).strip().removeprefix("torch.").lower()
    key = _ALIASES.get(key, key)
    if key not in ITEMSIZE:
        raise ConfigError(field, name, f"unknown dtype; known: {', '.join(sorted(ITEMSIZE))}")
    if allowed is not None and key not in allowed:
        raise ConfigError(field, name, f"must be one of {spellings(allowed)}")
    return key


def precision_name(name: str, field: str = "precision", allowed: tuple[str, ...] | None = None) -> str:
    """The short name (fp64, fp32, bf16, fp16) of a floating dtype given in either spelling (``bf16``
    or ``bfloat16``, ``fp32`` or ``float32``, ...): every precision option normalises through here.
    ``allowed``: the short names the caller accepts (ConfigError naming ``field`` for any other)."""
    key = str(name).strip().lower()
    long = key if key in SHORT_NAMES else _ALIASES.get(key.removeprefix("torch."), key.removeprefix("torch."))
    short = SHORT_NAMES.get(long)
    if short is None or (allowed is not None and short not in allowed):
        known = allowed if allowed is not None else tuple(SHORT_NAMES.values())
        raise ConfigError(field, name, f"must be one of {spellings(known)}")
    return short


def spellings(names: tuple[str, ...]) -> str:
    """``fp32 (float32), bf16 (bfloat16)``: each accepted name with its other spelling."""
    to_long = {short: long for long, short in SHORT_NAMES.items()}
    to_short = dict(SHORT_NAMES)
    return ", ".join(f"{n} ({to_long.get(n) or to_short.get(n)})" if (to_long.get(n) or to_short.get(n))
                     else n for n in names)


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return ITEMSIZE[canonical_dtype(name)]
