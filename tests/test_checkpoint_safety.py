"""A checkpoint directory as untrusted input: inspect and load refuse the same files with one line,
only regular files inside the directory are read, a failed reshard removes what it wrote, and
names from a file are escaped before they reach a terminal."""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from zerosim.checkpoint import INDEX_NAME, inspect_checkpoint, read_index, reshard
from zerosim.checkpoint.format import index_size_limit
from zerosim.cli import main
from zerosim.engine.config import RunConfig
from zerosim.errors import EXIT_BAD_INPUT, EXIT_CHECKPOINT_CORRUPT, EXIT_OK, ConfigError, ZeroSimError
from zerosim.testing.checkpoint_runs import load_and_snapshot, train_and_save

ROOT = Path(__file__).resolve().parents[1]


def cfg(world: int = 1) -> RunConfig:
    return RunConfig(strategy="zero3", world_size=world, steps=4, observe="none", timeout_s=30)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved") / "ck"
    train_and_save(cfg(2), 2, d, block_bytes=4096)
    return d


@pytest.fixture
def ck(saved, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(saved, d)
    return d


def edit_index(d: Path, fn) -> None:
    p = d / INDEX_NAME
    data = json.loads(p.read_text())
    fn(data)
    p.write_text(json.dumps(data))


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def load_verdict(d: Path) -> str | None:
    """None when an engine at world size 1 loads ``d``; else the one-line ZeroSimError it raised."""
    try:
        load_and_snapshot(cfg(1), d)
    except ZeroSimError as e:
        cause = getattr(e, "error", e)
        assert isinstance(cause, ZeroSimError), f"load raised {type(cause).__name__}: {cause}"
        assert "\n" not in str(e)
        return str(e)
    return None


def first_shard(d: Path) -> Path:
    return d / read_index(d).files[0].name


# ---- inspect validates what load validates ------------------------------------------------------


def _huge_entry(x):
    f = x["files"][0]
    f["ranges"][-1][1] = 10**18
    f["entries"][0][2] = 10**18


CORRUPTIONS = {
    "entry of 10**18 elements": lambda d: edit_index(d, _huge_entry),
    "tensor of 10**18 elements": lambda d: edit_index(
        d, lambda x: x["layout"]["tensors"][-1].__setitem__("shape", [10**18])
    ),
    "negative entry offset": lambda d: edit_index(
        d, lambda x: x["files"][0]["entries"][0].__setitem__(3, -4096)
    ),
    "negative data start": lambda d: edit_index(d, lambda x: x["files"][0].__setitem__("data_start", -8)),
    "float size": lambda d: edit_index(d, lambda x: x["files"][0].__setitem__("bytes", 1.5)),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_an_index_that_describes_impossible_geometry_is_refused_by_inspect_and_load(ck, name):
    CORRUPTIONS[name](ck)
    rc, _, err = cli("checkpoint", "inspect", str(ck))
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and "index.json" in err, err
    why = load_verdict(ck)
    assert why is not None and "index.json" in why


def test_a_bit_flip_in_a_safetensors_header_is_refused_by_inspect_and_load(ck):
    p = first_shard(ck)
    raw = bytearray(p.read_bytes())
    raw[20] ^= 0x01  # inside the JSON header, before any data
    p.write_bytes(bytes(raw))
    rc, _, err = cli("checkpoint", "inspect", str(ck))
    assert rc == EXIT_CHECKPOINT_CORRUPT and p.name in err and "header" in err
    why = load_verdict(ck)
    assert why is not None and p.name in why and "header" in why


def test_an_intact_checkpoint_is_accepted_by_both(ck):
    assert cli("checkpoint", "inspect", str(ck))[0] == EXIT_OK
    assert load_verdict(ck) is None


# ---- only regular files inside the directory --------------------------------------------------------


def test_an_index_that_is_a_fifo_or_a_link_to_dev_zero_is_refused_at_once(ck):
    (ck / INDEX_NAME).unlink()
    os.mkfifo(ck / INDEX_NAME)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="FIFO"):
        inspect_checkpoint(ck)
    assert load_verdict(ck) is not None
    (ck / INDEX_NAME).unlink()
    os.symlink("/dev/zero", ck / INDEX_NAME)
    with pytest.raises(ConfigError, match="symbolic link"):
        inspect_checkpoint(ck)
    assert "symbolic link" in (load_verdict(ck) or "")
    assert time.monotonic() - t0 < 20  # neither blocks nor reads the device


def test_a_shard_linked_outside_the_directory_is_refused_without_reading_it(ck, tmp_path):
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(b"x" * 12345)
    p = first_shard(ck)
    p.unlink()
    os.symlink(target, p)
    rc, out, err = cli("checkpoint", "inspect", str(ck))
    assert rc == EXIT_CHECKPOINT_CORRUPT and "symbolic link" in err and "12345" not in err + out
    why = load_verdict(ck)
    assert why is not None and "symbolic link" in why and "12345" not in why


def test_a_directory_in_place_of_a_shard_is_refused(ck):
    p = first_shard(ck)
    p.unlink()
    p.mkdir()
    assert "directory" in cli("checkpoint", "inspect", str(ck))[2]
    assert "directory" in (load_verdict(ck) or "")


def test_an_oversized_index_is_refused_before_it_is_parsed(ck):
    limit = index_size_limit(ck)
    shard_bytes = sum(f.nbytes for f in read_index(ck).files)
    assert limit == (64 << 20) + 1024 * len(read_index(ck).files) + 2 * shard_bytes
    with open(ck / INDEX_NAME, "ab") as fh:
        fh.truncate(limit + 1)  # sparse: no disk used
    with pytest.raises(ConfigError, match="more than the"):
        read_index(ck)


# ---- one line and exit 2 for bad input --------------------------------------------------------------


@pytest.mark.parametrize(
    "content, needle",
    [
        (b'{"format": "\xff\xfe"}', "not UTF-8"),
        (b"[" * 200_000 + b"]" * 200_000, "levels deep"),
        (b'{"format": NaN}', "not valid JSON"),
        (b'{"version": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b'{"format": 1, "format": 2}', "appears twice"),
    ],
    ids=["non-utf8", "200k-deep", "nan", "5000-digit-int", "duplicate-key"],
)
def test_an_unparsable_index_is_one_line_and_exit_2(ck, content, needle):
    (ck / INDEX_NAME).write_bytes(content)
    rc, _, err = cli("checkpoint", "inspect", str(ck))
    assert rc == EXIT_BAD_INPUT and err.count("\n") == 1 and needle in err, err
    assert needle in (load_verdict(ck) or "")


def test_a_nul_or_a_separator_in_a_file_name_is_refused_naming_the_field(ck):
    for bad in ("a\x00b.safetensors", "../x.safetensors"):
        edit_index(ck, lambda x, bad=bad: x["files"][0].__setitem__("name", bad))
        rc, _, err = cli("checkpoint", "inspect", str(ck))
        assert rc == EXIT_BAD_INPUT and "files[0].name" in err and err.count("\n") == 1


def _fsize_limit():  # runs in the child before exec: the kernel refuses writes past 20 kB
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))


