"""``zerosim report`` on a small configuration: PNGs that are real images, an index that states every
figure, JSON that agrees with the models and the measurements."""

from __future__ import annotations

import json
import re

import matplotlib.image as mpimg
import pytest

from zerosim.cli import main
from zerosim.cost.memory_model import memory_per_rank
from zerosim.report.build import build_report
from zerosim.report.config import ReportConfig

FIGURES = ("memory_by_strategy", "memory_vs_dp", "comm_volume", "equivalence_error", "offload_timeline")


@pytest.fixture(scope="module")
def small_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    cfg = ReportConfig(world_sizes=(1, 2, 4), ranks_per_node=2, steps=2, offload_world_size=4, mpi=False,
                       torch=False, deepspeed=False, dp_degrees=(1, 8, 64))
    return build_report(out, cfg, progress=False), out



def small_report_argv(out) -> list[str]:
    """``zerosim report`` on world sizes 1 and 2, one step, simulator only: seconds, not minutes."""
    return ["report", "--out", str(out), "--world-sizes", "1,2", "--steps", "1", "--no-mpi", "--no-torch",
            "--no-deepspeed", "--quiet", "--large-world-size", "16", "--large-ranks-per-node", "4"]

def test_every_figure_is_a_real_png_with_its_json(small_report):
    result, out = small_report
    assert [f.name for f in result.figures] == list(FIGURES)
    for name in FIGURES:
        png = out / f"{name}.png"
        assert png.stat().st_size > 20_000
        img = mpimg.imread(png)
        assert img.shape[0] > 300 and img.shape[1] > 600 and float(img[..., :3].std()) > 0.05  # not blank
        data = json.loads((out / f"{name}.json").read_text())
        assert data


def test_index_links_and_states_every_figure(small_report):
    result, out = small_report
    index = (out / "index.md").read_text()
    for f in result.figures:
        assert f"]({f.png})" in index and f"]({f.json})" in index and f.title in index
        assert all(w[:60] in index for w in f.words)
    assert "MODELLED" in index and "MEASURED" in index and "torch.distributed" in index
    for table in ("model_vs_measured.json", "padding_demo.json", "deepspeed.json", "mpi.json", "torch.json"):
        assert f"({table})" in index and (out / table).exists()
    # every figure section says in words what is measured and what is modelled
    sections = re.split(r"^### ", index, flags=re.M)[1:]
    assert len(sections) == len(FIGURES)
    assert all(("MODELLED" in s or "MEASURED" in s) for s in sections)


def test_json_matches_the_models_and_the_measurements(small_report):
    _, out = small_report
    by_strategy = json.loads((out / "memory_by_strategy.json").read_text())
    for name, parts in by_strategy["large"]["strategies"].items():
        est = memory_per_rank(7.5e9, name, by_strategy["large"]["world_size"]).per_rank
        assert sum(parts.values()) == est.total.device
    assert sum(by_strategy["large"]["strategies"]["full_shard"].values()) == 1_875_000_000
    for entry in by_strategy["small"]["strategies"].values():
        assert entry["model"] == entry["measured"]  # the simulator allocates exactly what the model says
    rows = json.loads((out / "model_vs_measured.json").read_text())
    assert {r["world_size"] for r in rows} == {1, 2, 4}
    for r in rows:
        for cat in ("params", "grads", "optimizer_states", "total", "transient"):
            assert r[cat]["rel_diff"] == 0.0 and r[cat]["measured"] == r[cat]["model"]
        assert r["traffic"]["rel_diff"] == 0.0
    vs_dp = json.loads((out / "memory_vs_dp.json").read_text())
    for name, pts in vs_dp["small"]["measured"].items():
        for ws, measured in pts.items():
            assert measured == vs_dp["small"]["curves"][name][vs_dp["small"]["world_sizes"].index(int(ws))]
    comm = json.loads((out / "comm_volume.json").read_text())
    for e in comm["small"]["strategies"].values():
        assert e["model"] == e["measured"]
    eq = json.loads((out / "equivalence_error.json").read_text())
    sim = eq["backends"]["simulator"]
    assert sim["ordered_reference_max"] == 0.0
    # C-ZERO-002 holds, as the verdicts say
    assert all(max(v) <= eq["tolerance"] for v in sim["series"].values())
    timeline = json.loads((out / "offload_timeline.json").read_text())
    assert timeline["measured_peak_without_activations"] == timeline["modelled_peak_same_settings"]
    assert timeline["measured_host"] == timeline["modelled_host_same_settings"]
    padding = json.loads((out / "padding_demo.json").read_text())
    assert any(
        r["rel_diff_vs_paper_model"] > 0 and "padding" in r["explanation"] for c in padding for r in c["rows"]
    )
    assert all(r["rel_diff_vs_engine_model"] == 0 for c in padding for r in c["rows"])


def test_every_measured_run_passes_the_step_contracts(small_report):
    result, out = small_report
    rows = json.loads((out / "contracts.json").read_text())
    assert result.passed and rows == result.contracts
    assert {(r["world_size"], r["strategy"]) for r in rows} >= {
        (4, "full_shard"),
        (4, "hybrid_shard:2"),
        (1, "no_shard"),
    }
    every = {"C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005"}  # 001: the run's plan
    assert all(set(r["verdicts"]) == every for r in rows)
    assert all(v["checked"] > 0 for r in rows for v in r["verdicts"].values())
    index = (out / "index.md").read_text()
    assert "## Contract verdicts" in index and f"All {len(rows)} measured runs pass" in index


