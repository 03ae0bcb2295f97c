"""``zerosim verify TARGET --resume-at K --resume-world M``: save, a second launch at another world size,
load, continue; C-ZERO-007 judged on the round trip (bitwise) and the continued steps (derived bound).

The live runs use one optimizer phase of a few steps to stay short; the bad-input cases run the real
command line and expect exit 2 with one line naming the field.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.test_verify_bad_input import error_line, run_verify  # noqa: E402
from zerosim.checks.checkpoint import ResumedTrainer, check_checkpoint_equivalence  # noqa: E402
from zerosim.verify.observation import StepObservation  # noqa: E402
from zerosim.verify.protocol import STATE_NAMES  # noqa: E402
from zerosim.verify.reference import Reference  # noqa: E402
from zerosim.verify.resume import SNAPSHOT_FILE, read_first_run  # noqa: E402
from zerosim.verify.suite import build_phases  # noqa: E402

TIMEOUT_S = 120.0


def _resume(target: str, world: int, resume_world: int, *, optimizer: str, steps: int, at: int,
            out: Path | None = None):
    from zerosim.verify import verify

    return verify(target, world=world, steps=steps, optimizers=(optimizer,), timeout_s=TIMEOUT_S,
                  resume_at=at, resume_world=resume_world, out=None if out is None else str(out))


class _RunsCode:
    """Unpickling this writes ``marker``: what a replaced inter-launch pickle could have done."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "a pickle from the run folder ran"))


def _users_out_folder(tmp_path: Path) -> tuple[Path, dict[Path, bytes]]:
    """An --out folder already holding a user's files at every path a resumed run used to touch,
    among them a pickle under the name the first launch's snapshot once had."""
    out = tmp_path / "D"
    (out / "resume" / "mydata").mkdir(parents=True)
    files = {
        out / "resume" / "mydata" / "notes.txt": b"my notes",
        out / "failure-rank-notes.txt": b"my failure notes",
        out / "resume" / "first-run.pkl": pickle.dumps(_RunsCode(tmp_path / "ran")),
        out / "resume" / SNAPSHOT_FILE: pickle.dumps(_RunsCode(tmp_path / "ran")),
    }
    for path, data in files.items():
        path.write_bytes(data)
    return out, files


# ---- pure parts ------------------------------------------------------------------------------------


def test_reference_takes_the_new_worlds_batches_after_the_resume() -> None:
    from zerosim.verify.model import build_model

    ref = Reference(build_model(), {"name": "sgd", "lr": 0.1}, 2, resume=(3, 5))
    assert [len(ref.batches(s)) for s in (1, 3, 4, 9)] == [2, 2, 5, 5]


def test_round_trip_names_a_lost_state_and_a_changed_element() -> None:
    params = {"w": np.arange(6.0).reshape(2, 3)}
    state = {"w": {"exp_avg": np.ones((2, 3)), "exp_avg_sq": np.ones((2, 3)), "step": np.array(2.0)}}
    saved = StepObservation("adamw", 2, 0, 0.0, params, state)
    changed = {"w": params["w"].copy()}
    changed["w"][1, 1] = np.nextafter(changed["w"][1, 1], 10.0)  # one ulp: bitwise, not within a bound
    loaded = [
        StepObservation("adamw", 2, 0, 0.0, dict(params), {"w": {**state["w"], "step": np.array(0.0)}}),
        StepObservation("adamw", 2, 1, 0.0, changed, {"w": {"exp_avg": state["w"]["exp_avg"]}}),
    ]
    resumed = ResumedTrainer({"adamw": saved}, {"adamw": loaded}, {"adamw": 2}, STATE_NAMES)
    verdict = check_checkpoint_equivalence([], resumed)
    listed = [v.to_json() for v in verdict.violations]
    found = {(v["rank"], v["tensor"], v["start"], v["stop"]) for v in listed}
    assert found == {(0, "w[step]", 0, 1), (1, "w", 4, 5), (1, "w[exp_avg_sq]", 0, 6), (1, "w[step]", 0, 1)}
    missing = next(v for v in listed if v["tensor"] == "w[exp_avg_sq]")
    assert missing["state"] == "exp_avg_sq" and "missing after load_checkpoint" in missing["message"]


