"""Bad input to ``zerosim verify``: exit 2 (or 3 for a failing rank), one clear line, no traceback, no hang.

Each test runs the real command line (``python -m zerosim verify TARGET ...``) in a subprocess with a
wall-clock guard, from the repository root so that ``tests.verify_trainers.bad`` is importable on
every rank. The bad trainers are in ``tests/verify_trainers/bad.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.verify_trainers import bad  # noqa: E402
from zerosim.verify.model import build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 300.0  # the subprocess guard: far above any run here; reaching it is itself the failure (a hang)
# the collective timeout given to the hang test: well above the skew between the two ranks' start-ups
# (started at one instant, each importing torch) and any healthy call of the tiny trainer
HANG_TIMEOUT_S = 8
BAD = "tests.verify_trainers.bad"
FIRST_PARAMETER = next(name for name, _ in build_model("gpt").named_parameters())


def run_verify(*args: str) -> subprocess.CompletedProcess:
    """``python -m zerosim verify *args``; a run that outlives :data:`GUARD_S` is interrupted (SIGINT: the
    launcher then takes its ranks down) and fails the test as a hang."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "zerosim", "verify", *args]
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        pytest.fail(f"zerosim verify {' '.join(args)} still running after {GUARD_S:g}s: a hang")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def error_line(result: subprocess.CompletedProcess, code: int) -> str:
    """The one line the command printed on stderr, after checking the exit status and that nothing else
    (no traceback, no second line) came out."""
    both = result.stdout + result.stderr
    assert result.returncode == code, f"exit {result.returncode}, expected {code}:\n{both}"
    assert "Traceback" not in both, both
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{result.stderr}"
    return lines[0]


# ---- resolving TARGET: the ranks agree on the error before any trains ----------------------------------


def test_module_not_found() -> None:
    line = error_line(run_verify("no_such_package_for_zerosim.trainer:make_trainer", "--world", "2"), 2)
    assert "no_such_package_for_zerosim.trainer" in line and "not found" in line, line


def test_factory_not_found() -> None:
    line = error_line(run_verify(f"{BAD}:no_such_factory", "--world", "2"), 2)
    assert "no_such_factory" in line, line


def test_factory_not_callable() -> None:
    line = error_line(run_verify(f"{BAD}:NOT_CALLABLE", "--world", "2"), 2)
    assert "NOT_CALLABLE" in line and "not callable" in line, line


def test_module_whose_own_import_fails_names_the_missing_dependency() -> None:
    target = "tests.verify_trainers.needs_missing_dependency:make_trainer"
    line = error_line(run_verify(target, "--world", "2"), 2)
    assert "tests.verify_trainers.needs" in line and "importing" in line, line
    assert "module 'tests.verify_trainers.needs_missing_dependency' not found" not in line, line


def test_out_that_is_a_file_is_refused_before_any_rank_starts(tmp_path: Path) -> None:
    target = tmp_path / "report-here"
    target.write_text("keep me")
    line = error_line(run_verify("examples.zero1_trainer:make_trainer", "--out", str(target)), 2)
    assert "out" in line and str(target) in line and "not a directory" in line, line
    assert target.read_text() == "keep me"


@pytest.mark.parametrize(
    ("args", "field"),
    [(["--dtype", "float16"], "dtype"), (["--timeout", "0"], "timeout"), (["ddp"], "target"),
     (["--world", "3"], "world"), (["--model", "gpt-tied"], "model"), (["--mesh", "4x1"], "mesh")],
)
def test_all_refuses_an_option_it_cannot_honour_before_the_first_cell(
    args: list[str], field: str, tmp_path: Path
) -> None:
    line = error_line(run_verify("--all", "--out", str(tmp_path / "matrix"), *args), 2)
    assert f"invalid {field}=" in line, line
    assert not (tmp_path / "matrix" / "verify-matrix.json").exists()


@pytest.mark.torchdist
def test_bad_target_under_torchrun_is_exit_2_on_every_rank() -> None:
    """Started by an external launcher, each rank resolves TARGET itself; all agree and exit 2."""
    from zerogpu.launch import run_ranks

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    result = run_ranks(2, ["-m", "zerosim.verify", f"{BAD}:no_such_factory"], GUARD_S, env=env)
    assert result.returncode == 2, (result.stdout or "") + (result.stderr or "")
    assert "no_such_factory" in (result.stderr or ""), result.stderr
    assert "Traceback" not in (result.stdout or "") + (result.stderr or "")


