"""How a checkpoint's files are opened: regular files inside the checkpoint directory, nothing else.

A checkpoint directory is input a user may not control (copied from elsewhere, on a shared disk), so
every file the format reads goes through :func:`open_member`:

* the name is a plain file name (no path separator, no NUL, not ``.`` or ``..``), so the file is an
  entry of the directory itself;
* it is opened with ``O_NOFOLLOW`` (a symbolic link is refused, never followed: nothing about its
  target, not even its size, is looked at) and ``O_NONBLOCK`` (a FIFO cannot block the open);
* ``fstat`` of the open descriptor must say "regular file" (a FIFO, a device, a socket or a directory
  is refused), and the opened file's real path must lie inside the directory's real path.

:func:`read_json_bounded` reads such a file in bounded chunks up to a limit the caller derives, and
parses it as strict JSON: UTF-8 only, no ``NaN`` / ``Infinity``, no integer longer than 20 digits, no
duplicate keys, nesting at most ``MAX_JSON_DEPTH`` deep. Every refusal is a one-line ConfigError
naming the file and the problem.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from ..errors import ConfigError

READ_CHUNK = 1 << 20  #: bytes per read call of a bounded read
MAX_JSON_DEPTH = 64  #: nesting of arrays/objects an index may use (the format itself needs 5)
MAX_INT_DIGITS = 20  #: an integer longer than this cannot be a size, offset or count (2**64 has 20)
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def checkpoint_directory(path: str | Path, field: str = "checkpoint") -> Path:
    """``path`` as a directory that exists (ConfigError naming it otherwise)."""
    text = str(path)
    if "\x00" in text:
        raise ConfigError(field, text, "a path cannot hold a NUL byte")
    d = Path(text)
    try:
        st = os.stat(d)
    except FileNotFoundError:
        raise ConfigError(field, text, "is not a directory (it does not exist)") from None
    except OSError as e:
        raise ConfigError(field, text, f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(field, text, "is not a directory")
    return d


def plain_name_problem(name: str) -> str | None:
    """Why ``name`` is not a plain file name inside a directory (None when it is)."""
    if not name or name in (".", ".."):
        return "is not a file name"
    if "/" in name or "\\" in name or "\x00" in name:
        return "must be a plain file name inside the checkpoint directory (no separator, no NUL)"
    return None


def member_problem(directory: Path, name: str) -> str | None:
    """Why ``directory/name`` is not a regular file inside ``directory``, judged by ``lstat`` (no file is
    opened, no link followed); None when it is one."""
    why = plain_name_problem(name)
    if why is not None:
        return why
    try:
        st = os.lstat(directory / name)
    except FileNotFoundError:
        return "is named by the index but does not exist"
    except OSError as e:
        return f"cannot be examined: {e.strerror or e}"
    return _type_problem(st.st_mode)


def _type_problem(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "is a symbolic link: only regular files inside the checkpoint directory are read"
    kind = (
        "a directory"
        if stat.S_ISDIR(mode)
        else "a FIFO"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
    )
    return f"is {kind}, not a regular file"


def open_member(directory: Path, name: str, field: str = "checkpoint file") -> tuple[BinaryIO, int]:
    """Open ``directory/name`` for reading if it is a regular file inside ``directory``; returns the
    handle and the file's size. ConfigError naming the path and the problem otherwise."""
    why = plain_name_problem(name)
    if why is not None:
        raise ConfigError(field, name, why)
    path = directory / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ConfigError(field, str(path), "is named by the index but does not exist") from None
    except OSError as e:
        lstat_why = member_problem(directory, name)
        raise ConfigError(field, str(path), lstat_why or f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = _type_problem(st.st_mode)
        if why is None and not _inside(directory, path):
            why = "lies outside the checkpoint directory"
        if why is not None:
            raise ConfigError(field, str(path), why)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def _inside(directory: Path, path: Path) -> bool:
    real_dir = os.path.realpath(directory)
    return os.path.dirname(os.path.realpath(path)) == real_dir


def read_bounded(fh: BinaryIO, size: int, limit: int, what: str) -> bytes:
    """All of ``fh`` in chunks of READ_CHUNK, refusing more than ``limit`` bytes (``size`` is what
    fstat said; a file that grows while it is read is caught by the same limit)."""
    if size > limit:
        raise ConfigError("checkpoint", what, f"is {size:,} bytes, more than the {limit:,} it may hold")
    parts, total = [], 0
    while True:
        chunk = fh.read(min(READ_CHUNK, limit + 1 - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ConfigError("checkpoint", what, f"holds more than the {limit:,} bytes it may hold")
    return b"".join(parts)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (strings skipped), in linear
    time and without recursion."""
    skeleton = _STRING.sub(b"", raw).translate(None, delete=bytes(set(range(256)) - set(b"[]{}")))
    if not skeleton:
        return 0
    steps = np.frombuffer(skeleton, np.uint8)
    depth = np.cumsum(np.where((steps == ord("[")) | (steps == ord("{")), 1, -1))
    return int(depth.max())


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number JSON allows")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice in one object")
        out[k] = v
    return out


def parse_json_strict(raw: bytes, what: str) -> Any:
    """``raw`` parsed as strict JSON (see the module docstring); ConfigError naming ``what`` otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("checkpoint", what, f"is not UTF-8 text (byte {e.start}: {e.reason})") from None
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(
            "checkpoint", what, f"nests {depth} levels deep; an index needs at most {MAX_JSON_DEPTH}"
        )
    try:
        return json.loads(
            text, parse_constant=_no_constant, parse_int=_bounded_int, object_pairs_hook=_unique_keys
        )
    except RecursionError:  # pragma: no cover - the depth check above comes first
        raise ConfigError("checkpoint", what, "nests too deeply") from None
    except ValueError as e:
        raise ConfigError("checkpoint", what, f"is not valid JSON: {e}") from None
