"""A fuzzer over monitor trace folders: ``zerosim check trace`` on mutated copies of valid ones.

The valid folders: one written by a real monitored training loop (a one-rank gloo world in this
process, every=1) and one of two ranks written with the monitor's own writer. Each example mutates a
copy: a field anywhere in a line replaced by a hostile value (huge, negative, fractional or non-finite
numbers, booleans, strings with terminal escapes, lists, objects) or removed; bytes cut, flipped or
inserted (deep nesting, NUL, invalid UTF-8); lines dropped, repeated or moved to another rank's file;
rank files removed, renamed, emptied, or replaced by a FIFO, a link to ``/dev/zero``, a link out of
the folder or a directory.

Property, for every mutated folder: the command ends with 0, 1 or 2 and nothing else (no traceback),
within EXAMPLE_TIMEOUT_S, holding at most PEAK_BYTES of Python memory; exit 2 is one ``error:`` line;
0 and 1 end with the PASS / FAIL line saying how many checks were judged; no control character reaches
the terminal.

``ZEROSIM_FUZZ_EXAMPLES`` sets the number of examples (default 200: a few seconds); run it by hand with
``ZEROSIM_FUZZ_EXAMPLES=5000 python -m pytest -q -p no:cacheprovider tests/test_trace_fuzz.py``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import tempfile
import tracemalloc
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerosim.cli import main
from zerosim.monitor.trace import append_line, rank_file
from zerosim.values.observe import MonitorObservation

EXAMPLES = int(os.environ.get("ZEROSIM_FUZZ_EXAMPLES", "200"))
EXAMPLE_TIMEOUT_S = 10  #: an example that takes longer is a hang (each folder holds a few kB)
#: Python memory one example may hold at its peak: the folders hold a few kB, so anything near this
#: means a file was read without its bound (``/dev/zero`` reaches it in milliseconds)
PEAK_BYTES = 64 << 20

settings.register_profile(
    "trace-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 200,  # the suite's run is reproducible; a long run by hand explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large],
    database=None,
)


def _two_ranks(folder: Path) -> Path:
    """Two ranks of a DDP-like run at steps 0, 5 and 10, through the monitor's writer."""
    half = {0: {"w": [(0, 4)], "b": [(0, 2)]}, 1: {"w": [(4, 8)], "b": [(2, 4)]}}
    folder.mkdir()
    for step in (0, 5, 10):
        for rank in (0, 1):
            obs = MonitorObservation(
                rank=rank, world_size=2, step=step, adapter="ddp",
                held=[("w", 0, 8, "aa"), ("b", 0, 4, "bb")], owned={"w": [(0, 8)], "b": [(0, 4)]},
                numels={"w": 8, "b": 4}, step_counters=(step + 1, step + 1, "w"), grad_sq=8.0,
                grad_ranges=half[rank], grad_numel=6, grad_norm=4.0, max_norm=10.0,
                loss=float("nan") if step == 10 else 1.5)
            append_line(rank_file(folder, rank), {**obs.to_json(), "monitor_s": 0.001})
    return folder


def _real_run(folder: Path) -> Path:
    """Four steps of a real training loop under the monitor (one rank, every=1)."""
    import torch

    from zerosim.monitor import Monitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    monitor = Monitor(model, optimizer, every=1, out=folder)
    for step in range(4):
        loss = model(torch.randn(8, 6)).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        optimizer.zero_grad()
        monitor.after_step(step, loss=loss.detach(), grad_norm=norm)
    monitor.close()
    return folder


@pytest.fixture(scope="module")
def bases(tmp_path_factory, world_of_one) -> list[Path]:
    root = tmp_path_factory.mktemp("trace-fuzz")
    folders = [_two_ranks(root / "two-ranks"), _real_run(root / "real-run")]
    for folder in folders:  # both are valid: every mutation starts from a passing folder
        code, out, err = _run(folder)
        assert code == 0 and "check(s) judged" in out, (folder, out, err)
    return folders


def _run(folder: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["check", "trace", str(folder)])
    return code, out.getvalue(), err.getvalue()


