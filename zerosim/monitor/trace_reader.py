"""``zerosim check trace``'s reading of a monitor's folder, as untrusted input.

A trace folder may come from anywhere (copied, cut short by a killed run, edited), so it is read as the
checkpoint reader reads a checkpoint (:mod:`zerosim.files.untrusted_files`):

* only regular files inside the folder named ``rank-NNNNN.jsonl`` are read (a symbolic link, a FIFO, a
  device or a directory of that name is refused without being followed or opened for long); other
  names (``summary.json``) are left alone;
* the folder's rank files may hold at most ``max_bytes`` together (:data:`MAX_TRACE_BYTES` unless the
  caller raises it), judged from their sizes before anything is read and again while reading; one line
  at most :data:`MAX_LINE_BYTES` (a longer one is refused after reading that many bytes of it);
* each line is strict JSON (UTF-8, no duplicate key, integers of at most 20 digits, nesting at most
  :data:`MAX_LINE_DEPTH` deep, measured before the parser recurses; ``NaN`` / ``Infinity`` read, since
  the monitor writes a non-finite loss or norm as such), and every field is checked for its type and
  range (:meth:`~zerosim.values.observe.MonitorObservation.from_json`);
* one world: every line states the same world size W, its rank is its file's, and the files are
  exactly ranks 0..W-1; no rank lists a step twice.

Every refusal is one ConfigError naming the file, the line and the field. What it reads is grouped by
step: a check every rank wrote is **complete** and judged; one that some ranks did not write (a rank
killed before it, or while writing it: a last line without its newline is left out, with a note) is
**incomplete** and reported, never judged.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files.terminal_text import printable
from ..files.untrusted_files import lstat_problem, open_regular, parse_json_strict
from ..values.observation_fields import MAX_WORLD
from ..values.observe import MonitorObservation
from .trace import RANK_FILE

MAX_LINE_BYTES = 64 << 20  #: one observation line (a model of 100,000 tensors writes about 20 MB)
MAX_TRACE_BYTES = 256 << 20  #: every rank file of a folder together, unless the caller allows more (memory:
#: about 20 bytes per byte read, so near 5 GB at this bound)
MAX_LINE_DEPTH = 16  #: nesting of arrays/objects a line may use (the monitor writes 4)
_PLACE = "trace folder"
_MISSING = "disappeared while the folder was read"


@dataclass
class Trace:
    """A trace folder read: ``world_size`` W; ``complete``: the observations of every check all W ranks
    wrote (by step, in rank order); ``incomplete``: step -> the ranks that wrote no line for it;
    ``notes``: one per last line left out (cut short)."""

    world_size: int
    complete: dict[int, list[MonitorObservation]] = field(default_factory=dict)
    incomplete: dict[int, list[int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def observations(self) -> list[MonitorObservation]:
        """Every complete check's observations, step by step."""
        return [obs for step in sorted(self.complete) for obs in self.complete[step]]


def read_trace(directory: Any, max_bytes: int = MAX_TRACE_BYTES,
               max_line_bytes: int = MAX_LINE_BYTES) -> Trace:
    """``directory`` read as the module docstring says; a ConfigError for anything else."""
    root = _trace_folder(directory)
    files = _rank_files(root, max_bytes)
    by_rank: dict[int, dict[int, MonitorObservation]] = {}
    notes: list[str] = []
    world: tuple[int, str] | None = None  # the world size, and the line that first gave it
    total = 0
    for rank, name in sorted(files.items()):
        fh, _ = open_regular(root, name, "trace file", _PLACE, _MISSING)
        rows: dict[int, MonitorObservation] = {}
        shown = printable(root / name)
        with fh:
            number = 0
            while True:
                line = fh.readline(max_line_bytes + 1)
                if not line:
                    break
                number += 1
                total += len(line)
                where = f"{shown}:{number}"
                if total > max_bytes:
                    raise ConfigError("DIR", str(root), f"its rank files hold more than the {max_bytes:,} "
                                      "bytes allowed (--max-bytes raises the limit)")
                if not line.endswith(b"\n"):
                    if len(line) > max_line_bytes:
                        raise ConfigError("trace line", where, f"is longer than the {max_line_bytes:,} "
                                          "bytes a line may hold")
                    notes.append(f"{name}:{number}: an unfinished last line was left out")
                    break
                if not line.strip():
                    continue
                obs = _observation(line, where)
                if obs.rank != rank:
                    raise ConfigError(f"{where} field rank", obs.rank, f"is not the rank its file "
                                      f"names ({rank})")
                if world is None:
                    world = (obs.world_size, where)
                elif obs.world_size != world[0]:
                    raise ConfigError(f"{where} field world_size", obs.world_size,
                                      f"differs from the world size {world[0]} of {world[1]}")
                if obs.step in rows:
                    raise ConfigError(f"{where} field step", obs.step, "appears twice in this file "
                                      "(one folder holds one run: give each run its own out folder)")
                rows[obs.step] = obs
        by_rank[rank] = rows
    if world is None:
        raise ConfigError("trace folder", str(root), "holds no complete observation line: nothing to "
                          "judge" + (f" ({len(notes)} unfinished line(s) left out)" if notes else ""))
    return _grouped(root, world[0], by_rank, notes)