def test_a_reshard_into_a_full_destination_is_one_line_exit_2_and_leaves_nothing(saved, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerosim",
            "checkpoint",
            "reshard",
            str(saved),
            str(out),
            "--world-size",
            "1",
            "--strategy",
            "zero1",
        ],
        capture_output=True,
        text=True,
        preexec_fn=_fsize_limit,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == EXIT_BAD_INPUT, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and "File too large" in r.stderr
    assert not out.exists()  # the directory was this run's: removed with the files


def test_a_failed_reshard_removes_only_what_it_created(saved, ck, tmp_path):
    """An empty OUT the user made stays (empty); every file the failed run wrote is gone."""
    out = tmp_path / "out"
    out.mkdir()
    f = read_index(ck).files[-1]
    raw = bytearray((ck / f.name).read_bytes())
    raw[-1] ^= 0xFF  # the last data block of the last file: found after other files were written
    (ck / f.name).write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="checksum mismatch"):
        reshard(ck, 3, "zero3", None, out, chunk_elems=500)
    assert out.is_dir() and os.listdir(out) == []


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("held", ["checkpoint", "notes.txt", ".tmp-1-someone-elses", "subfolder"])
def test_a_reshard_into_a_folder_holding_anything_is_refused_before_writing(saved, tmp_path, held):
    """Another checkpoint (its index would have been replaced), a user's file, an interrupted write's
    temporary or a folder: one line naming OUT and an entry, exit 2, OUT byte for byte as it was."""
    out = tmp_path / "out"
    if held == "checkpoint":
        reshard(saved, 2, "zero1", None, out)
    else:
        out.mkdir()
        (out / held).mkdir() if held == "subfolder" else (out / held).write_text("not this run's")
    before, names = _tree(out), sorted(os.listdir(out))
    rc, stdout, err = cli(
        "checkpoint", "reshard", str(saved), str(out), "--world-size", "3", "--strategy", "zero3"
    )
    assert rc == EXIT_BAD_INPUT and stdout == "" and err.count("\n") == 1, err
    assert err.startswith(f"error: invalid out={str(out)!r}: is not empty (it holds ")
    assert any(repr(n) in err for n in names)
    assert sorted(os.listdir(out)) == names and _tree(out) == before
    if held == "checkpoint":
        assert inspect_checkpoint(out).ok and read_index(out).world_size == 2


# ---- names from a file are escaped --------------------------------------------------------------


def test_escape_sequences_in_names_are_printed_as_escapes(ck):
    evil = "\x1b[2J\x1b[HALL CHECKS PASSED\x1b[8m\u202e"
    edit_index(ck, lambda x: x["layout"]["tensors"][0].__setitem__("name", evil))
    rc, out, _ = cli("checkpoint", "inspect", str(ck))
    assert rc == EXIT_OK
    assert "\x1b" not in out and "\u202e" not in out
    assert "\\x1b[2J\\x1b[HALL CHECKS PASSED\\x1b[8m\\u202e" in out
    assert all(ch.isprintable() or ch == "\n" for ch in out)


# ---- leftovers of a killed reshard ---------------------------------------------------------------


def test_a_killed_reshard_leaves_temporaries_that_the_next_reshard_refuses_to_write_next_to(saved, tmp_path):
    out = tmp_path / "out"
    code = (
        "import time, zerosim.checkpoint.format as fm\n"
        "real = fm.CheckpointReader.iter_chunks\n"
        "def slow(self, *a, **k):\n"
        "    for c in real(self, *a, **k):\n"
        "        time.sleep(0.05)\n"
        "        yield c\n"
        "fm.CheckpointReader.iter_chunks = slow\n"
        "from zerosim.checkpoint import reshard\n"
        f"reshard({str(saved)!r}, 2, 'zero3', None, {str(out)!r}, chunk_elems=200)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if out.exists() and any(n.startswith(".tmp-") for n in os.listdir(out)):
                break
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    left = sorted(os.listdir(out))
    assert any(n.startswith(".tmp-") for n in left), left
    rc, _, err = cli(
        "checkpoint", "reshard", str(saved), str(out), "--world-size", "1", "--strategy", "zero1"
    )
    assert rc == EXIT_BAD_INPUT and "is not empty" in err and err.count("\n") == 1
    assert sorted(os.listdir(out)) == left  # nothing written, nothing deleted
