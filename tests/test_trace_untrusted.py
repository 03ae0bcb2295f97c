"""``zerosim check trace`` on folders it did not write: a killed run's cut last line and a rank's missing
lines are reported incomplete and not judged; hostile files (a FIFO, a link to ``/dev/zero`` or out of
the folder, a 1 GB line), non-integer or out-of-range fields, deep nesting and an inconsistent world
each end in one ``error:`` line and exit 2, within seconds and without a traceback; names are printed
escaped. The folders are written with the monitor's own writer (:mod:`zerosim.monitor.trace`)."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from zerosim.cli import main as cli_main
from zerosim.errors import ConfigError
from zerosim.monitor.trace import append_line, rank_file
from zerosim.monitor.trace_reader import MAX_LINE_BYTES, MAX_TRACE_BYTES, read_trace
from zerosim.values.observe import MonitorObservation

NUMELS = {"w": 8, "b": 4}
STEPS = (0, 5, 10)
SECONDS = 10  #: an alarm for every command below: reading a folder of a few kB takes milliseconds


def row(rank: int, step: int, world: int = 2, **fields) -> MonitorObservation:
    """Rank ``rank`` of a DDP-like run: everything held and owned, equal digests, each rank summing the
    squares of its half of the gradient (4 + 4 = 16 = 4.0 squared: the logged norm)."""
    half = {0: {"w": [(0, 4)], "b": [(0, 2)]}, 1: {"w": [(4, 8)], "b": [(2, 4)]}}
    base = dict(rank=rank, world_size=world, step=step, adapter="ddp",
                held=[("w", 0, 8, "aa"), ("b", 0, 4, "bb")], owned={"w": [(0, 8)], "b": [(0, 4)]},
                numels=dict(NUMELS), step_counters=(step + 1, step + 1, "w"), grad_sq=8.0,
                grad_ranges=half.get(rank), grad_numel=6, grad_norm=4.0, loss=1.5)
    base.update(fields)
    return MonitorObservation(**base)


def write(folder: Path, rows: list[MonitorObservation]) -> Path:
    folder.mkdir(exist_ok=True)
    for r in rows:
        append_line(rank_file(folder, r.rank), {**r.to_json(), "monitor_s": 0.001})
    return folder


@pytest.fixture
def good(tmp_path) -> Path:
    return write(tmp_path / "good", [row(r, s) for s in STEPS for r in (0, 1)])


def check(folder: Path, *extra: str, capsys) -> tuple[int, str, str]:
    """``zerosim check trace FOLDER`` in this process under an alarm: (exit status, stdout, stderr)."""
    def hung(*_):
        raise TimeoutError(f"check trace took more than {SECONDS} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(SECONDS)
    try:
        code = cli_main(["check", "trace", str(folder), *extra])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert not any(ord(c) < 32 or 0x7F <= ord(c) < 0xA0 or c in "\u202e\u2066" for c in lines[0]), err
    return lines[0]


def lines_of(path: Path) -> list[dict]:
    return [json.loads(t) for t in path.read_text().splitlines()]


def rewrite(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":"), allow_nan=True) + "\n" for r in records))


def test_a_valid_folder_passes_and_says_how_many_checks_it_judged(good, capsys):
    code, out, _ = check(good, capsys=capsys)
    assert code == 0 and "PASS 3 check(s) judged (steps 0..10) of 2 rank(s): " in out, out


def test_a_killed_runs_cut_last_line_is_incomplete_and_the_rest_passes(good, capsys):
    path = rank_file(good, 1)
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: last + (len(data) - last) // 2])  # SIGKILL in the middle of the last write
    code, out, _ = check(good, capsys=capsys)
    assert code == 0, out
    assert "incomplete: step 10: no line from rank(s) 1, not judged" in out
    assert "note: rank-00001.jsonl:3: an unfinished last line was left out" in out
    assert "PASS 2 check(s) judged (steps 0..5) of 2 rank(s), 1 incomplete check(s) not judged" in out
    code, out, _ = check(good, "--json", capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["checks_judged"] == 2
    assert doc["incomplete"] == [{"step": 10, "missing_ranks": [1]}]


def test_a_rank_without_a_line_for_a_step_makes_that_check_incomplete(tmp_path, capsys):
    folder = write(tmp_path / "gap", [row(0, s) for s in STEPS] + [row(1, s) for s in (0, 10)])
    code, out, _ = check(folder, capsys=capsys)
    assert code == 0 and "incomplete: step 5: no line from rank(s) 1, not judged" in out, out
    assert "PASS 2 check(s) judged (steps 0..10)" in out
    # the incomplete check is not judged even when what it holds would be a violation
    folder = write(tmp_path / "gap-bad", [row(0, s, grad_norm=99.0 if s == 5 else 4.0) for s in STEPS]
                   + [row(1, s) for s in (0, 10)])
    assert check(folder, capsys=capsys)[0] == 0
    rank_file(folder, 1).unlink()
    write(folder, [row(1, s, grad_norm=99.0 if s == 5 else 4.0) for s in STEPS])
    code, out, _ = check(folder, capsys=capsys)
    assert code == 1 and "grad_norm" in out and "step=5" in out, out


def test_a_folder_without_a_complete_check_is_not_a_pass(tmp_path, capsys):
    folder = write(tmp_path / "half", [row(0, s) for s in STEPS])
    rank_file(folder, 1).write_bytes(b"")  # rank 1 was killed before its first check
    code, _, err = check(folder, capsys=capsys)
    assert code == 2 and "holds 3 check(s), none of them written by all 2 ranks: nothing to judge" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    for rank in (0, 1):
        rank_file(empty, rank).write_bytes(b"")
    code, _, err = check(empty, capsys=capsys)
    assert code == 2 and "holds no complete observation line" in one_error_line(err)


def _set(field: str, value) -> Callable[[dict], None]:
    def change(record: dict) -> None:
        record[field] = value
    return change


#: (a change to rank 1's second line, words its one error line must hold)
BAD_FIELDS = {
    "rank-infinity": (_set("rank", math.inf), "field rank=inf: must be an integer"),
    "rank-fraction": (_set("rank", 0.9), "field rank=0.9: must be an integer"),
    "rank-bool": (_set("rank", True), "field rank=True: must be an integer"),
    "world-0": (_set("world_size", 0), "field world_size=0: must be an integer in [1, 1048576]"),
    "world-negative": (_set("world_size", -2), "field world_size=-2"),
    "world-huge": (_set("world_size", 10**9), "field world_size=1000000000"),
    "world-mixed": (_set("world_size", 3), "differs from the world size 2 of"),
    "range-2^64": (_set("owned", {"w": [[0, 2**64]], "b": [[0, 4]]}),
                   "field owned['w'][0][1]=18446744073709551616: must be an integer in"),
    "range-2^70": (_set("owned", {"w": [[0, 2**70]], "b": [[0, 4]]}), "an integer of 22 digits"),
    "owned-a-list": (_set("owned", [1, 2]), "field owned=[1, 2]: must be an object"),
    "range-not-a-pair": (_set("owned", {"w": [[0, 4, 8]], "b": [[0, 4]]}), "must be a list of 2 items"),
    "grad-sq-negative": (_set("grad_sq", -1.0), "field grad_sq=-1.0: must not be negative"),
    "grad-sq-minus-inf": (_set("grad_sq", -math.inf), "field grad_sq=-inf: must not be negative"),
    "grad-norm-text": (_set("grad_norm", "4"), "field grad_norm='4': must be a number"),
    "max-norm-zero": (_set("max_norm", 0.0), "field max_norm=0.0: must be a positive number"),
    "numel-negative": (_set("numels", {"w": -8, "b": 4}), "field numels['w']=-8"),
    "held-short": (_set("held", [["w", 0, 8]]), "field held[0]"),
    "step-missing": (lambda r: r.pop("step"), "field step=None: is missing"),
    "step-twice": (_set("step", 0), "field step=0: appears twice in this file"),
    "empty-object": (lambda r: r.clear(), "field rank=None: is missing"),
}


@pytest.mark.parametrize("name", sorted(BAD_FIELDS))
def test_a_bad_field_is_one_line_naming_file_line_and_field(good, name, capsys):
    change, words = BAD_FIELDS[name]
    records = lines_of(rank_file(good, 1))
    change(records[1])
    rewrite(rank_file(good, 1), records)
    code, out, err = check(good, capsys=capsys)
    line = one_error_line(err)
    assert code == 2 and out == "", (out, err)
    assert "rank-00001.jsonl:2" in line and words in line, line


def test_infinity_deep_nesting_and_bad_json_are_refused_before_they_can_hurt(good, capsys):
    path = rank_file(good, 1)
    text = path.read_text().splitlines()
    cases = {
        '{"rank": Infinity}': "field rank=inf: must be an integer",
        "[" * 1000 + "]" * 1000: "nests 1000 levels deep; a monitor's line needs 4, 16 are allowed",
        "{" + '"a":' * 1 + "{" * 999 + "}" * 1000: "nests 1000 levels deep",
        text[1].replace('"rank":1', '"rank":1,"rank":1'): "the key 'rank' appears twice",
        text[1].replace('"step":5', '"step":' + "9" * 30): "an integer of 30 digits",
        '{"rank": 1} \xff': "is not UTF-8 text",
        '{"rank": 1': "is not valid JSON",
        "[1, 2]": "field record=[1, 2]: must be an object",
    }
    for bad, words in cases.items():
        raw = bad.encode("latin-1") if "\xff" in bad else bad.encode()
        path.write_bytes(text[0].encode() + b"\n" + raw + b"\n" + text[2].encode() + b"\n")
        code, _, err = check(good, capsys=capsys)
        assert code == 2 and words in one_error_line(err) and "rank-00001.jsonl:2" in err, (bad[:40], err)


def test_the_folder_must_hold_exactly_the_ranks_of_its_world(tmp_path, capsys):
    folder = write(tmp_path / "stray", [row(r, s, world=3) for s in STEPS for r in range(3)])
    rank_file(folder, 7).write_bytes(rank_file(folder, 2).read_bytes().replace(b'"rank":2', b'"rank":7'))
    code, _, err = check(folder, capsys=capsys)
    assert code == 2 and "field rank=7: must be below the world size (3)" in one_error_line(err), err
    rank_file(folder, 7).write_bytes(b"")
    code, _, err = check(folder, capsys=capsys)
    assert code == 2 and "is rank 7's, outside the world of 3 its lines give" in one_error_line(err)
    apart = write(tmp_path / "apart", [row(0, s) for s in STEPS])
    rank_file(apart, 5).write_bytes(b"")
    code, _, err = check(apart, capsys=capsys)
    assert code == 2 and "outside the world of 2" in one_error_line(err)
    rank_file(apart, 5).unlink()
    code, _, err = check(apart, capsys=capsys)
    assert code == 2 and "holds no file for rank(s) 1 of the world of 2" in one_error_line(err)
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "rank-99999999999999999999.jsonl").write_text(json.dumps(row(0, 0).to_json()) + "\n")
    code, _, err = check(huge, capsys=capsys)
    assert code == 2 and "names a rank beyond the largest world size" in one_error_line(err)
    twice = write(tmp_path / "twice", [row(r, s) for s in STEPS for r in (0, 1)])
    (twice / "rank-000001.jsonl").write_bytes(rank_file(twice, 1).read_bytes())
    code, _, err = check(twice, capsys=capsys)
    assert code == 2 and "a second file for rank 1" in one_error_line(err)


def test_a_fifo_a_device_link_and_links_out_of_the_folder_are_refused_within_seconds(good, tmp_path, capsys):
    outside = tmp_path / "outside.jsonl"
    outside.write_bytes(rank_file(good, 1).read_bytes())
    for make, words in ((lambda p: os.mkfifo(p), "is a FIFO, not a regular file"),
                        (lambda p: os.symlink("/dev/zero", p), "is a symbolic link"),
                        (lambda p: os.symlink(outside, p), "is a symbolic link"),
                        (lambda p: os.symlink(tmp_path / "nowhere", p), "is a symbolic link"),
                        (lambda p: p.mkdir(), "is a directory, not a regular file")):
        path = rank_file(good, 1)
        path.unlink()
        make(path)
        start = time.monotonic()
        code, _, err = check(good, capsys=capsys)
        assert code == 2 and words in one_error_line(err) and "rank-00001.jsonl" in err, err
        assert time.monotonic() - start < 2, "a refusal reads nothing: it takes milliseconds"
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        path.write_bytes(outside.read_bytes())


def test_a_one_gigabyte_line_is_refused_without_being_read_whole(good, capsys):
    path = rank_file(good, 1)
    with open(path, "ab") as f:
        f.truncate(path.stat().st_size + (1 << 30))  # a sparse 1 GB line of NUL bytes, no newline
    start = time.monotonic()
    code, _, err = check(good, capsys=capsys)
    assert code == 2 and f"more than the {MAX_TRACE_BYTES:,} allowed (--max-bytes raises the limit)" in \
        one_error_line(err), err
    # with the folder's bound raised above it, the line's own bound refuses it after MAX_LINE_BYTES
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=f"longer than the {MAX_LINE_BYTES:,} bytes a line may hold"):
            read_trace(good, max_bytes=4 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # readline holds what it read and the line it returns: about twice the bound, never the gigabyte
    assert peak < 3 * MAX_LINE_BYTES, f"{peak:,} bytes held to refuse the line"
    assert time.monotonic() - start < SECONDS


def test_names_are_printed_escaped(tmp_path, capsys):
    hostile = "w\x1b[2J\x1b]0;owned\x07\u202e\r"
    rows = [row(r, s, held=[(hostile, 0, 8, "aa" if r == 0 else "zz"), ("b", 0, 4, "bb")],
                numels={hostile: 8, "b": 4}, owned={hostile: [(0, 8)], "b": [(0, 4)]},
                grad_ranges={hostile: [(4 * r, 4 * r + 4)], "b": [(2 * r, 2 * r + 2)]})
            for s in STEPS for r in (0, 1)]
    folder = write(tmp_path / "names", rows)
    code, out, _ = check(folder, capsys=capsys)
    assert code == 1 and "C-ZERO-003" in out, out
    assert "\\x1b[2J\\x1b]0;owned\\x07\\u202e\\x0d" in out
    assert not any(ord(c) < 32 and c != "\n" or c == "\u202e" for c in out), out
    # a bad field under a hostile key: the error line escapes the key too
    records = lines_of(rank_file(folder, 1))
    records[0]["numels"][hostile] = -1
    rewrite(rank_file(folder, 1), records)
    code, _, err = check(folder, capsys=capsys)
    assert code == 2 and "\\x1b[2J" in one_error_line(err), err