def _trace_folder(directory: Any) -> Path:
    text = str(directory)
    if "\x00" in text:
        raise ConfigError("DIR", text, "a path cannot hold a NUL byte")
    try:
        st = os.stat(text)
    except FileNotFoundError:
        raise ConfigError("DIR", text, "is not a directory (it does not exist)") from None
    except OSError as e:
        raise ConfigError("DIR", text, f"cannot be read: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("DIR", text, "is not a directory")
    return Path(text)


def _rank_files(root: Path, max_bytes: int) -> dict[int, str]:
    """rank -> file name of every ``rank-NNNNN.jsonl`` entry, each a regular file (by ``lstat``), all
    of them together at most ``max_bytes``."""
    files: dict[int, str] = {}
    total = 0
    try:
        entries = [entry.name for entry in os.scandir(root)]
    except OSError as e:
        raise ConfigError("DIR", str(root), f"cannot be listed: {e.strerror or e}") from None
    for name in entries:
        match = RANK_FILE.match(name)
        if match is None:
            continue
        digits = match.group(1)
        if len(digits) > len(str(MAX_WORLD)) or int(digits) >= MAX_WORLD:
            raise ConfigError("trace file", str(root / name), f"names a rank beyond the largest world "
                              f"size a trace may have ({MAX_WORLD:,})")
        rank = int(digits)
        if rank in files:
            raise ConfigError("trace file", str(root / name), f"is a second file for rank {rank} "
                              f"(beside {files[rank]})")
        why = lstat_problem(root, name, _PLACE, _MISSING)
        if why is not None:
            raise ConfigError("trace file", str(root / name), why)
        files[rank] = name
        total += os.lstat(root / name).st_size
    if total > max_bytes:
        raise ConfigError("DIR", str(root), f"its rank files hold {total:,} bytes, more than the "
                          f"{max_bytes:,} allowed (--max-bytes raises the limit)")
    if not files:
        raise ConfigError("DIR", str(root), "holds no monitor observation file (rank-NNNNN.jsonl)")
    return files


def _observation(line: bytes, where: str) -> MonitorObservation:
    """One line as an observation; a ConfigError naming ``where`` (file:line) and the field."""
    data = parse_json_strict(line, "trace line", where, MAX_LINE_DEPTH,
                             f"a monitor's line needs 4, {MAX_LINE_DEPTH} are allowed", allow_constants=True)
    try:
        return MonitorObservation.from_json(data)
    except ConfigError as e:
        # a field's path may hold a key of the line (a tensor name): escaped like every name printed
        raise ConfigError(f"{where} field {printable(e.field)}", e.value, printable(e.reason)) from None


def _grouped(root: Path, world: int, by_rank: dict[int, dict[int, MonitorObservation]],
             notes: list[str]) -> Trace:
    """The rows by step, once the files are known to be exactly ranks 0..world-1."""
    beyond = sorted(r for r in by_rank if r >= world)
    if beyond:
        raise ConfigError("trace file", str(root / f"rank-{beyond[0]:05d}.jsonl"),
                          f"is rank {beyond[0]}'s, outside the world of {world} its lines give")
    missing = [r for r in range(world) if r not in by_rank]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        raise ConfigError("DIR", str(root), f"holds no file for rank(s) {shown} of the world of {world} "
                          "its lines give (a monitored run writes one per rank)")
    trace = Trace(world_size=world, notes=notes)
    for step in sorted({s for rows in by_rank.values() for s in rows}):
        rows = [by_rank[r].get(step) for r in range(world)]
        absent = [r for r, obs in enumerate(rows) if obs is None]
        if absent:
            trace.incomplete[step] = absent
        else:
            trace.complete[step] = [obs for obs in rows if obs is not None]
    return trace
