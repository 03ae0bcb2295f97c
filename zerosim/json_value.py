"""Reading a small JSON value a launcher wrote for its ranks (a run file), never more than a bound.

A run file is plain JSON, never unpickled; a missing, oversized or malformed file, or an object with a
field nobody knows, is a :class:`~zerosim.errors.ConfigError` naming the file or the field (one line,
exit 2 on every rank).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from .errors import ConfigError

#: A run file is a few hundred bytes; anything far larger is not one (and is not read whole).
MAX_RUN_FILE_BYTES = 1 << 20


def read_json_file(path: str | os.PathLike[str], what: str = "run file",
                   max_bytes: int = MAX_RUN_FILE_BYTES) -> Any:
    """The JSON value in ``path``; ConfigError naming ``what`` and the path when it cannot be one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(what, str(path), e.strerror or "cannot be read") from None
    if len(raw) > max_bytes:
        raise ConfigError(what, str(path), f"larger than {max_bytes} bytes: not a {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(what, str(path), f"not JSON ({e})") from None


def require_known_fields(data: Any, known: Iterable[str], what: str = "run file") -> dict[str, Any]:
    """``data`` as a JSON object whose every key is in ``known``; ConfigError naming the first stranger."""
    if not isinstance(data, dict):
        raise ConfigError(what, type(data).__name__, "expected a JSON object")
    names = tuple(known)
    for key in data:
        if key not in names:
            raise ConfigError(f"{what} field {key!r}", data[key], f"unknown; known: {', '.join(names)}")
    return data
