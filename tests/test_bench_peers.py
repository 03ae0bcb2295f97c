"""``zerosim bench peers``: the stage table, the ratios, bad input, and real torchrun launches.

No timing is asserted: only that the report holds what it should and that its ratios follow from its
own medians (the fastest peer of a stage is 1.0 exactly). The launches run from the repository root
so that ``tests.verify_trainers.bad`` is importable on every rank.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from zerosim.bench.peers_method import (  # noqa: E402
    STAGES,
    is_peer,
    merge_rounds,
    sequence,
    stage_from_strategy,
    stage_of,
    timed_steps,
)
from zerosim.bench.peers_report import COLUMNS, summarize, table_rows  # noqa: E402
from zerosim.bench.peers_run import MAX_TIMED_STEPS  # noqa: E402
from zerosim.cli import main  # noqa: E402
from zerosim.verify.adapters import ADAPTERS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GUARD_S = 240.0  # a launch that outlives this is a hang: the test fails
BAD = "tests.verify_trainers.bad"


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "zerosim", "bench", "peers", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)


# ---- stages and ratios -------------------------------------------------------------------------------------


def test_the_stage_table_names_every_adapter_in_the_table() -> None:
    unstaged = [name for name in ADAPTERS if name not in STAGES]
    assert not unstaged, f"adapters without a ZeRO stage in zerosim.bench.peers_method.STAGES: {unstaged}"
    assert all(stage in (0, 1, 2, 3, "hybrid") for stage in STAGES.values())


def test_a_declared_strategy_wins_over_the_table() -> None:
    assert stage_from_strategy("ddp") == 0 and stage_from_strategy("zero2") == 2
    assert stage_from_strategy("hybrid:4") == "hybrid" and stage_from_strategy("weird") is None
    assert stage_of("fsdp2") == (3, "table")
    assert stage_of("fsdp2", "zero1") == (1, "declared")
    assert stage_of("mypkg.trainer:make_trainer") == (None, "unknown")
    assert is_peer("fsdp2") and not is_peer("zerogpu-3") and not is_peer("mypkg.trainer:make_trainer")


def _row(adapter: str, stage: Any, samples: list[float], model: str = "m") -> dict[str, Any]:
    return {"kind": "result", "model": model, "adapter": adapter, "status": "ok", "stage": stage,
            "samples": samples}


def test_ratios_are_over_the_fastest_peer_of_the_stage_and_the_fastest_of_all() -> None:
    rows = [
        _row("ddp", 0, [0.30, 0.10, 0.20]),
        _row("fsdp2", 3, [0.5, 0.4, 0.6]),
        _row("deepspeed-3", 3, [0.45, 0.41, 0.44]),
        _row("zerogpu-3", 3, [0.3, 0.3, 0.3]),  # faster than every peer: below 1, and never the reference
        _row("zerogpu-1", 1, [0.2, 0.2, 0.2]),  # no peer of stage 1 measured
        {"kind": "result", "model": "m", "adapter": "torch-zero", "status": "error", "stage": 1,
         "error": "rank 1 failed: RuntimeError: boom"},
    ]
    by = {r["adapter"]: r for r in summarize(rows, ["m"])}
    assert by["ddp"]["median_s"] == 0.20 and by["ddp"]["ratio_to_stage_peer"] == 1.0
    assert by["deepspeed-3"]["stage_peer"] == "deepspeed-3"
    assert by["deepspeed-3"]["ratio_to_stage_peer"] == 1.0
    assert by["fsdp2"]["stage_peer"] == "deepspeed-3"
    assert by["fsdp2"]["ratio_to_stage_peer"] == pytest.approx(0.5 / 0.44)
    assert by["zerogpu-3"]["ratio_to_stage_peer"] == pytest.approx(0.3 / 0.44)
    assert by["zerogpu-1"]["ratio_to_stage_peer"] is None and by["zerogpu-1"]["stage_peer"] is None
    assert by["ddp"]["ratio_to_fastest"] == 1.0 and by["zerogpu-1"]["ratio_to_fastest"] == 1.0
    assert by["fsdp2"]["ratio_to_fastest"] == pytest.approx(0.5 / 0.2)
    assert "median_s" not in by["torch-zero"] and by["torch-zero"]["ratio_to_fastest"] is None


def test_the_ratio_is_also_taken_round_by_round_against_the_same_peer() -> None:
    """Each round's median over the stage peer's median of the same round; a round only one of them
    ran is left out. Here the medians of all samples put zerogpu-1 at 1.0 exactly, while round by
    round it was faster in the quiet round and slower in the busy one: the range says level."""
    def rounds(adapter: str, stage: Any, per_round: dict[int, list[float]]) -> list[dict[str, Any]]:
        return [{**_row(adapter, stage, samples), "round": i} for i, samples in per_round.items()]

    rows = [*rounds("torch-zero", 1, {0: [1.0, 1.0, 1.0], 1: [2.0, 2.0, 2.0]}),
            *rounds("deepspeed-1", 1, {0: [3.0], 1: [3.0]}),
            *rounds("zerogpu-1", 1, {0: [0.9, 0.9, 1.0], 1: [2.2, 2.0, 2.2]}),
            *rounds("zerogpu-1-native", 1, {1: [1.0]})]  # skipped in round 0
    by = {r["adapter"]: r for r in summarize(rows, ["m"])}
    assert by["zerogpu-1"]["stage_peer"] == "torch-zero"
    assert by["zerogpu-1"]["ratio_to_stage_peer"] == pytest.approx(1.5 / 1.5)
    assert by["zerogpu-1"]["round_ratios_to_stage_peer"] == pytest.approx([0.9, 1.1])
    assert by["zerogpu-1-native"]["round_ratios_to_stage_peer"] == pytest.approx([0.5])
    assert by["torch-zero"]["round_ratios_to_stage_peer"] == [1.0, 1.0]
    cells = {row[1]: row for row in table_rows({"results": list(by.values())})}
    column = COLUMNS.index("by round")
    assert cells["zerogpu-1"][column] == "0.90-1.10" and cells["torch-zero"][column] == "1.00"
    assert cells["zerogpu-1-native"][column] == "0.50"
    lonely = summarize([_row("zerogpu-2", 2, [0.1])], ["m"])[0]  # no peer of its stage
    assert lonely["round_ratios_to_stage_peer"] == []
    assert table_rows({"results": [lonely]})[0][column] == "-"


# ---- rounds and the number of timed steps ----------------------------------------------------------------


def test_rounds_alternate_the_order_so_drifting_load_falls_on_every_adapter_alike() -> None:
    assert sequence(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]
    assert sequence(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                            (2, "a"), (2, "b"), (2, "c")]
    # the mean position of every adapter in two rounds is the same
    order = sequence(["a", "b", "c", "d"], 2)
    positions = {a: [i for i, (_, b) in enumerate(order) if b == a] for a in "abcd"}
    assert {sum(p) for p in positions.values()} == {7}


def test_short_steps_are_timed_until_they_add_up_to_the_minimum_time() -> None:
    assert timed_steps(3, 1.0, [2.0, 1.5, 1.9]) == 3  # a second-long step: the steps asked for
    assert timed_steps(3, 1.0, [0.010, 0.012, 0.011]) == 91  # ceil(1.0 / 0.011)
    assert timed_steps(3, 1.0, [1e-6, 1e-6, 1e-6]) == MAX_TIMED_STEPS
    assert timed_steps(3, 0.0, [0.010, 0.010, 0.010]) == 3  # no minimum time: exactly the steps
    assert timed_steps(3, 1.0, [0.0, 0.0, 0.0]) == MAX_TIMED_STEPS


def test_rounds_merge_into_one_row_and_a_failure_in_any_round_is_the_row() -> None:
    def ok(round_index: int, samples: list[float]) -> dict[str, Any]:
        return {**_row("ddp", 0, samples), "round": round_index, "position": round_index,
                "warmup_samples": [9.0], "rank_samples": [samples, [s / 2 for s in samples]], "init_s": 1.0}

    merged = merge_rounds([ok(1, [0.3]), ok(0, [0.1, 0.2])])
    assert len(merged) == 1
    row = merged[0]
    assert row["samples"] == [0.1, 0.2, 0.3] and row["steps_per_round"] == [2, 1] and row["rounds"] == 2
    assert row["rank_samples"] == [[0.1, 0.2, 0.3], [0.05, 0.1, 0.15]] and row["warmup_samples"] == [9.0, 9.0]
    assert "round" not in row and "position" not in row
    failed = {"kind": "result", "model": "m", "adapter": "ddp", "status": "error", "stage": 0,
              "error": "boom"}
    assert merge_rounds([ok(0, [0.1]), failed]) == [failed]
    by = {r["adapter"]: r for r in summarize([ok(0, [0.1, 0.2]), ok(1, [0.6])], ["m"])}
    assert by["ddp"]["median_s"] == 0.2 and by["ddp"]["max_s"] == 0.6


# ---- bad input: one line, exit 2, nothing launched --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--world", "0"], "world=0"),
        (["--world", "two"], "world='two'"),
        (["--steps", "0"], "steps=0"),
        (["--warmup", "-1"], "warmup=-1"),
        (["--adapters", "ddp,no-such-adapter"], "adapters='no-such-adapter'"),
        (["--adapters", "ddp,ddp"], "given twice"),
        (["--adapters", "no_such_module_for_zerosim:make_trainer"], "not found"),
        (["--models", "gpt,gpt-7t"], "model='gpt-7t'"),
        (["--dtype", "float16"], "dtype='float16'"),
        (["--device", "tpu"], "device='tpu'"),
        (["--optimizer", "lion"], "optimizer='lion'"),
        (["--timeout", "0"], "timeout='0'"),
        (["--rounds", "0"], "rounds=0"),
        (["--min-time", "-1"], "min_time='-1'"),
        (["--min-time", "inf"], "min_time='inf'"),
        (["--steps", str(MAX_TIMED_STEPS + 1)], f"steps={MAX_TIMED_STEPS + 1}"),
        (["--steps"], "expected one argument"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], expected: str, capsys: Any, tmp_path: Path
) -> None:
    code: int | str | None
    try:
        code = main(["bench", "peers", "--out", str(tmp_path / "out"), *args])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, captured
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert "Traceback" not in captured.err + captured.out
    assert not (tmp_path / "out" / "bench_peers.json").exists()


# ---- real launches ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: Any) -> tuple[subprocess.CompletedProcess, dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("peers")
    result = run_bench("--models", "gpt", "--adapters", "ddp,fsdp2", "--steps", "2", "--warmup", "1",
                       "--rounds", "2", "--min-time", "0.05", "--out", str(out))
    report = json.loads((out / "bench_peers.json").read_text()) if (out / "bench_peers.json").exists() else {}
    return result, report, out


@pytest.mark.torchdist
def test_a_tiny_run_writes_the_report(tiny_run: Any) -> None:
    result, report, out = tiny_run
    assert result.returncode == 0, result.stdout + result.stderr
    for key in ("machine", "torch", "device", "backend", "world", "dtype", "models", "results", "steps",
                "warmup", "wall_s", "load_average"):
        assert key in report, key
    assert (report["device"], report["backend"], report["world"], report["dtype"]) == ("cpu", "gloo", 2,
                                                                                       "float32")
    from zerosim.verify.model import build_model, parameter_count

    assert report["models"]["gpt"]["params"] == parameter_count(build_model("gpt")) and report["failed"] == []
    rows = {r["adapter"]: r for r in report["results"]}
    assert set(rows) == {"ddp", "fsdp2"}
    for name, stage in (("ddp", 0), ("fsdp2", 3)):
        r = rows[name]
        assert r["status"] == "ok" and r["stage"] == stage and r["stage_source"] == "declared"
        assert r["rounds"] == 2 and len(r["warmup_samples"]) == 2 and len(r["rank_samples"]) == 2
        assert all(s > 0 for s in r["samples"]) and len(r["samples"]) == sum(r["steps_per_round"])
        n = len(r["samples"])
        assert r["samples"] == [max(per_rank[k] for per_rank in r["rank_samples"]) for k in range(n)]
        at = 0
        for count in r["steps_per_round"]:  # each round: the most steps any rank wanted after its first 2
            wanted = [timed_steps(2, 0.05, per_rank[at:at + 2]) for per_rank in r["rank_samples"]]
            assert count == max(wanted) >= 2, (count, wanted)
            at += count
        assert r["median_s"] == statistics.median(r["samples"])
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["ratio_to_stage_peer"] == 1.0 and r["stage_peer"] == name  # alone in its stage
    fastest = min(rows.values(), key=lambda r: r["median_s"])
    assert fastest["ratio_to_fastest"] == 1.0
    for r in rows.values():
        assert r["ratio_to_fastest"] == pytest.approx(r["median_s"] / fastest["median_s"], rel=1e-12)
    markdown = (out / "bench_peers.md").read_text()
    assert "| gpt | ddp | 0 |" in markdown and "| gpt | fsdp2 | 3 |" in markdown
    assert "fsdp2" in result.stdout and "wrote" in result.stdout


@pytest.mark.torchdist
def test_a_failing_trainer_is_recorded_and_the_next_adapter_still_runs(tmp_path: Path) -> None:
    """Rank 1 raises in one trainer's step: that ends its launch and is recorded with the failing rank's
    line; the adapter after it is measured in a new launch."""
    raises = f"{BAD}:rank_raises_mid_run"
    result = run_bench("--models", "gpt", "--adapters", f"{raises},ddp", "--steps", "3", "--warmup", "0",
                       "--out", str(tmp_path))
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads((tmp_path / "bench_peers.json").read_text())
    rows = {r["adapter"]: r for r in report["results"]}
    assert rows["ddp"]["status"] == "ok" and rows["ddp"]["ratio_to_stage_peer"] == 1.0
    assert rows[raises]["status"] == "error" and rows[raises]["error"].startswith("rank 1 failed: ")
    assert "exp_avg is None" in rows[raises]["error"] and rows[raises]["stage"] is None
    assert "median_s" not in rows[raises] and rows[raises]["ratio_to_fastest"] is None
    assert report["failed"] == [{"model": "gpt", "adapter": raises, "error": rows[raises]["error"]}]
    assert result.stderr.strip().splitlines()[-1].startswith("error: 1 adapter run(s) failed")


def test_the_watchdog_ends_a_rank_whose_call_outlives_the_timeout(tmp_path: Path) -> None:
    """A trainer call that never returns (no collective to time out) ends the rank: exit 3, one line,
    the status file written for the launcher."""
    script = (
        "import time\n"
        "from zerosim.bench.peers_rank import CallWatchdog\n"
        "dog = CallWatchdog(0.5)\n"
        "with dog.limit('ddp on gpt: step 2'):\n"
        "    pass\n"
        "with dog.limit('ddp on gpt: step 3'):\n"
        "    time.sleep(60)\n"
    )
    env = {**os.environ, "ZEROGPU_STATUS_DIR": str(tmp_path), "RANK": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=GUARD_S)
    assert result.returncode == 3, result.stderr
    assert result.stderr.strip().splitlines() == [
        "rank 1 failed: CallTimeout: ddp on gpt: step 3 did not finish within 0.5s"
    ]
    assert (tmp_path / "rank1").read_text() == "3"
