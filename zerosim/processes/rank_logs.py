"""Each rank's own output in a file of its own: ``<folder>/rank<R>.log``.

A launcher that sets ``$ZEROSIM_RANK_LOG_DIR`` gets every rank's standard output and standard error
(and those of whatever the rank starts, which inherit them) in that folder, written by the rank
itself (:func:`send_output_to_rank_log`, called first thing by the rank entry point). Nothing of it
passes through the launching process: however much a rank prints, the launcher's memory does not
grow, and a child that keeps the rank's output open holds a file, not a pipe someone waits on. The
launcher reads back only a bounded tail (:func:`log_tail`, :func:`failure_lines`) and names the file
in its failure message. Serves the "a failing rank ends the run naming it" rule. Pure standard library.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

RANK_LOG_DIR_ENV = "ZEROSIM_RANK_LOG_DIR"
TAIL_BYTES = 64 * 1024  #: how much of a log's end is read back: enough for a traceback, never the whole log
_FAILURE_RE = re.compile(r"^rank \d+ failed: ")


def rank_log_path(folder: str | Path, rank: int) -> Path:
    """Where rank ``rank``'s output goes."""
    return Path(folder) / f"rank{rank}.log"


def send_output_to_rank_log(rank: int) -> Path | None:
    """Point this process's file descriptors 1 and 2 at ``$ZEROSIM_RANK_LOG_DIR/rank<R>.log`` (created
    or emptied); None, and nothing changed, when the variable is unset or the file cannot be opened."""
    folder = os.environ.get(RANK_LOG_DIR_ENV)
    if not folder:
        return None
    path = rank_log_path(folder, rank)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    except OSError as e:
        print(f"rank {rank}: cannot write its log {path}: {e.strerror}; output stays here", file=sys.stderr)
        return None
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


def _tail_text(path: Path, max_bytes: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read(max_bytes)
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    if size > max_bytes:  # the first line read is cut: drop it
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return text


def log_tail(path: Path, lines: int = 3, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The last ``lines`` non-blank lines of ``path``, read from at most its last ``max_bytes`` bytes,
    each cut to 300 characters."""
    kept = [ln.rstrip() for ln in _tail_text(path, max_bytes).splitlines() if ln.strip()]
    return [ln if len(ln) <= 300 else ln[:300] + "..." for ln in kept[-lines:]]


def failure_lines(path: Path, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The ``rank R failed: ...`` lines in the last ``max_bytes`` bytes of ``path``, in order."""
    return [ln.rstrip() for ln in _tail_text(path, max_bytes).splitlines() if _FAILURE_RE.match(ln)]