# ---- mutations ---------------------------------------------------------------------------------------
HOSTILE_TEXT = st.sampled_from(["", "w", "\x1b[2J", "\x1b]0;title\x07", "\u202e", "a\rb", "\x00", "é" * 3])
VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 7, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 10**9, 10**20]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    HOSTILE_TEXT,
    st.lists(st.integers(-3, 20), max_size=4),
    st.lists(st.lists(st.integers(-3, 20), max_size=3), max_size=3),
    st.dictionaries(HOSTILE_TEXT, st.lists(st.lists(st.integers(-3, 20), max_size=3), max_size=2),
                    max_size=2),
)
RAW = st.sampled_from([b"[" * 1000 + b"]" * 1000, b"{" * 5000, b"\x00", b"\xff\xfe", b"NaN", b"-Infinity",
                       b"\n", b"{}", b"[]", b'{"rank":0}', b'"\x1b[2J"', b"1" * 40, b"\xe2\x80\xae"])


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (keys and indices), the value itself first."""
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _nodes(v, (*path, i))
    return out


def _mutate_field(path: Path, data: st.DataObject) -> None:
    lines = path.read_bytes().split(b"\n")
    complete = [i for i, t in enumerate(lines[:-1]) if t.strip()]
    if not complete:
        return
    i = data.draw(st.sampled_from(complete))
    try:
        record = json.loads(lines[i])
    except ValueError:  # an earlier mutation broke this line already
        return
    inner = _nodes(record)[1:]
    if not inner:  # an earlier mutation left a bare number or an empty object there
        return
    where = data.draw(st.sampled_from(inner))
    parent = record
    for key in where[:-1]:
        parent = parent[key]
    if isinstance(parent, dict) and data.draw(st.booleans()):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(VALUES)
    lines[i] = json.dumps(record, separators=(",", ":"), allow_nan=True).encode()
    path.write_bytes(b"\n".join(lines))


def _mutate_bytes(path: Path, data: st.DataObject) -> None:
    raw = path.read_bytes()
    at = data.draw(st.integers(0, len(raw)))
    how = data.draw(st.sampled_from(["cut", "flip", "insert", "replace-line"]))
    if how == "cut":
        raw = raw[:at]
    elif how == "flip" and raw:
        at = min(at, len(raw) - 1)
        raw = raw[:at] + bytes([raw[at] ^ (1 << data.draw(st.integers(0, 7)))]) + raw[at + 1:]
    elif how == "insert":
        raw = raw[:at] + data.draw(RAW) + raw[at:]
    else:
        lines = raw.split(b"\n")
        lines[min(at, len(lines) - 1)] = data.draw(RAW)
        raw = b"\n".join(lines)
    path.write_bytes(raw)


def _mutate_lines(folder: Path, path: Path, data: st.DataObject) -> None:
    lines = [t for t in path.read_bytes().split(b"\n") if t]
    if not lines:
        return
    i = data.draw(st.integers(0, len(lines) - 1))
    how = data.draw(st.sampled_from(["drop", "repeat", "move"]))
    if how == "drop":
        del lines[i]
    elif how == "repeat":
        lines.insert(i, lines[i])
    else:
        others = sorted(p for p in folder.glob("rank-*.jsonl") if p != path and p.is_file())
        if others:
            other = data.draw(st.sampled_from(others))
            other.write_bytes(other.read_bytes() + lines.pop(i) + b"\n")
    path.write_bytes(b"".join(t + b"\n" for t in lines))


def _mutate_file(folder: Path, path: Path, data: st.DataObject) -> None:
    how = data.draw(st.sampled_from(["remove", "rename", "copy", "empty", "fifo", "dev-zero", "outside",
                                     "dangling", "directory"]))
    if how == "remove":
        path.unlink()
    elif how in ("rename", "copy"):
        rank = data.draw(st.one_of(st.integers(0, 12), st.sampled_from([99999, 10**6, 10**20])))
        target = folder / f"rank-{rank:05d}.jsonl"
        if target != path:
            if target.is_dir() and not target.is_symlink():
                target.rmdir()  # an earlier mutation made it a directory (empty)
            elif target.is_symlink() or target.exists():
                target.unlink()  # a link, a FIFO or a file: replaced by the copy
            shutil.copyfile(path, target)
            if how == "rename":
                path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
        if how == "fifo":
            os.mkfifo(path)
        elif how == "dev-zero":
            os.symlink("/dev/zero", path)
        elif how == "outside":
            os.symlink(folder.parent / "outside.jsonl", path)
        elif how == "dangling":
            os.symlink(folder / "nowhere", path)
        else:
            path.mkdir()


@settings(settings.get_profile("trace-fuzz"))
@given(data=st.data())
def test_check_trace_survives_any_mutated_folder(bases, data):
    base = data.draw(st.sampled_from(bases))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "trace"
        shutil.copytree(base, folder)
        (Path(tmp) / "outside.jsonl").write_bytes(rank_file(base, 0).read_bytes())
        for _ in range(data.draw(st.integers(1, 3))):
            files = sorted(p for p in folder.glob("rank-*.jsonl") if p.is_file() and not p.is_symlink())
            if not files:
                break
            path = data.draw(st.sampled_from(files))
            kind = data.draw(st.sampled_from(["field", "field", "bytes", "lines", "file"]))
            if kind == "field":
                _mutate_field(path, data)
            elif kind == "bytes":
                _mutate_bytes(path, data)
            elif kind == "lines":
                _mutate_lines(folder, path, data)
            else:
                _mutate_file(folder, path, data)

        def hung(*_):
            raise TimeoutError(f"check trace took more than {EXAMPLE_TIMEOUT_S} s")

        old = signal.signal(signal.SIGALRM, hung)
        signal.alarm(EXAMPLE_TIMEOUT_S)
        tracemalloc.start()
        try:
            code, out, err = _run(folder)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    assert code in (0, 1, 2), (code, out, err)
    assert peak < PEAK_BYTES, f"{peak:,} bytes at the peak"
    assert not any(ord(c) < 32 and c != "\n" or 0x7F <= ord(c) < 0xA0 or c == "\u202e" for c in out + err)
    if code == 2:
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: "), (out, err)
    else:
        assert err == "" and out.splitlines()[-1].startswith(("PASS ", "FAIL ")), (out, err)
        assert "check(s) judged" in out.splitlines()[-1]