# ---- live runs -------------------------------------------------------------------------------------


@pytest.mark.torchdist
def test_zerogpu_zero3_resumes_from_3_to_2_ranks_leaving_the_users_files_alone(tmp_path: Path) -> None:
    out, users = _users_out_folder(tmp_path)
    report = _resume("zerogpu-3", 3, 2, optimizer="adamw", steps=4, at=2, out=out)
    assert report.verdict == "pass", {k: v.reason for k, v in report.contracts.items()}
    assert {p: p.read_bytes() for p in users} == users  # every file of the user's is there, unchanged
    assert not (tmp_path / "ran").exists()  # and nothing in --out was unpickled
    written = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {
        p.relative_to(out).as_posix() for p in users}
    # the run's own data lived in a private folder: --out gets the report and each rank's own output
    logs = {f"logs/save/rank{r}.log" for r in range(3)} | {f"logs/load/rank{r}.log" for r in range(2)}
    assert written == {"report.json"} | logs, written
    c7 = report.contracts["C-ZERO-007"]
    assert c7.status == "pass"
    assert c7.details["round_trip_violations"] == 0 and c7.details["continued_steps"] == 2
    assert "exp_avg" in c7.details["state_compared"]
    assert report.extra["resume"] == {
        "at_phase_step": 2, "world_before": 3, "world_after": 2, "phases_resumed": ["adamw"]
    }


@pytest.mark.torchdist
def test_fsdp2_resumes_from_2_to_3_ranks_through_dcp() -> None:
    report = _resume("fsdp2", 2, 3, optimizer="sgd", steps=3, at=1)
    assert report.verdict == "pass", {k: v.reason for k, v in report.contracts.items()}
    assert report.contracts["C-ZERO-007"].status == "pass"
    assert report.contracts["C-ZERO-007"].details["continued_steps"] == 2


@pytest.mark.torchdist
def test_a_load_that_drops_the_optimizer_state_fails_c_zero_007_naming_the_tensor() -> None:
    report = _resume("tests.verify_trainers.broken:optimizer_state_dropped_on_load", 2, 3,
                     optimizer="sgd", steps=3, at=1)
    assert report.verdict == "fail"
    c7 = report.contracts["C-ZERO-007"]
    assert c7.status == "fail"
    first = c7.violations[0]
    assert first["clause"] == "round_trip" and first["step"] == 1 and first["state"] == "momentum_buffer"
    assert first["tensor"] == "wte.weight[momentum_buffer]"
    assert "wte.weight[momentum_buffer]" in c7.reason
    assert {v["rank"] for v in c7.violations if v["clause"] == "round_trip"} == {0, 1, 2}
    # the continued steps leave the reference too (C-ZERO-002 fails from the first step after loading)
    assert min(v["step"] for v in report.contracts["C-ZERO-002"].violations) == 2


# ---- what passes between the two launches -----------------------------------------------------------


def test_the_first_launchs_snapshot_round_trips_as_plain_data(tmp_path: Path) -> None:
    from zerosim.files import datafile
    from zerosim.verify.suite import build_phases

    phases = build_phases(("adamw",), 4)
    phases[0].extra["clip_first_binds_at_phase_step"] = 2
    obs = StepObservation("adamw", 1, 0, 0.5, {"w": np.arange(3.0)},
                          {"w": {"exp_avg": np.ones(3), "step": np.array(1.0, np.float32)}},
                          {"w": [(0, 3)]}, {"sent": 12})
    snapshot = {"world": 3, "phases": phases, "phase_info": [{"name": "adamw", "status": "ran"}],
                "observations": {1: [obs]}}
    datafile.save(tmp_path / SNAPSHOT_FILE, snapshot)
    back = read_first_run(tmp_path / SNAPSHOT_FILE)
    assert back["world"] == 3 and back["phases"] == phases and back["phase_info"] == snapshot["phase_info"]
    got = back["observations"][1][0]
    assert got.state["w"]["step"].shape == () and got.state["w"]["step"].dtype == np.float32
    assert got.params["w"].tobytes() == obs.params["w"].tobytes() and got.shards == {"w": [(0, 3)]}


