"""How a checkpoint's files are opened: regular files inside the checkpoint directory, nothing else.

A checkpoint directory is input a user may not control (copied from elsewhere, on a shared disk), so
every file the format reads goes through :func:`open_member` (:mod:`zerosim.files.untrusted_files` with the
checkpoint's wording):

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

import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ConfigError
from ..files import untrusted_files
from ..files.untrusted_files import MAX_INT_DIGITS, READ_CHUNK, json_depth

__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "READ_CHUNK", "checkpoint_directory", "json_depth",
           "member_problem", "open_member", "parse_json_strict", "plain_name_problem", "read_bounded"]

MAX_JSON_DEPTH = 64  #: nesting of arrays/objects an index may use (the format itself needs 5)
_PLACE = "checkpoint directory"
_MISSING = "is named by the index but does not exist"


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
    return untrusted_files.plain_name_problem(name, _PLACE)


def member_problem(directory: Path, name: str) -> str | None:
    """Why ``directory/name`` is not a regular file inside ``directory``, judged by ``lstat`` (no file is
    opened, no link followed); None when it is one."""
    return untrusted_files.lstat_problem(directory, name, _PLACE, _MISSING)


def open_member(directory: Path, name: str, field: str = "checkpoint file") -> tuple[BinaryIO, int]:
    """Open ``directory/name`` for reading if it is a regular file inside ``directory``; returns the
    handle and the file's size. ConfigError naming the path and the problem otherwise."""
    return untrusted_files.open_regular(directory, name, field, _PLACE, _MISSING)


def read_bounded(fh: BinaryIO, size: int, limit: int, what: str) -> bytes:
    """All of ``fh`` in bounded chunks, refusing more than ``limit`` bytes."""
    return untrusted_files.read_bounded(fh, size, limit, "checkpoint", what)


def parse_json_strict(raw: bytes, what: str) -> Any:
    """``raw`` parsed as strict JSON (no ``NaN`` / ``Infinity``, at most MAX_JSON_DEPTH deep);
    ConfigError naming ``what`` otherwise."""
    return untrusted_files.parse_json_strict(
        raw, "checkpoint", what, MAX_JSON_DEPTH, f"an index needs at most {MAX_JSON_DEPTH}")
