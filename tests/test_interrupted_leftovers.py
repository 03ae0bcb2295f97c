"""A command that does not finish removes what it made for itself: the output folders it created and
left empty (:func:`zerosim.files.outputs.remove_unused_output_dirs`), and, when interrupted while it runs
ranks, every temporary folder and log of its launches (``zerogpu-status-*``, ``zerosim-ranks-*.log``,
``zerogpu-fork-*``); never a folder that existed before it, nor one that holds anything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zerosim.files import outputs

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 300.0  # the interrupted command ends in seconds; reaching this is the failure


def test_only_empty_folders_this_process_made_are_removed(tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    outputs.output_dir(existing, "x")  # existed: never removed, even empty
    made_nested = outputs.output_dir(tmp_path / "a" / "b" / "c", "x")
    used = outputs.output_dir(tmp_path / "used", "x")
    (used / "report.json").write_text("{}")
    removed = outputs.remove_unused_output_dirs()
    assert sorted(removed) == sorted([made_nested, made_nested.parent, made_nested.parent.parent])
    assert existing.is_dir() and (used / "report.json").exists()
    assert outputs.remove_unused_output_dirs() == []  # forgotten once handled


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked ranks and a fork server: Linux")
def test_sigint_of_mutants_on_torch_leaves_nothing_in_tmpdir_and_no_out_folder(tmp_path: Path) -> None:
    """SIGINT once the launched run's ranks started: exit 130, TMPDIR as empty as before, and the
    --out folder this command made is gone."""
    pytest.importorskip("torch")
    tmpdir, out = tmp_path / "tmp", tmp_path / "new-out"
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("ZEROGPU_FORK_SERVER", None)  # the command starts its own server, in this TMPDIR
    cmd = [sys.executable, "-m", "zerosim", "mutants", "--backend", "torch", "--only", "sum-instead-of-avg",
           "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + GUARD_S
        while not list(tmpdir.glob("zerosim-ranks-*.log")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        assert out.is_dir() and list(tmpdir.glob("zerogpu-status-*")), sorted(os.listdir(tmpdir))
        time.sleep(1.0)  # the ranks are starting
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert sorted(os.listdir(tmpdir)) == [], "left in TMPDIR"
    assert not out.exists(), "the --out folder the command made stayed, empty"


def test_an_out_folder_verify_or_report_made_is_taken_back_when_left_empty(tmp_path: Path) -> None:
    """verify and report check their --out with require_output_dir, which notes what it made: an
    interrupted run takes back the folder it created, never one the user had."""
    had = tmp_path / "had"
    had.mkdir()
    assert outputs.require_output_dir(had) == had
    made = outputs.require_output_dir(tmp_path / "new" / "out")
    assert made.is_dir()
    assert sorted(outputs.remove_unused_output_dirs()) == sorted([made, made.parent])
    assert had.is_dir()
