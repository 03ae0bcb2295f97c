"""The monitor's files: one JSON-lines observation file per rank, appended one line at a time (flushed and
fsynced, so a run killed mid-check loses at most the line being written), and a JSON summary.

Only regular files are written (a FIFO, a device or a symbolic link where a file is expected is refused
with an ``OSError``, never opened for writing, so writing never blocks); the monitor reports a failure
once, on the rank it happened on.

``rank-NNNNN.jsonl``: one :class:`~zerosim.values.observe.MonitorObservation` per line (plus ``monitor_s``,
the check's wall time); ``summary.json``: rank 0's summary, written to a temporary file and renamed.
:mod:`zerosim.monitor.trace_reader` reads a folder of them back for ``zerosim check trace``.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

#: a rank file's name: ASCII digits only, nothing after the suffix (``$`` would allow a newline)
RANK_FILE = re.compile(r"rank-([0-9]{5,})\.jsonl\Z")
SUMMARY_FILE = "summary.json"


def rank_file(out: Path, rank: int) -> Path:
    return out / f"rank-{rank:05d}.jsonl"


#: how the monitor's files are opened: never blocking (a FIFO without a reader fails at once), never
#: through a symbolic link, not inherited by a child process
_FLAGS = os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_NOT_REGULAR = "is not a regular file (the monitor writes regular files only)"


def _open_regular(path: Path, flags: int) -> int:
    """A descriptor of ``path`` opened with ``flags`` on top of :data:`_FLAGS`, refused (``OSError``)
    unless it is a regular file: checked before opening, so a FIFO, a device or a link is never opened
    for writing and opening never blocks, and again on the descriptor opened."""
    try:
        mode: int | None = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        raise OSError(errno.EINVAL, _NOT_REGULAR)
    fd = os.open(path, _FLAGS | flags, 0o644)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, _NOT_REGULAR)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def touch_regular(path: Path) -> None:
    """Create ``path``, or keep it if it is a regular file (``OSError`` otherwise): the check, at
    ``Monitor()``, that a rank's file can be written."""
    os.close(_open_regular(path, os.O_CREAT | os.O_APPEND))


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to the regular file ``path``; fsynced before returning."""
    line = (json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n").encode()
    fd = _open_regular(path, os.O_CREAT | os.O_APPEND)
    try:
        _write_all(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``out/summary.json``, written whole (a temporary regular file renamed over it)."""
    tmp = out / f".{SUMMARY_FILE}.tmp"
    fd = _open_regular(tmp, os.O_CREAT | os.O_TRUNC)
    try:
        _write_all(fd, (json.dumps(summary, indent=2) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, out / SUMMARY_FILE)
