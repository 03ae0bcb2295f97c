"""Reading files from a folder a user may not control: regular files inside it, bounded, strict JSON.

A checkpoint directory and a monitor's trace folder are input the reader did not write (copied from
elsewhere, on a shared disk, edited by hand), so every file they read goes through :func:`open_regular`:

* the name is a plain file name (no path separator, no NUL, not ``.`` or ``..``), so the file is an
  entry of the folder itself;
* it is opened with ``O_NOFOLLOW`` (a symbolic link is refused, never followed: nothing about its
  target, not even its size, is looked at) and ``O_NONBLOCK`` (a FIFO cannot block the open);
* ``fstat`` of the open descriptor must say "regular file" (a FIFO, a device, a socket or a directory
  is refused), and the opened file's real path must lie inside the folder's real path.

:func:`read_bounded` reads such a file in bounded chunks up to a limit the caller derives, and
:func:`parse_json_strict` parses bytes as strict JSON: UTF-8 only, no integer longer than 20 digits, no
duplicate keys, nesting no deeper than the caller's bound (measured before the parser recurses), and
no ``NaN`` / ``Infinity`` unless the caller's format writes them. Every refusal is a one-line
ConfigError naming the file and the problem.
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
MAX_INT_DIGITS = 20  #: an integer longer than this cannot be a size, offset or count (2**64 has 20)
_ESCAPE = re.compile(rb"\\.", re.DOTALL)  #: a backslash and the byte it escapes
_NOT_STRUCTURAL = bytes(set(range(256)) - set(b'"[]{}'))


def plain_name_problem(name: str, place: str) -> str | None:
    """Why ``name`` is not a plain file name inside the folder ``place`` describes (None when it is)."""
    if not name or name in (".", ".."):
        return "is not a file name"
    if "/" in name or "\\" in name or "\x00" in name:
        return f"must be a plain file name inside the {place} (no separator, no NUL)"
    return None


def file_type_problem(mode: int, place: str) -> str | None:
    """Why a file of ``mode`` (an ``lstat`` or ``fstat`` mode) is not read (None: a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return f"is a symbolic link: only regular files inside the {place} are read"
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


def lstat_problem(directory: Path, name: str, place: str, missing: str) -> str | None:
    """Why ``directory/name`` is not a regular file inside ``directory``, judged by ``lstat`` (no file is
    opened, no link followed); ``missing``: the reason when it does not exist. None when it is one."""
    why = plain_name_problem(name, place)
    if why is not None:
        return why
    try:
        st = os.lstat(directory / name)
    except FileNotFoundError:
        return missing
    except OSError as e:
        return f"cannot be examined: {e.strerror or e}"
    return file_type_problem(st.st_mode, place)


def open_regular(directory: Path, name: str, field: str, place: str, missing: str) -> tuple[BinaryIO, int]:
    """Open ``directory/name`` for reading if it is a regular file inside ``directory``; returns the
    handle and the file's size. ConfigError (``field``, the path, the problem) otherwise; ``place``
    names the folder in the reason, ``missing`` is the reason when the file does not exist."""
    why = plain_name_problem(name, place)
    if why is not None:
        raise ConfigError(field, name, why)
    path = directory / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    flags |= getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise ConfigError(field, str(path), missing) from None
    except OSError as e:
        lstat_why = lstat_problem(directory, name, place, missing)
        raise ConfigError(field, str(path), lstat_why or f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = file_type_problem(st.st_mode, place)
        if why is None and not _inside(directory, path):
            why = f"lies outside the {place}"
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


def read_bounded(fh: BinaryIO, size: int, limit: int, field: str, what: str) -> bytes:
    """All of ``fh`` in chunks of READ_CHUNK, refusing more than ``limit`` bytes (``size`` is what
    fstat said; a file that grows while it is read is caught by the same limit)."""
    if size > limit:
        raise ConfigError(field, what, f"is {size:,} bytes, more than the {limit:,} it may hold")
    parts, total = [], 0
    while True:
        chunk = fh.read(min(READ_CHUNK, limit + 1 - total))
        if not chunk:
            break
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ConfigError(field, what, f"holds more than the {limit:,} bytes it may hold")
    return b"".join(parts)


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (strings skipped), in linear
    time and without recursion."""
    # with escaped pairs gone every quote opens or closes a string: the brackets outside strings are
    # the even-numbered pieces between quotes (all of it in C, about 10 ms a megabyte)
    kept = _ESCAPE.sub(b"", raw).translate(None, delete=_NOT_STRUCTURAL)
    skeleton = b"".join(kept.split(b'"')[0::2])
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
            raise ValueError(f"the key {k[:80]!r} appears twice in one object")
        out[k] = v
    return out


def parse_json_strict(raw: bytes, field: str, what: str, max_depth: int, needs: str,
                      allow_constants: bool = False) -> Any:
    """``raw`` parsed as strict JSON (see the module docstring); ConfigError (``field``, ``what``, the
    problem) otherwise. ``max_depth``: the deepest nesting allowed, ``needs``: what the format needs,
    for the message; ``allow_constants``: ``NaN``, ``Infinity`` and ``-Infinity`` read as floats (a
    format whose writer writes them)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(field, what, f"is not UTF-8 text (byte {e.start}: {e.reason})") from None
    depth = json_depth(raw)
    if depth > max_depth:
        raise ConfigError(field, what, f"nests {depth} levels deep; {needs}")
    try:
        return json.loads(text, parse_constant=None if allow_constants else _no_constant,
                          parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except RecursionError:  # pragma: no cover - the depth check above comes first
        raise ConfigError(field, what, "nests too deeply") from None
    except ValueError as e:
        raise ConfigError(field, what, f"is not valid JSON: {e}") from None
