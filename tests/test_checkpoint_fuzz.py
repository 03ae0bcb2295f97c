"""A fuzzer over checkpoint directories: the index (JSON structure, numbers, names, nesting, raw bytes)
and the shard files (truncation, bit flips in header and data, links, FIFOs, directories).

Property, for every mutated checkpoint:

* ``zerosim checkpoint inspect`` and a load agree: inspect exits 0 exactly when the load accepts;
* neither raises anything but a one-line ZeroSimError (inspect exits 0, 1 or 2; a load through an
  engine never fails with a non-project error), and neither prints a control character;
* nothing hangs: every example runs under an alarm;
* a checkpoint that is accepted holds exactly the saved state, and reshards to another world size
  into a checkpoint that inspects clean and holds the same state.

"Load" is :func:`read_full_state` (what a load at world size 1 reads, through the same validation);
where the mutation left the model's tensors, optimizer and state dtype alone, an engine load
(``load_engine_state`` at world size 1) is run as well and must agree too.

The number of examples is ``ZEROSIM_FUZZ_EXAMPLES`` (default 25: a few seconds); run it by hand with
``ZEROSIM_FUZZ_EXAMPLES=5000 python -m pytest -q -p no:cacheprovider tests/test_checkpoint_fuzz.py``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerosim.checkpoint import INDEX_NAME, reshard
from zerosim.checkpoint.format import read_full_state
from zerosim.cli import main
from zerosim.comm.sim import RankFailed
from zerosim.engine.config import RunConfig
from zerosim.errors import ZeroSimError
from zerosim.testing.checkpoint_runs import load_and_snapshot, train_and_save

EXAMPLES = int(os.environ.get("ZEROSIM_FUZZ_EXAMPLES", "25"))
EXAMPLE_TIMEOUT_S = 30  #: an example that takes longer is a hang (each one reads about 100 kB)

settings.register_profile(
    "checkpoint-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 100,  # the suite's run is reproducible; a long run by hand explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    database=None,
)


def cfg(world: int) -> RunConfig:
    return RunConfig(strategy="zero3", world_size=world, steps=4, observe="none", timeout_s=30)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A zero3 checkpoint of 2 ranks (blocks of 512 bytes: many per file), its state and its index."""
    d = tmp_path_factory.mktemp("fuzz-base") / "ck"
    train_and_save(cfg(2), 2, d, block_bytes=512)
    index, states = read_full_state(d)
    return d, json.loads((d / INDEX_NAME).read_text()), states, index


# ---- the index -----------------------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 10**18, 2**63, 2**64, -(2**63), 4096, 512]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
NAMES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["a\x00b", "../x", "/etc/passwd", "\x1b[2J", ".", "", "x/y", "master", "\u202e"]),
)
LEAVES = st.one_of(NUMBERS, NAMES, st.none(), st.just([]), st.just({}))
VALUES = st.recursive(
    LEAVES, lambda v: st.lists(v, max_size=3) | st.dictionaries(NAMES, v, max_size=3), max_leaves=6
)
DEEP = "__zerosim_deep__"


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def index_mutation(draw: Any, original: dict) -> tuple[str, Any]:
    """("json", new index dict) or ("raw", new index bytes)."""
    data = json.loads(json.dumps(original))
    kind = draw(st.sampled_from(["set", "set", "set", "delete", "add", "deep", "raw"]))
    if kind == "raw":
        raw = bytearray(json.dumps(original).encode())
        op = draw(st.sampled_from(["flip", "truncate", "insert"]))
        at = draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del raw[at:]
        else:
            raw[at:at] = draw(st.sampled_from([b"\xff", b"\x00", b"NaN", b"[", b"}", b"9" * 30, b"\xc3"]))
        return "raw", bytes(raw)
    paths = _paths(data)
    path = draw(st.sampled_from(paths[1:]))
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    if kind == "delete":
        parent.pop(last)
    elif kind == "add" and isinstance(parent, dict):
        parent[draw(NAMES)] = draw(VALUES)
    elif kind == "deep":
        parent[last] = DEEP
        return "deep", (data, draw(st.integers(2, 300_000)))
    else:
        old = parent[last]
        if isinstance(old, int) and not isinstance(old, bool) and draw(st.booleans()):
            parent[last] = old + draw(st.sampled_from([-1, 1, -(2**40), 2**40, 10**18, -old - 1]))
        else:
            parent[last] = draw(VALUES)
    return "json", data


def write_index(d: Path, mutation: tuple[str, Any]) -> None:
    kind, value = mutation
    if kind == "raw":
        (d / INDEX_NAME).write_bytes(value)
    elif kind == "deep":
        data, depth = value
        text = json.dumps(data).replace(json.dumps(DEEP), "[" * depth + "]" * depth)
        (d / INDEX_NAME).write_text(text)
    else:
        (d / INDEX_NAME).write_text(json.dumps(value))  # NaN / Infinity are written as such


# ---- the shard files ---------------------------------------------------------------------------------


@st.composite
def file_mutation(draw: Any, index: Any) -> tuple:
    f = draw(st.sampled_from(index.files))
    op = draw(
        st.sampled_from(
            [
                "flip_header",
                "flip_data",
                "flip_data",
                "truncate",
                "append",
                "symlink_out",
                "symlink_sibling",
                "symlink_devzero",
                "fifo",
                "directory",
                "delete",
                "empty",
            ]
        )
    )
    where = {
        "flip_header": st.integers(0, f.data_start - 1),
        "flip_data": st.integers(f.data_start, f.nbytes - 1),
        "truncate": st.integers(0, f.nbytes - 1),
    }.get(op, st.just(0))
    return f.name, op, draw(where), draw(st.integers(0, 7))


