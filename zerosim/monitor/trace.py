"""The monitor's files: one JSON-lines observation file per rank, appended one line at a time (flushed and
fsynced, so a run killed mid-check loses at most the line being written), and a JSON summary.

``rank-NNNNN.jsonl``: one :class:`~zerosim.observe.MonitorObservation` per line (plus ``monitor_s``, the
check's wall time); ``summary.json``: rank 0's summary, written to a temporary file and renamed.
:func:`read_trace` reads a directory of them back (JSON only) for ``zerosim check trace``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..observe import MonitorObservation

RANK_FILE = re.compile(r"^rank-(\d{5,})\.jsonl$")
SUMMARY_FILE = "summary.json"


def rank_file(out: Path, rank: int) -> Path:
    return out / f"rank-{rank:05d}.jsonl"


def append_line(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line; flushed and fsynced before returning."""
    line = json.dumps(record, separators=(",", ":"), allow_nan=True) + "\n"
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``out/summary.json``, written whole (a temporary file renamed over it)."""
    tmp = out / f".{SUMMARY_FILE}.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, out / SUMMARY_FILE)


def read_trace(directory: Any) -> tuple[list[MonitorObservation], list[str]]:
    """Every observation of every rank file in ``directory``, and one note per line left out (a last line
    cut short by a killed run). A missing directory, no rank file, or a malformed line elsewhere is a
    ConfigError naming the file and line."""
    root = Path(directory)
    if not root.is_dir():
        raise ConfigError("DIR", str(directory), "is not a directory")
    files = sorted(p for p in root.iterdir() if RANK_FILE.match(p.name))
    if not files:
        raise ConfigError("DIR", str(directory), "holds no monitor observation file (rank-NNNNN.jsonl)")
    observations: list[MonitorObservation] = []
    notes: list[str] = []
    for path in files:
        rank = int(RANK_FILE.match(path.name).group(1))  # type: ignore[union-attr]
        try:
            lines = path.read_text().split("\n")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError("DIR", str(path), f"cannot be read: {err}") from None
        last = len(lines) - 1
        for number, text in enumerate(lines, 1):
            if not text.strip():
                continue
            try:
                obs = MonitorObservation.from_json(json.loads(text))
            except (ValueError, KeyError, TypeError, IndexError) as err:
                if number - 1 == last:  # no newline after it: the run stopped while writing it
                    notes.append(f"{path.name}:{number}: an unfinished last line was left out")
                    continue
                raise ConfigError("DIR", f"{path}:{number}",
                                  f"is not a monitor observation ({err})") from None
            if obs.rank != rank:
                raise ConfigError("DIR", f"{path}:{number}", f"holds rank {obs.rank}'s observation")
            observations.append(obs)
    return observations, notes