def test_a_pickle_in_place_of_the_snapshot_is_refused_without_running(tmp_path: Path) -> None:
    from zerosim.files.datafile import DataFileError

    (tmp_path / SNAPSHOT_FILE).write_bytes(pickle.dumps({"world": _RunsCode(tmp_path / "ran")}))
    with pytest.raises(DataFileError, match=SNAPSHOT_FILE):
        read_first_run(tmp_path / SNAPSHOT_FILE)
    assert not (tmp_path / "ran").exists()


def test_a_snapshot_of_another_shape_is_refused(tmp_path: Path) -> None:
    from zerosim.files import datafile
    from zerosim.files.datafile import DataFileError

    wrong = {"world": "3", "phases": [], "phase_info": [], "observations": {}}
    datafile.save(tmp_path / SNAPSHOT_FILE, wrong)
    with pytest.raises(DataFileError, match="not what the first launch of a resumed run saves"):
        read_first_run(tmp_path / SNAPSHOT_FILE)


def test_a_saved_run_to_re_evaluate_is_read_as_plain_data_only(tmp_path: Path) -> None:
    from zerosim.files import datafile
    from zerosim.files.datafile import DataFileError
    from zerosim.verify.evaluate import evaluate_saved

    saved = tmp_path / "observations.safetensors"
    saved.write_bytes(pickle.dumps({"model_name": _RunsCode(tmp_path / "ran")}))
    with pytest.raises(DataFileError, match="observations.safetensors"):
        evaluate_saved(str(saved))
    assert not (tmp_path / "ran").exists()
    run = {"model_name": "gpt", "dtype": "float64", "seed": 0, "phases": [], "observations": {}}
    datafile.save(saved, {**run, "command": "rm -rf ~"})  # a key evaluate() does not take
    with pytest.raises(DataFileError, match="not a run saved by --save-observations"):
        evaluate_saved(str(saved))


def test_publishing_copies_the_runs_files_and_deletes_nothing(tmp_path: Path) -> None:
    from zerosim.files.outputs import publish_files

    run_dir, out = tmp_path / "run", tmp_path / "D"
    run_dir.mkdir()
    out.mkdir()
    (run_dir / "report.json").write_text("{}")
    (run_dir / "failure-rank1.json").write_text('{"rank": 1}')
    (out / "failure-rank-notes.txt").write_text("mine")
    (out / "report.json").write_text("an older report")
    assert [p.name for p in publish_files(run_dir, out)] == ["failure-rank1.json", "report.json"]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["failure-rank-notes.txt", "failure-rank1.json", "report.json"]
    assert (out / "report.json").read_text() == "{}"
    assert (out / "failure-rank-notes.txt").read_text() == "mine"


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,field",
    [
        (["--resume-at", "0"], "resume_at"),
        (["--resume-at", str(min(p.steps for p in build_phases()))], "resume_at"),  # a default phase's length
        (["--resume-at", "x"], "resume_at"),
        (["--resume-at", "1", "--resume-world", "0"], "resume_world"),
        (["--resume-world", "3"], "resume_world"),
    ],
)
def test_bad_resume_options_are_one_line_exit_2(args: list[str], field: str) -> None:
    line = error_line(run_verify("zerogpu-1", "--world", "2", *args), 2)
    assert field in line, line


@pytest.mark.torchdist
def test_a_trainer_without_save_checkpoint_is_bad_input_naming_the_method() -> None:
    result = run_verify("examples.zero1_trainer:make_trainer", "--world", "2", "--steps", "4",
                        "--resume-at", "1", "--resume-world", "2")
    line = error_line(result, 2)
    assert "save_checkpoint()" in line and "--resume-at" in line, line


# ---- the resume column of the matrix (runs stood in for) ----------------------------------------------


