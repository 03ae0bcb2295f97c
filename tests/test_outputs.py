"""Where commands write: a fresh folder (or the path given), never over tracked files; a write that fails
ends in one line naming the path and the OS error with exit status 2, nothing half-written left;
stdout on /dev/full or closed by its reader ends as a shell tool ends."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zerosim.cli import main
from zerosim.errors import EXIT_BAD_INPUT, EXIT_BROKEN_PIPE
from zerosim.files import outputs
from zerosim.files.outputs import OutputError

ROOT = Path(__file__).resolve().parents[1]


def _zerosim(*args: str, cwd: Path | None = None, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "zerosim", *args], capture_output="stdout" not in kw,
                          text=True, timeout=timeout, cwd=cwd, env=env, **kw)


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# ---- writing a file --------------------------------------------------------------------------------


def test_a_write_that_fails_leaves_the_old_file_and_no_partial_one(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "report.json"
    target.write_text("the old report")

    class FullDisk:
        def __init__(self, real):
            self.real = real

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.real.close()

        def write(self, data):
            self.real.write(data[:3])  # part of it lands, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")

    real_fdopen = os.fdopen
    monkeypatch.setattr(outputs.os, "fdopen", lambda fd, mode: FullDisk(real_fdopen(fd, mode)))
    with pytest.raises(OutputError, match=r"cannot write .*report.json: No space left on device"):
        outputs.write_text(target, "the new report")
    assert target.read_text() == "the old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_device_or_folder_in_the_way_is_refused_not_replaced(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="/dev/full: exists and is not a regular file"):
        outputs.write_text("/dev/full", "x")
    (tmp_path / "sub").mkdir()
    with pytest.raises(OutputError, match="exists and is not a regular file"):
        outputs.write_text(tmp_path / "sub", "x")
    assert Path("/dev/full").is_char_device()


def test_a_fresh_run_folder_is_never_one_that_exists(tmp_path: Path) -> None:
    import datetime

    now = datetime.datetime(2026, 1, 2, 3, 4, 5)
    first = outputs.fresh_run_dir("mutants", tmp_path, now)
    (first / "mine.txt").write_text("a user's file")
    second = outputs.fresh_run_dir("mutants", tmp_path, now)
    assert (first.name, second.name) == ("mutants-20260102-030405", "mutants-20260102-030405-2")
    assert list(second.iterdir()) == [] and (first / "mine.txt").read_text() == "a user's file"


# ---- the command line's one handler ----------------------------------------------------------------


def test_stdout_on_dev_full_is_one_line_and_exit_2() -> None:
    with open("/dev/full", "w") as full:
        run = _zerosim("plan", stdout=full, stderr=subprocess.PIPE, timeout=120)
    assert run.returncode == EXIT_BAD_INPUT
    assert _one_line(run.stderr) == "error: cannot write to standard output: No space left on device"


def test_mutants_out_dev_full_is_one_line_and_exit_2_before_anything_runs() -> None:
    run = _zerosim("mutants", "--out", "/dev/full", timeout=120)
    assert run.returncode == EXIT_BAD_INPUT
    assert _one_line(run.stderr) == "error: cannot write /dev/full: exists and is not a directory"


def test_a_file_where_a_folder_belongs_is_named(tmp_path: Path, capsys) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a user's file")
    code = main(["mutants", "--only", "stale-params", "--out", str(blocker / "sub")])
    assert code == EXIT_BAD_INPUT
    line = _one_line(capsys.readouterr().err)
    assert line == f"error: cannot write {blocker}: exists and is not a directory", line
    assert blocker.read_text() == "a user's file"
    with pytest.raises(OutputError, match=f"cannot write {blocker}: exists and is not a directory"):
        outputs.output_file(blocker / "deeper" / "bench_sim.json", "bench-sim", "bench_sim.json")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/report.json"),
         "error: /mnt/ro/report.json: Read-only file system"),
        (OSError(errno.EACCES, "Permission denied", "/root/x"), "error: /root/x: Permission denied"),
        (OSError(errno.ENOSPC, "No space left on device"), "error: No space left on device"),
    ],
)
def test_any_os_error_a_command_meets_is_one_line_and_exit_2(monkeypatch, capsys, error, expected) -> None:
    import zerosim.cli.plan as plan_cli

    def failing(args):
        raise error

    monkeypatch.setattr(plan_cli, "run", failing)
    assert main(["plan"]) == EXIT_BAD_INPUT
    assert _one_line(capsys.readouterr().err) == expected


@pytest.mark.parametrize("argv", [["--all-ranks"], ["--json", "--intervals"]], ids=["table", "json"])
def test_a_reader_that_leaves_early_ends_the_command_quietly_with_141(argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "zerosim", "plan", "--world-size", "1024", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == EXIT_BROKEN_PIPE
    assert err == ""


# ---- run as the README shows, in a clone: tracked files stay as they are ---------------------------


def clone_like(tmp_path: Path) -> Path:
    """A git repository holding this one's .gitignore and the committed files of reports/ (only those:
    the checkout may also hold ignored report folders that earlier commands wrote)."""
    clone = tmp_path / "clone"
    clone.mkdir()
    shutil.copy(ROOT / ".gitignore", clone / ".gitignore")
    listed = subprocess.run(["git", "ls-files", "-z", "reports"], cwd=ROOT, capture_output=True, check=True)
    for relative in filter(None, listed.stdout.decode().split("\0")):
        target = clone / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=clone, check=True)
    subprocess.run([*git, "add", "-A"], cwd=clone, check=True)
    subprocess.run([*git, "commit", "-qm", "reports"], cwd=clone, check=True)
    return clone


def tracked_hashes(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and ".git" not in p.parts}


@pytest.mark.parametrize(
    ("argv", "written"),
    [
        (["mutants", "--only", "stale-params,shard-off-by-one"], "mutants-*/mutants.md"),
        (["bench", "check", "--total", "10**6", "--world-size", "8", "--repeats", "1",
          "--flag-sizes", "10**3"], "bench-check-*/bench_check.json"),
        (["bench", "sim", "--model", "tiny", "--world-sizes", "2", "--repeats", "1"],
         "bench-sim-*/bench_sim.json"),
    ],
)
def test_a_command_run_with_its_defaults_never_changes_a_tracked_file(tmp_path: Path, argv, written) -> None:
    clone = clone_like(tmp_path)
    before = tracked_hashes(clone)
    run = _zerosim(*argv, cwd=clone)
    assert run.returncode in (0, 1), run.stderr
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True)
    assert status.stdout == "", status.stdout  # nothing tracked changed; the new folder is ignored
    after = tracked_hashes(clone)
    assert {k: v for k, v in after.items() if k in before} == before
    new = sorted(clone.glob(f"reports/{written}"))
    assert len(new) == 1 and set(after) - set(before) >= {str(new[0].relative_to(clone))}, sorted(after)
