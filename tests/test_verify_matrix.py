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
from zerosim.verify.outcome import ContractOutcome, VerifyReport  # noqa: E402


def _traffic_violation(step: int, rank: int) -> dict:
    return {"contract": "C-ZERO-005", "phase": "sgd", "step": step, "rank": rank, "tensor": "reduce",
            "start": None, "stop": None, "expected": 10.0, "got": 20.0, "error": 10.0, "tolerance": 0,
            "message": f"rank {rank} received 20 bytes in step {step}"}


def _report(adapter: str, world: int, failing_steps: list[tuple[int, int]]) -> VerifyReport:
    contracts = {
        cid: ContractOutcome("pass") for cid in ("C-ZERO-001", "C-ZERO-003", "C-ZERO-004")
    }
    contracts["C-ZERO-002"] = ContractOutcome(
        "pass", details={"max_error": 1e-16, "tolerance": 1e-14, "error_over_tolerance": 0.01}
    )
    contracts["C-ZERO-005"] = (
        ContractOutcome("fail", "traffic", [_traffic_violation(s, r) for s, r in failing_steps])
        if failing_steps else ContractOutcome("pass")
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
            report.contracts["C-ZERO-005"] = ContractOutcome("finding", "traffic", [finding])
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
            report.contracts["C-ZERO-005"] = ContractOutcome("finding", "traffic", [finding])
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