def test_resume_column_cells_files_and_exit_status(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import zerosim.verify as verify_package
    from zerosim.verify import matrix
    from zerosim.verify.errors import RankFailure
    from zerosim.verify.outcome import VerifyReport, stated

    seen = []

    def fake_verify(adapter: str, *, world: int, resume_at: int, resume_world: int, **_: object):
        seen.append((adapter, world, resume_world, resume_at))
        if adapter == "fsdp2" and resume_world == 2:
            raise RankFailure(0, "stand-in failure")
        lost = adapter == "torch-zero"
        c7 = stated(
            "fail" if lost else "pass",
            "first at step 2 (sgd), rank 0, w[momentum_buffer][0:3]: lost" if lost else "",
            [{"step": 2, "rank": 0, "tensor": "w[momentum_buffer]"}] if lost else [],
            {"error_over_tolerance": 0.01, "round_trip_violations": 1 if lost else 0},
        )
        contracts = {"C-ZERO-002": stated("pass"), "C-ZERO-007": c7}
        if adapter == "ddp":  # right values, traffic off the model: the cell counts its finding
            finding = {"contract": "C-ZERO-005", "clause": "ring_model", "step": 3, "rank": 0}
            contracts["C-ZERO-005"] = stated("finding", "traffic", [finding])
        phases = [{"name": "sgd", "status": "ran"}, {"name": "adamw", "status": "ran"}]
        return VerifyReport(adapter, world, 8, "float64", contracts, phases=phases)

    monkeypatch.setattr(verify_package, "verify", fake_verify)
    result = matrix.run_matrix(["ddp", "torch-zero", "fsdp2"], optimizers=(), worlds=(),
                               resume_pairs=matrix.RESUME_PAIRS)
    assert seen[:2] == [("ddp", 2, 3, matrix.RESUME_AT), ("ddp", 4, 2, matrix.RESUME_AT)]
    verdicts = {(c["adapter"], c["world"], c["resume_world"]): c["verdict"] for c in result["resume_cells"]}
    assert verdicts[("ddp", 4, 2)] == "pass" and verdicts[("torch-zero", 2, 3)] == "fail"
    assert verdicts[("fsdp2", 4, 2)] == "error"
    assert matrix.matrix_exit_code(result) == 3
    paths = matrix.write_matrix(result, tmp_path)
    assert sorted(p.name for p in paths.values()) == ["verify-resume-matrix.json", "verify-resume-matrix.md"]
    text = paths["md"].read_text()
    ddp = "pass (C-ZERO-007 pass 1.0e-02) (1 finding)"
    assert f"| ddp | {ddp} | {ddp} |" in text, text
    assert "fail (C-ZERO-007 fail 1.0e-02) step 2, C-ZERO-007" in text
    assert "fsdp2 4 -> 2: RankFailure" in text


def _resume_fp16(target: str):
    from zerosim.verify import verify

    return verify(target, world=2, steps=4, optimizers=("adamw",), timeout_s=TIMEOUT_S, resume_at=2,
                  precision="fp16")


@pytest.mark.torchdist
def test_an_fp16_run_resumes_with_its_float32_masters_and_loss_scale() -> None:
    # the protocol's initial scale 65536 overflows the first steps: the scale the trainer resumes with
    # is one it backed off to, and the continued steps are judged at the scale its skips imply
    report = _resume_fp16("torch-zero")
    assert report.exit_code == 0, {k: v.reason for k, v in report.contracts.items()}
    c7 = report.contracts["C-ZERO-007"]
    assert c7.status == "pass", c7.reason
    assert c7.details["round_trip_violations"] == 0 and c7.details["continued_steps"] == 2
    assert report.extra["mixed_precision"]["param_dtype"] == "float16"
    assert report.extra["resume"]["phases_resumed"] == ["adamw"]
    assert report.contracts["C-ZERO-005"].status == "pass", report.contracts["C-ZERO-005"].reason


@pytest.mark.torchdist
def test_a_loss_scale_that_restarts_on_load_fails_c_zero_007_as_loss_scale() -> None:
    report = _resume_fp16("tests.verify_trainers.broken:loss_scale_restarts_on_load")
    assert report.exit_code == 1
    c7 = report.contracts["C-ZERO-007"]
    assert c7.status == "fail" and c7.details["round_trip_violations"] == 0  # masters and state: intact
    first = c7.violations[0]
    assert first["clause"] == "continuation" and first["step"] == 3  # the first step after the resume
    assert "skipped step 3" in first["message"] and "do not overflow" in first["message"]
    assert [d.bug_class for d in report.diagnosis] == ["loss-scale"]
