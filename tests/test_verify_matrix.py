"""The peers' verdict matrix (``zerosim verify --all``) from cells whose verify runs are stood in for.

A cell's run is replaced by a report built here, so the matrix logic is checked without launching
ranks: the first failing step is the earliest over every violation of every failed contract (not
the first one listed, which for C-ZERO-005 is rank-major), a run that errors makes the cell
``error`` and the exit status 3, and the markdown, JSON and heat map are written with each cell's
verdict, ratio and first failing step.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

import zerosim.verify as verify_package  # noqa: E402
from zerosim.verify import matrix  # noqa: E402
from zerosim.verify.errors import RankFailure  # noqa: E402
from zerosim.verify.outcome import Diagnosis, VerifyReport, stated  # noqa: E402


def _traffic_violation(step: int, rank: int) -> dict:
    return {"contract": "C-ZERO-005", "phase": "sgd", "step": step, "rank": rank, "tensor": "reduce",
            "start": None, "stop": None, "expected": 10.0, "got": 20.0, "error": 10.0, "tolerance": 0,
            "message": f"rank {rank} received 20 bytes in step {step}"}


def _report(adapter: str, world: int, failing_steps: list[tuple[int, int]]) -> VerifyReport:
    contracts = {
        cid: stated("pass") for cid in ("C-ZERO-001", "C-ZERO-003", "C-ZERO-004")
    }
    contracts["C-ZERO-002"] = stated(
        "pass", details={"max_error": 1e-16, "tolerance": 1e-14, "error_over_tolerance": 0.01}
    )
    contracts["C-ZERO-005"] = (
        stated("fail", "traffic", [_traffic_violation(s, r) for s, r in failing_steps])
        if failing_steps else stated("pass")
    )
    return VerifyReport(adapter, world, 4, "float64", contracts)


@pytest.fixture
def stand_in_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """ddp passes; torch-zero fails C-ZERO-005 with rank 0 first listed at step 3 but rank 1 failing
    at step 2; fsdp2 at world 4 loses a rank."""

    def fake_verify(adapter: str, *, world: int, **_: object) -> VerifyReport:
        if adapter == "fsdp2" and world == 4:
            raise RankFailure(1, "stand-in failure")
        failing = [(3, 0), (4, 0), (2, 1)] if adapter == "torch-zero" else []
        return _report(adapter, world, failing)

    monkeypatch.setattr(verify_package, "verify", fake_verify)


def test_first_failing_step_is_the_earliest_over_every_violation(stand_in_runs: None) -> None:
    cell = matrix.run_cell("torch-zero", "sgd", 2)
    assert cell["verdict"] == "fail"
    assert (cell["first_failing_step"], cell["first_failing_contract"]) == (2, "C-ZERO-005")
    assert matrix.run_cell("ddp", "sgd", 2)["first_failing_step"] is None


def test_matrix_files_and_exit_status(stand_in_runs: None, tmp_path) -> None:
    result = matrix.run_matrix(["ddp", "torch-zero", "fsdp2"], optimizers=("sgd",), worlds=(2, 4))
    verdicts = {(c["adapter"], c["world"]): c["verdict"] for c in result["cells"]}
    assert verdicts == {("ddp", 2): "pass", ("ddp", 4): "pass", ("torch-zero", 2): "fail",
                        ("torch-zero", 4): "fail", ("fsdp2", 2): "pass", ("fsdp2", 4): "error"}
    assert matrix.matrix_exit_code(result) == 3
    paths = matrix.write_matrix(result, tmp_path)
    assert set(paths) == {"json", "md", "png"} and all(p.stat().st_size > 0 for p in paths.values())
    assert json.loads(paths["json"].read_text())["cells"][2]["first_failing_step"] == 2
    text = paths["md"].read_text()
    assert "| ddp | pass 1.0e-02 | pass 1.0e-02 |" in text
    assert "fail 1.0e-02 (step 2, C-ZERO-005)" in text
    assert "rank 1 failed: stand-in failure" in text


def test_an_unknown_adapter_is_refused_before_any_cell_runs(stand_in_runs: None) -> None:
    from zerosim.errors import ConfigError

    with pytest.raises(ConfigError, match="invalid adapter='nccl-magic'"):
        matrix.run_matrix(["ddp", "nccl-magic"])


def test_mesh_column_runs_hybrid_adapters_on_the_world_by_1_mesh_and_counts_findings(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """The mesh column: only hybrid adapters, each at world 4 on mesh (4, 1); a cell whose traffic is a
    finding (values right) passes and says how many findings."""
    seen: list[tuple[str, int, object]] = []

    def fake_verify(adapter: str, *, world: int, mesh: object = None, **_: object) -> VerifyReport:
        seen.append((adapter, world, mesh))
        report = _report(adapter, world, [])
        if adapter == "ddp":
            finding = {**_traffic_violation(2, 0), "clause": "ring_model"}
            report.contracts["C-ZERO-005"] = stated("finding", "traffic", [finding])
        return report

    monkeypatch.setattr(verify_package, "verify", fake_verify)
    result = matrix.run_matrix(["ddp", "fsdp2-hybrid"], optimizers=("sgd",), worlds=(2,), mesh_worlds=(4,))
    assert ("fsdp2-hybrid", 4, (4, 1)) in seen and all(m is None for a, _, m in seen if a == "ddp")
    assert [(c["adapter"], c["mesh"]) for c in result["mesh_cells"]] == [("fsdp2-hybrid", [4, 1])]
    assert matrix.matrix_exit_code(result) == 0
    text = matrix.render_markdown(result)
    assert "| adapter | sgd @ 2 | sgd @ 4, mesh 4x1 |" in text, text
    assert "| ddp | pass 1.0e-02 (1 finding) | - |" in text, text
    assert "| fsdp2-hybrid | pass 1.0e-02 | pass 1.0e-02 |" in text, text


def test_the_accumulation_column_runs_each_adapter_with_grad_accum_and_renders(
        stand_in_runs: None, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    seen = []
    fake = verify_package.verify

    def recording(adapter: str, **options: object) -> VerifyReport:
        seen.append((adapter, options.get("grad_accum"), options.get("world")))
        report = fake(adapter, **options)  # type: ignore[arg-type]
        if adapter == "ddp":  # right values, traffic off the model: a pass that counts its finding
            finding = {**_traffic_violation(2, 0), "clause": "ring_model"}
            report.contracts["C-ZERO-005"] = stated("finding", "traffic", [finding])
        return report

    monkeypatch.setattr(verify_package, "verify", recording)
    result = matrix.run_matrix(["ddp", "torch-zero", "fsdp2"], optimizers=(), worlds=(),
                               accum_pairs=matrix.ACCUM_CELLS)
    assert seen == [("ddp", 3, 4), ("torch-zero", 3, 4), ("fsdp2", 3, 4)]
    verdicts = {c["adapter"]: c["verdict"] for c in result["accum_cells"]}
    assert verdicts == {"ddp": "pass", "torch-zero": "fail", "fsdp2": "error"}
    assert matrix.matrix_exit_code(result) == 3
    text = matrix.render_markdown(result)
    assert "| adapter | accum 3 @ 4 |" in text
    assert "| ddp | pass 1.0e-02 / norm - (1 finding) |" in text
    assert "| torch-zero | fail 1.0e-02 / norm - (step 2, C-ZERO-005) |" in text
    assert "torch-zero accum 3 @ 4: C-ZERO-005 fail: traffic" in text


def test_the_mixed_precision_columns_run_each_adapter_under_bf16_and_fp16_and_render(
        stand_in_runs: None, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    seen = []
    fake = verify_package.verify

    def recording(adapter: str, **options: object) -> VerifyReport:
        seen.append((adapter, options.get("precision"), options.get("world")))
        report = fake(adapter, **options)  # type: ignore[arg-type]
        if adapter == "ddp" and options.get("precision") == "fp16":
            report.phases = [{"name": "sgd", "status": "skipped", "reason": "no float16 here"},
                             {"name": "adamw", "status": "ran"}]
        return report

    monkeypatch.setattr(verify_package, "verify", recording)
    result = matrix.run_matrix(["ddp", "torch-zero", "fsdp2"], optimizers=(), worlds=(),
                               precision_pairs=matrix.PRECISION_CELLS)
    assert seen == [(a, p, 4) for a in ("ddp", "torch-zero", "fsdp2") for p in ("bf16", "fp16")]
    verdicts = {(c["adapter"], c["precision"]): c["verdict"] for c in result["precision_cells"]}
    assert verdicts[("ddp", "bf16")] == "pass" and verdicts[("torch-zero", "fp16")] == "fail"
    assert verdicts[("fsdp2", "bf16")] == "error"
    assert matrix.matrix_exit_code(result) == 3
    text = matrix.render_markdown(result)
    assert text.startswith("# Peers' mixed-precision matrix (bf16 / fp16, cpu,")
    assert "| adapter | bf16 @ 4 | fp16 @ 4 | wall s |" in text
    assert "| ddp | pass 1.0e-02 (C-ZERO-002) | pass 1.0e-02 (C-ZERO-002); unsupported: sgd |" in text
    assert "- ddp fp16 @ 4: sgd phase: no float16 here" in text
    assert "torch-zero bf16 @ 4: C-ZERO-005 fail: traffic" in text
    paths = matrix.write_matrix(result, tmp_path)
    assert paths["md"].name == "verify-precision-matrix.md"
    assert json.loads(paths["json"].read_text())["precision_cells"][0]["precision"] == "bf16"


def test_a_precision_cell_where_no_phase_ran_reads_unsupported_not_pass() -> None:
    from zerosim.verify.matrix_precision import precision_label

    cell = {"verdict": "pass", "error_over_tolerance": None, "findings": 0,
            "phases": {"sgd": "no float16 kernels", "adamw": "no float16 kernels"}}
    assert precision_label(cell) == "unsupported: sgd, adamw"
    cell["phases"]["adamw"] = "ran"
    assert precision_label(cell) == "pass; unsupported: sgd"


_REFUSAL = ("FSDP2 cannot step adafactor on its DTensor shards: RuntimeError: aten.pow_.Scalar: "
            "in-place operations that require placement changes are not supported.")
_FSDP2_ADAFACTOR = f"make_trainer raised NotImplementedError ({_REFUSAL}) for adafactor"


def test_the_optimizer_and_model_columns_run_each_adapter_once_per_column_and_show_refusals(
        monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """One cell per (adapter, optimizer column) with that optimizer alone at its world, one per (adapter,
    model column) with the default phases on that model; a phase the framework refuses is a cell
    ``unsupported`` carrying the framework's words (no error, exit status unaffected), a failing
    phase keeps its diagnosis and evidence."""
    seen = []

    def fake_verify(adapter: str, *, world: int, **options: object) -> VerifyReport:
        seen.append((adapter, options.get("optimizers"), options.get("model"), world, options.get("steps")))
        report = _report(adapter, world, [])
        optimizers = options.get("optimizers") or ("sgd", "adamw")
        report.phases = [{"name": o, "status": "ran"} for o in optimizers]  # type: ignore[union-attr]
        if adapter == "fsdp2" and optimizers == ("adafactor",):  # every phase refused: "unsupported"
            report.phases = [{"name": "adafactor", "status": "skipped", "reason": _FSDP2_ADAFACTOR}]
        if adapter == "fsdp2" and optimizers == ("muon",):
            report.contracts["C-ZERO-002"] = stated(
                "fail", "off", [{**_traffic_violation(1, 0), "contract": "C-ZERO-002"}],
                details={"error_over_tolerance": 1.1e8})
            report.diagnosis = [Diagnosis("muon-rounding-order", "0.05 from whole, 0.61 from row blocks")]
        return report

    monkeypatch.setattr(verify_package, "verify", fake_verify)
    result = matrix.run_matrix(["ddp", "fsdp2"], optimizers=(), worlds=(),
                               optimizer_pairs=matrix.OPTIMIZER_CELLS, model_pairs=matrix.MODEL_CELLS)
    steps = matrix.PHASE_STEPS
    assert seen == [run for a in ("ddp", "fsdp2")
                    for run in [*((a, (o,), None, 2, steps) for o in ("adam", "adafactor", "muon")),
                                (a, None, "moe", 2, 2 * steps)]]
    cells = {(c["adapter"], c["optimizer"]): c for c in result["optimizer_cells"]}
    assert cells[("fsdp2", "adafactor")]["verdict"] == "unsupported"
    assert cells[("fsdp2", "muon")]["diagnosis"] == ["muon-rounding-order"]
    assert [c["model"] for c in result["model_cells"]] == ["moe", "moe"]
    assert matrix.matrix_exit_code(result) == 1  # the failing muon cell; the refusal is no error
    text = matrix.render_markdown(result)
    assert text.startswith("# Peers' optimizer and model matrix (float64, cpu,")
    assert "| adapter | adam @ 2 | adafactor @ 2 | muon @ 2 | --model moe @ 2 | wall s |" in text, text
    assert (f"| fsdp2 | pass 1.0e-02 | unsupported: {_REFUSAL} | "
            "fail 1.1e+08 (step 1, C-ZERO-002); muon-rounding-order | pass 1.0e-02 |") in text, text
    assert "- fsdp2 muon @ 2: diagnosis muon-rounding-order: 0.05 from whole, 0.61 from row blocks" in text
    assert f"- fsdp2 adafactor @ 2: unsupported: {_FSDP2_ADAFACTOR}" in text
    paths = matrix.write_matrix(result, tmp_path)
    assert paths["md"].name == "verify-columns-matrix.md"
    written = json.loads(paths["json"].read_text())
    assert written["optimizer_pairs"] == [["adam", 2], ["adafactor", 2], ["muon", 2]]


def test_verify_all_runs_the_optimizer_and_model_columns_by_default() -> None:
    import inspect

    defaults = inspect.signature(matrix.run_all).parameters
    assert defaults["optimizer_pairs"].default == (("adam", 2), ("adafactor", 2), ("muon", 2))
    assert defaults["model_pairs"].default == (("moe", 2),)