def damage_file(d: Path, outside: Path, mutation: tuple) -> None:
    name, op, at, bit = mutation
    p = d / name
    if op.startswith("flip"):
        raw = bytearray(p.read_bytes())
        if at >= len(raw):  # an earlier mutation truncated the file
            return
        raw[at] ^= 1 << bit
        p.write_bytes(bytes(raw))
        return
    if op == "truncate":
        with open(p, "r+b") as fh:
            fh.truncate(at)
        return
    if op == "append":
        with open(p, "ab") as fh:
            fh.write(b"\x00" * (bit + 1))
        return
    raw = p.read_bytes()
    p.unlink()
    if op == "symlink_out":
        outside.write_bytes(raw)  # the same bytes, outside the directory: still refused
        os.symlink(outside, p)
    elif op == "symlink_sibling":
        sib = d / "copy.bin"
        sib.write_bytes(raw)
        os.symlink(sib.name, p)
    elif op == "symlink_devzero":
        os.symlink("/dev/zero", p)
    elif op == "fifo":
        os.mkfifo(p)
    elif op == "directory":
        p.mkdir()
    elif op == "empty":
        p.write_bytes(b"")


# ---- the property --------------------------------------------------------------------------------


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang(f"an example ran longer than {EXAMPLE_TIMEOUT_S} s")


def inspect_cli(d: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["checkpoint", "inspect", str(d)])
    text = out.getvalue() + err.getvalue()
    assert rc in (0, 1, 2), (rc, text)
    assert all(ch.isprintable() or ch == "\n" for ch in text), (
        f"a control character reached the terminal: {text!r}"
    )
    if rc == 2:
        assert err.getvalue().count("\n") == 1, err.getvalue()
    return rc, text


def generic_load(d: Path) -> tuple[bool, Any]:
    try:
        return True, read_full_state(d)
    except ZeroSimError as e:
        assert "\n" not in str(e), str(e)
        return False, str(e)


def engine_load(d: Path) -> tuple[bool, str]:
    try:
        load_and_snapshot(cfg(1), d)
    except RankFailed as e:
        raise AssertionError(f"the engine load raised a non-project error: {e}") from e
    except ZeroSimError as e:
        assert "\n" not in str(e), str(e)
        return False, str(e)
    return True, ""


def same_model(index: Any, original: Any) -> bool:
    """The mutated index still describes the model, optimizer and state dtype the engine load runs."""

    def key(ix: Any) -> tuple:
        return (
            [(t.name, t.shape, t.dtype) for t in ix.layout.tensors],
            ix.optimizer,
            ix.states,
            ix.state_dtype,
        )

    return key(index) == key(original)


def check_example(base: Any, mutate: Any) -> str:
    src, _, want, original_index = base
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ck"
        shutil.copytree(src, d)
        mutate(d, Path(tmp) / "outside.bin")
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(EXAMPLE_TIMEOUT_S)
        try:
            rc, text = inspect_cli(d)
            ok, got = generic_load(d)
            assert (rc == 0) == ok, (
                f"inspect exit {rc} but the load {'accepted' if ok else 'refused'}: {text} / {got}"
            )
            index = got[0] if ok else None
            if index is None or same_model(index, original_index):
                eng_ok, why = engine_load(d)
                assert eng_ok == ok, f"inspect exit {rc}, engine load {'accepted' if eng_ok else why}"
            if not ok:
                return "refused"
            states = got[1]
            assert set(states) == set(want) and all(np.array_equal(states[s], want[s]) for s in want)
            out = Path(tmp) / "resharded"
            reshard(d, 3, "zero2", None, out)
            assert inspect_cli(out)[0] == 0
            again = read_full_state(out)[1]
            assert all(np.array_equal(again[s], want[s]) for s in want)
            return "accepted"
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


TALLY: dict[str, int] = {}


@pytest.fixture(scope="module", autouse=True)
def report_tally():
    yield
    where = os.environ.get("ZEROSIM_FUZZ_TALLY")  # a file the counts are appended to (a run by hand)
    if TALLY and where:
        with open(where, "a") as fh:
            fh.write(json.dumps(TALLY) + "\n")


@settings(settings.get_profile("checkpoint-fuzz"))
@given(data=st.data())
def test_inspect_and_load_agree_on_every_mutated_index(base, data):
    mutation = data.draw(index_mutation(base[1]))
    verdict = check_example(base, lambda d, _: write_index(d, mutation))
    TALLY[f"index {verdict}"] = TALLY.get(f"index {verdict}", 0) + 1


@settings(settings.get_profile("checkpoint-fuzz"))
@given(data=st.data())
def test_inspect_and_load_agree_on_every_damaged_shard_file(base, data):
    mutations = data.draw(st.lists(file_mutation(base[3]), min_size=1, max_size=2))

    def mutate(d: Path, outside: Path) -> None:
        for m in mutations:
            if os.path.lexists(d / m[0]) and (d / m[0]).is_file() and not (d / m[0]).is_symlink():
                damage_file(d, outside, m)

    verdict = check_example(base, mutate)
    TALLY[f"file {verdict}"] = TALLY.get(f"file {verdict}", 0) + 1


def test_the_fuzzer_sees_an_accepted_and_a_refused_checkpoint(base):
    """The property is not vacuous: the untouched checkpoint is accepted and round-trips, a flipped
    data bit is refused by both."""
    assert check_example(base, lambda d, _: None) == "accepted"
    name = base[3].files[0].name
    f = base[3].files[0]
    assert (
        check_example(base, lambda d, o: damage_file(d, o, (name, "flip_data", f.data_start + 3, 2)))
        == "refused"
    )
    assert check_example(base, lambda d, _: write_index(d, ("json", {**base[1], "step": 7}))) == "accepted"
