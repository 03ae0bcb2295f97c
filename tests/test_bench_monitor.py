"""``zerosim bench monitor``: its arithmetic (ratios against the neighbouring runs without the monitor,
the monitor's own accounted time with the step checks' hooks and replay, the ratio projected at
``every``), its bad input, and its own launch at worlds 2 and 4 (every variant; the step checks each
adapter carries; every monitored run's files judged again offline, as ``zerosim check trace`` does)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from zerosim.cli import main as cli_main


def test_bench_monitor_ratios_are_against_the_neighbouring_runs_without_the_monitor(capsys):
    from zerosim.bench.monitor import summarize

    def row(variant, step_s, r, position, monitor_s=0.0):
        checks = 0 if variant == "off" else 2
        return {"adapter": "ddp", "variant": variant, "step_s": step_s, "round": r, "position": position,
                "checks": checks, "violations": 0, "monitor_s": monitor_s, "first_check_s": 0.01,
                "local_params": 10}

    # round 0: off, every=100, off, every=1, off; round 1: off, every=1, off, every=100, off (a slower box)
    rows = [row("off", 0.010, 0, 0), row("every=100", 0.0105, 0, 1, 0.004), row("off", 0.011, 0, 2),
            row("every=1", 0.022, 0, 3, 0.4), row("off", 0.011, 0, 4),
            row("off", 0.020, 1, 0), row("every=1", 0.030, 1, 1, 0.4), row("off", 0.020, 1, 2),
            row("every=100", 0.021, 1, 3, 0.004), row("off", 0.022, 1, 4)]
    table = {r["variant"]: r for r in summarize(rows, steps=100)}
    assert table["off"]["ratio"] == 1.0 and table["off"]["runs"] == 6
    assert table["off"]["ratio_min"] == pytest.approx(0.010 / 0.0155)  # spread around the median off run
    hundred = [0.0105 / 0.0105, 0.021 / 0.021]  # each over the mean of its two neighbours
    assert table["every=100"]["ratio"] == pytest.approx(sum(hundred) / 2)
    one = [0.022 / 0.011, 0.030 / 0.020]
    spread = (table["every=1"]["ratio_min"], table["every=1"]["ratio_max"])
    assert spread == pytest.approx((min(one), max(one)))
    assert table["every=1"]["ratio"] == pytest.approx(sum(one) / 2)
    # accounted: 1 + the monitor's seconds per step over the neighbours' step time
    assert table["every=1"]["accounted"] == pytest.approx(((1 + 0.004 / 0.011) + (1 + 0.004 / 0.020)) / 2)
    assert table["every=1"]["check_ms"] == pytest.approx(200.0)  # 0.8 s over 4 checks
    assert table["every=1"]["first_check_ms"] == pytest.approx(10.0)
    assert cli_main(["bench", "monitor", "--adapters", "megatron"]) == 2
    assert "invalid adapters='megatron'" in capsys.readouterr().err
    assert cli_main(["bench", "monitor", "--batch", "0"]) == 2
    assert "invalid batch=0" in capsys.readouterr().err
    assert cli_main(["bench", "monitor", "--digest-mb", "-1"]) == 2  # refused before any launch
    assert "invalid digest-mb='-1': must be 0 (skip) or a number of MB" in capsys.readouterr().err
    assert cli_main(["bench", "monitor", "--device", "tpu"]) == 2
    assert "invalid device='tpu': must be cpu or cuda" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli_main(["bench", "monitor", "--device", "cuda"]) == 2
        assert "invalid device='cuda': CUDA is not available here" in capsys.readouterr().err


def test_bench_monitor_accounts_the_step_checks_time_and_projects_each_every():
    """A step-check run's accounted ratio holds the probe's seconds as well as the monitor's; its ms per
    kind are over the check steps the probe observed; every monitored row's projected ratio is
    1 + (the cost of a check measured where its family ran most checks) / (every x the off step)."""
    from zerosim.bench.monitor import step_check_support, summarize

    def row(variant, step_s, position, monitor_s=0.0, checks=0, **more):
        return {"adapter": "ddp", "variant": variant, "step_s": step_s, "round": 0, "position": position,
                "checks": checks, "violations": 0, "monitor_s": monitor_s, "first_check_s": 0.01,
                "local_params": 10, **more}

    spent = {"grad_accounting": 0.02, "update": 0.03, "replay": 0.04, "fields": 0.01}
    carried = {"observed": 10, "grad_accounting": 10, "update": 10, "replay": 9}
    rows = [row("off", 0.010, 0), row("every=1", 0.012, 1, 0.02, 10), row("off", 0.010, 2),
            row("every=1+step-checks", 0.025, 3, 0.03, 10, step_check_s=spent, step_check_carried=carried,
                step_checks_off=None),
            row("off", 0.010, 4),
            row("every=100+step-checks", 0.010, 5, 0.0, 0, step_check_s=dict.fromkeys(spent, 0.0),
                step_check_carried=dict.fromkeys(carried, 0), step_checks_off=None),
            row("off", 0.010, 6)]
    table = {r["variant"]: r for r in summarize(rows, steps=10)}
    with_checks = table["every=1+step-checks"]
    # 0.03 s of the monitor's and 0.10 s of the probe's over 10 steps of 10 ms
    assert with_checks["accounted"] == pytest.approx(1 + 0.13 / 10 / 0.010)
    per_kind = {"grad_accounting": 2.0, "update": 3.0, "replay": 4.0, "fields": 1.0}  # ms over 10 steps
    assert with_checks["step_check_ms"] == pytest.approx(per_kind)
    assert with_checks["check_ms"] == pytest.approx(3.0)
    assert with_checks["all_check_ms"] == pytest.approx(13.0)
    assert with_checks["projected"] == pytest.approx(1 + 13.0 / 10.0)
    # the every=100 run held no timed check: weighed by the cost per check of its family at every=1
    hundred = table["every=100+step-checks"]
    assert hundred["projected"] == pytest.approx(1 + 13.0 / (100 * 10.0))
    assert hundred["projected_from"] == "every=1+step-checks"
    assert hundred["step_check_ms"] is None and hundred["all_check_ms"] is None  # no check step observed
    assert table["every=1"]["projected"] == pytest.approx(1 + 2.0 / 10.0)
    support = step_check_support(summarize(rows, steps=10))
    assert support == [{"adapter": "ddp", "variant": "every=1+step-checks", **carried,
                        "step_checks_off": None}]


def test_bench_monitor_times_every_step_probe_method_it_names():
    """The timed probe classes wrap at least one method the probe still has for every kind (a rename
    would leave that kind at zero), one entry per kind the report lists."""
    from zerosim.bench import monitor_probe
    from zerosim.bench.monitor import STEP_KINDS

    assert monitor_probe.missing_kinds() == []
    assert monitor_probe.KINDS == STEP_KINDS


def test_bench_monitor_refuses_an_unknown_variant_in_one_line(capsys):
    assert cli_main(["bench", "monitor", "--variants", "every=7", "--adapters", ""]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: invalid variants='every=7': must be among every=100, every=1, "
                           "every=100+step-checks, every=1+step-checks"), err
    assert cli_main(["bench", "monitor", "--variants", ",", "--adapters", ""]) == 2
    assert "invalid variants=',': must name at least one monitored variant" in capsys.readouterr().err


@pytest.mark.torchdist
def test_bench_monitor_launches_its_ranks_and_reports_every_variant(tmp_path, capsys):
    """The benchmark's own launch, at the smallest size: every variant timed against its neighbours
    without the monitor, each monitored run a fault-free soak with no violation, the digest timed; DDP
    carries all three step checks at every check step, and each run's files judged offline agree with
    the live verdict."""
    assert cli_main(["bench", "monitor", "--adapters", "ddp", "--steps", "2", "--warmup", "1",
                     "--rounds", "1", "--width", "16", "--depth", "1", "--batch", "4", "--digest-mb", "1",
                     "--layout-world", "0", "--trace", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_monitor.json").read_text())
    table = {row["variant"]: row for row in report["table"]}
    assert set(table) == {"off", "every=100", "every=1", "every=100+step-checks", "every=1+step-checks"}
    assert report["settings"]["device"] == "cpu"
    assert table["every=1"]["checks"] >= 2 and all(row["violations"] == 0 for row in table.values())
    assert all(math.isfinite(row["ratio"]) and row["step_ms"] > 0 for row in table.values())
    steps = table["every=1+step-checks"]
    assert steps["step_check_carried"] == {"observed": 2, "grad_accounting": 2, "update": 2, "replay": 2}
    assert all(steps["step_check_ms"][kind] > 0 for kind in ("grad_accounting", "update", "replay"))
    assert "step_check_ms" not in table["every=1"]  # the variant without the step checks runs none
    assert report["step_checks"][0]["step_checks_off"] is None
    assert report["trace"]["runs"] == report["trace"]["agree"] == 4 and report["trace"]["violations"] == 0
    offline = next(r["offline"] for r in report["rows"] if r["variant"] == "every=1+step-checks")
    assert offline["lines_with"] == {"grad_accounting": 6, "update": 6, "replay": 6}  # 3 checks x 2 ranks
    assert report["digest"]["digest_gb_s"] > 0 and "on cpu: digest" in capsys.readouterr().out


@pytest.mark.torchdist
def test_bench_monitor_step_checks_hold_at_world_4(tmp_path):
    """Four ranks (two of them sharing a core here): DDP and ZeroRedundancyOptimizer with every step
    check at every step, no violation live or offline, every check step carrying all three."""
    assert cli_main(["bench", "monitor", "--world", "4", "--adapters", "ddp,zero-redundancy",
                     "--variants", "every=1+step-checks", "--steps", "3", "--warmup", "1", "--rounds", "1",
                     "--width", "16", "--depth", "1", "--batch", "4", "--digest-mb", "0",
                     "--layout-world", "0", "--trace", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_monitor.json").read_text())
    assert report["world_size"] == 4
    for support in report["step_checks"]:
        assert support == {"adapter": support["adapter"], "variant": "every=1+step-checks", "observed": 3,
                           "grad_accounting": 3, "update": 3, "replay": 3, "step_checks_off": None}
    assert [s["adapter"] for s in report["step_checks"]] == ["ddp", "zero-redundancy"]
    assert report["trace"]["runs"] == report["trace"]["agree"] == 2 and report["trace"]["violations"] == 0


def test_bench_monitor_with_nothing_to_time_writes_a_report_that_says_so(tmp_path, capsys):
    """``--adapters ''`` times no training, ``--digest-mb 0`` skips the digest's throughput and
    ``--layout-world 0`` the layout check: the report holds none of them, and prints no figure for them."""
    assert cli_main(["bench", "monitor", "--adapters", "", "--digest-mb", "0", "--layout-world", "0",
                     "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_monitor.json").read_text())
    assert report["table"] == [] and report["digest"] is None and report["layout_check"] is None
    assert "GB/s" not in capsys.readouterr().out


def test_bench_monitor_names_why_a_deepspeed_adapter_is_skipped(monkeypatch, tmp_path, capsys):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    # no adapter left to launch: the report holds the skipped rows and the digest only
    assert cli_main(["bench", "monitor", "--adapters", "deepspeed-1,deepspeed-3", "--digest-mb", "1",
                     "--layout-world", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "deepspeed-1      skipped: deepspeed is not installed: DS_BUILD_OPS=0 pip install" in out, out
    report = json.loads((tmp_path / "bench_monitor.json").read_text())
    assert [r["adapter"] for r in report["skipped"]] == ["deepspeed-1", "deepspeed-3"]
    assert report["table"] == [] and report["settings"]["adapters"] == []
