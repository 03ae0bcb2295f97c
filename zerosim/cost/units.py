"""Byte units for human output. JSON always carries plain integer bytes; only tables use these.

Two families, never mixed silently: decimal ``GB = 10**9`` (the ZeRO paper's unit) and binary
``GiB = 2**30`` (what ``nvidia-smi`` and most allocators print). Every formatted table names the unit
it prints in its header, so "31.4" is never ambiguous.
"""

from __future__ import annotations

import math

from ..errors import ConfigError

UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50,
}
DECIMAL_STEPS = ("B", "KB", "MB", "GB", "TB", "PB")
BINARY_STEPS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def parse_unit(name: str) -> str:
    """Canonical unit name for ``name`` (case-insensitive: ``gb`` -> ``GB``, ``gib`` -> ``GiB``)."""
    for unit in UNITS:
        if unit.lower() == str(name).strip().lower():
            return unit
    raise ConfigError("unit", name, f"unknown unit; known: {', '.join(UNITS)}")


def to_unit(nbytes: float, unit: str) -> float:
    """``nbytes`` expressed in ``unit`` (a float)."""
    return float(nbytes) / UNITS[parse_unit(unit)]


def auto_unit(nbytes: float, binary: bool = False) -> str:
    """The largest unit of the family in which ``nbytes`` is at least 1 (bytes for 0)."""
    steps = BINARY_STEPS if binary else DECIMAL_STEPS
    chosen = steps[0]
    for unit in steps:
        if abs(nbytes) >= UNITS[unit]:
            chosen = unit
    return chosen


def format_bytes(nbytes: float, unit: str | None = None, binary: bool = False, digits: int = 3) -> str:
    """``nbytes`` as ``"31.4 GB"``: in ``unit`` if given, else the best unit of the chosen family.

    ``digits`` is the number of significant digits (the paper prints 3: 31.4 GB, 1.88 GB).
    """
    unit = parse_unit(unit) if unit else auto_unit(nbytes, binary)
    value = to_unit(nbytes, unit)
    if unit == "B":
        return f"{int(round(value))} B"
    return f"{value:.{digits}g} {unit}"


def format_value(nbytes: float, unit: str, digits: int = 4) -> str:
    """The number only (no unit suffix), for table cells whose header names the unit.

    ``digits`` significant digits, never scientific notation: ``31.41``, ``1.875``, ``16,000``.
    """
    value = to_unit(nbytes, unit)
    if parse_unit(unit) == "B":
        return f"{int(round(value)):,}"
    if value == 0:
        return "0"
    if abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    text = f"{value:.{digits}g}"
    if "e" in text:  # tiny values: as many decimals as the significant digits need
        decimals = digits - 1 - math.floor(math.log10(abs(value)))
        text = f"{value:.{decimals}f}"
    return text