def test_a_broken_engine_makes_the_report_fail_and_name_the_violation(tmp_path, capsys, monkeypatch):
    """The report checks what it measures: observations from a broken engine fail it (exit 1)."""
    import dataclasses

    import zerosim.report.runs as runs

    honest = runs.simulate_observations

    def from_a_broken_engine(run):
        if run.strategy.name != "full_shard" or run.world_size < 2:
            return honest(run)
        return honest(dataclasses.replace(run.cfg, fault="sum-instead-of-avg").resolve())

    monkeypatch.setattr(runs, "simulate_observations", from_a_broken_engine)
    code = main(small_report_argv(tmp_path / "r"))
    out = capsys.readouterr().out
    assert code == 1
    assert "simulator: C-ZERO-002..005 hold on 7/8 runs" in out
    assert "FAIL C-ZERO-002 simulator world 2 full_shard:" in out
    index = (tmp_path / "r" / "index.md").read_text()
    assert "FAIL (1 runs)" in index and "simulator world 2 full_shard: C-ZERO-002" in index


def test_report_cli_small_run_and_bad_input(tmp_path, capsys):
    code = main(small_report_argv(tmp_path / "r"))
    out = capsys.readouterr().out
    assert code == 0 and "index.md" in out and (tmp_path / "r" / "index.md").exists()
    for argv, field in (
        (["--world-sizes", "0"], "world-sizes"),
        (["--world-sizes", "a,b"], "world-sizes"),
        (["--steps", "-1"], "steps"),
        (["--model", "huge"], "model"),
        (["--large-world-size", "64", "--large-ranks-per-node", "3"], "large-ranks-per-node"),
        (["--large-params", "x"], "large-params"),
        (["--large-params", "nan"], "large-params"),
        (["--large-params", "0"], "large-params"),
        (["--large-params=-5"], "large-params"),
        (["--large-world-size", "-64"], "large-world-size"),
        (["--ranks-per-node", "3"], "ranks-per-node"),
        (["--ranks-per-node", "0"], "ranks-per-node"),
        (["--world-sizes", "1,2,3"], "ranks-per-node"),
        (["--precision", "fp8"], "precision"),
    ):
        code = main(["report", "--out", str(tmp_path / "bad"), "--quiet", *argv])
        err = capsys.readouterr().err
        assert code == 2 and field in err and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "bad").exists()


def test_the_equivalence_figure_shows_every_world_size_it_quotes_against_the_verdicts_tolerance(small_report):
    from zerosim.checks.tolerance import equivalence_tolerance

    result, out = small_report
    eq = json.loads((out / "equivalence_error.json").read_text())
    assert eq["tolerance"] == equivalence_tolerance("fp32").atol_scale
    sim = eq["backends"]["simulator"]
    assert sim["title"] == "world sizes 1, 2, 4"
    assert [k.split(" (")[0] for k in sim["series"]] == ["world 1", "world 2", "world 4"]
    words = next(f for f in result.figures if f.name == "equivalence_error").words[0]
    for ws, errs in zip((1, 2, 4), sim["series"].values(), strict=True):
        assert f"world {ws}: {max(errs):.3g}" in words  # the text quotes exactly the panel's curves
    assert f"tolerance ({eq['tolerance']:g}" in words


def test_the_shared_log_range_holds_every_error_and_the_tolerance():
    from zerosim.report.figures import _shared_log_range

    bottom, top = _shared_log_range([0.0, 3e-9, 1.2e-7], 2e-5)
    assert bottom < 3e-9 and top > 2e-5
    bottom, top = _shared_log_range([0.0], 2e-5)  # all bit-identical: still a range around the tolerance
    assert 0 < bottom < 2e-5 < top


def test_relative_differences_never_read_as_bytes(small_report):
    _, out = small_report
    index = (out / "index.md").read_text()
    section = index.split("## Model vs measured memory and traffic")[1].split("\n## ")[0]
    header = next(line for line in section.splitlines() if line.startswith("| world |"))
    cells = [c.strip() for c in header.strip("|").split("|")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| world")]
    assert rows
    for row in rows:
        values = [c.strip() for c in row.strip("|").split("|")]
        for name, value in zip(cells, values, strict=True):
            if "rel. diff" in name:
                assert value == "0 (exact)" or value.endswith("%") or value == "inf", (name, value)
            if name.endswith("[B]") or name.endswith("[B] (measured)"):
                assert re.fullmatch(r"[0-9,]+", value), (name, value)


@pytest.mark.parametrize("where", ["a file", "under a file", "/dev/null"])
def test_report_out_that_cannot_be_a_folder_is_one_line_and_exit_2(tmp_path, capsys, where):
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    out = {"a file": afile, "under a file": afile / "sub", "/dev/null": "/dev/null"}[where]
    code = main(small_report_argv(out))
    captured = capsys.readouterr()
    assert code == 2 and captured.err.startswith(f"error: invalid out='{out}'")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert afile.read_text() == "keep me"
