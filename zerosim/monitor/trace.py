"""The monitor's files: one JSON-lines observation file per rank, appended one line at a time (flushed and
fsynced, so a run killed mid-check loses at most the line being written), and a JSON summary.

``rank-NNNNN.jsonl``: one :class:`~zerosim.observe.MonitorObservation` per line (plus ``monitor_s``, the
check's wall time); ``summary.json``: rank 0's summary, written to a temporary file and renamed.
:mod:`zerosim.monitor.trace_reader` reads a folder of them back for ``zerosim check trace``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

#: a rank file's name: ASCII digits only, nothing after the suffix (``$`` would allow a newline)
RANK_FILE = re.compile(r"rank-([0-9]{5,})\.jsonl\Z")
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