@pytest.mark.torchdist
def test_bad_target_under_an_external_torchrun_is_exit_2_on_every_rank() -> None:
    """The documented external path (``torchrun ... -m zerosim.verify TARGET``): the ranks run under
    a real torchrun unchanged; rank 0 says why once and every rank exits 2, which torchrun lists."""
    from zerosim.processes.launching import run_process_group

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "zerosim.verify", f"{BAD}:no_such_factory"]
    run = run_process_group(command, GUARD_S, env)
    text = (run.stdout or "") + (run.stderr or "")
    assert run.returncode == 1, text  # torchrun's own status for failed workers
    errors = [ln for ln in text.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "no_such_factory" in errors[0], text
    # the one traceback is torchrun's own (ChildFailedError), none a rank's
    assert text.count("Traceback (most recent call last)") == 1 and "ChildFailedError" in text, text
    for rank in (0, 1):
        assert f"rank      : {rank} (local_rank: {rank})\n  exitcode  : 2" in text, text


def test_world_larger_than_the_machine_can_start() -> None:
    world = str(64 * (os.cpu_count() or 1))
    line = error_line(run_verify("examples.zero1_trainer:make_trainer", "--world", world), 2)
    assert "world" in line and world in line, line


# ---- the factory or the trainer breaks the protocol: every rank agrees, exit 2 ---------------------------

PROTOCOL_BREACHES = [
    ("raises_on_construction", ["cannot shard a model with 0 parameters"]),
    ("without_step", ["step"]),
    ("without_full_parameters", ["full_parameters"]),
    ("missing_name", ["full_parameters", FIRST_PARAMETER]),
    ("extra_name", ["full_parameters", "module.extra_bias"]),
    ("wrong_shape", ["full_parameters", FIRST_PARAMETER, "shape"]),
    ("wrong_dtype", ["full_parameters", FIRST_PARAMETER, "float16"]),
    ("shards_out_of_bounds", ["local_shards", FIRST_PARAMETER]),
    ("shards_not_integers", ["local_shards", FIRST_PARAMETER]),
]


@pytest.mark.torchdist
@pytest.mark.slow
@pytest.mark.parametrize(("factory", "words"), PROTOCOL_BREACHES, ids=[f for f, _ in PROTOCOL_BREACHES])
def test_protocol_breach_is_one_line_exit_2(factory: str, words: list[str]) -> None:
    line = error_line(run_verify(f"{BAD}:{factory}", "--world", "2", "--steps", "4"), 2)
    missing = [w for w in words if w.lower() not in line.lower()]
    assert not missing, f"the line should name {missing}: {line}"


# ---- a rank fails or hangs mid-run: exit 3 naming the rank -------------------------------------------------


@pytest.mark.torchdist
@pytest.mark.slow
def test_rank_raising_mid_run_is_named_with_its_error() -> None:
    line = error_line(run_verify(f"{BAD}:rank_raises_mid_run", "--world", "2", "--steps", "4"), 3)
    assert f"rank {bad.MISBEHAVING_RANK}" in line and bad.RAISED_MESSAGE in line, line


@pytest.mark.torchdist
@pytest.mark.slow
def test_rank_hanging_is_named_after_the_timeout() -> None:
    """Rank 1 sleeps far past the collective timeout; its peer waits in the all-gather. The run must end
    (within the guard, long before the sleep would) with exit 3 naming rank 1."""
    result = run_verify(f"{BAD}:rank_hangs", "--world", "2", "--steps", "4", "--timeout", str(HANG_TIMEOUT_S))
    line = error_line(result, 3)
    assert f"rank {bad.MISBEHAVING_RANK}" in line, line


# ---- the mesh and the world size: refused before any rank starts --------------------------------------


@pytest.mark.parametrize(
    "args, needles",
    [
        (["fsdp2-hybrid", "--world", "2", "--mesh", "3x1"], ["mesh='3x1'", "3 x 1 = 3 ranks", "has 2"]),
        (["fsdp2-hybrid", "--world", "2", "--mesh", "2by1"], ["mesh='2by1'", "RxS"]),
        (["fsdp2-hybrid", "--world", "2", "--mesh", "0x2"], ["mesh='0x2'", "at least 1"]),
        (["ddp", "--world", "2", "--mesh", "2x1"], ["mesh='2x1'", "fixed layout"]),
        (["fsdp2-hybrid", "--world", "2", "--mesh", "2x1", "--resume-at", "1"],
         ["mesh='2x1'", "--resume-at"]),
        (["ddp", "--world", "1"], ["world=1", "one rank cannot show a sharding bug", "--allow-world-1"]),
        (["ddp", "--world-size", "1"], ["world=1", "one rank cannot show a sharding bug"]),
    ],
    ids=["mesh-not-the-world", "mesh-malformed", "mesh-zero", "mesh-fixed-layout", "mesh-with-resume",
         "world-1", "world-size-1"],
)
def test_mesh_and_world_one_refused_in_one_line(args: list[str], needles: list[str], capsys) -> None:
    """In process (the refusal comes before any rank starts): exit 2, one line on stderr, nothing else."""
    from zerosim.cli import main

    code = main(["verify", *args])
    out, err = capsys.readouterr()
    line = error_line(subprocess.CompletedProcess(args, code, out, err), 2)
    for needle in needles:
        assert needle in line, f"{needle!r} missing from: {line}"
