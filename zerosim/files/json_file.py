"""A launched run's settings as one small JSON file: what a launcher writes once and every rank reads.

Plain JSON, never unpickled, read with a size limit (a settings file is a few hundred bytes; anything
far larger is not one and is not read whole). A missing, unreadable, oversized or malformed file is a
:class:`~zerosim.errors.ConfigError` naming the file (one line, exit 2 on every rank). The value's own
fields are checked by the type that reads it (its ``from_json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .outputs import write_text

#: the most bytes a settings file may hold
MAX_SETTINGS_BYTES = 1 << 20


def write_settings(data: Any, path: str | os.PathLike[str]) -> Path:
    """Write ``data`` (JSON-serialisable) to ``path``, renamed into place; returns the path."""
    out = Path(path)
    write_text(out, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return out


def read_settings(path: str | os.PathLike[str], what: str = "run file") -> Any:
    """The JSON value in ``path``; ConfigError (field ``what``, value the path) if it cannot be one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SETTINGS_BYTES + 1)
    except OSError as e:
        raise ConfigError(what, str(path), e.strerror or "cannot be read") from None
    if len(raw) > MAX_SETTINGS_BYTES:
        raise ConfigError(what, str(path), f"larger than {MAX_SETTINGS_BYTES} bytes: not a {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(what, str(path), f"not JSON ({e})") from None


def check_fields(data: Any, known: tuple[str, ...], fmt: str, what: str) -> dict[str, Any]:
    """``data`` as a dict whose keys are all in ``known`` and whose ``format`` is ``fmt``; ConfigError
    naming the first field that is not."""
    if not isinstance(data, dict):
        raise ConfigError(what, type(data).__name__, "expected a JSON object")
    for key in data:
        if key not in known:
            raise ConfigError(f"{what} field {key!r}", data[key], f"unknown; known: {', '.join(known)}")
    if data.get("format") != fmt:
        raise ConfigError("format", data.get("format"), f"expected {fmt!r}")
    return data
