"""``zerosim plan`` and ``zerosim check partition``: output, JSON, exit statuses, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerosim.cli import main
from zerosim.engine.config import RunConfig
from zerosim.numerics.model import SimModelConfig, sim_layout
from zerosim.values.layout import ParamLayout
from zerosim.values.presets import PRESETS, simulator_presets


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- zerosim plan ----------------------------------------------------------------------------------------
def test_plan_with_no_arguments_uses_the_documented_defaults(capsys):
    code, out, err = run(capsys, "plan")
    assert code == 0 and err == ""
    assert "gpt2-small" in out and "124,439,808" in out and "full_shard" in out and "seed" in out
    assert out.count("15,554,976") >= 8  # 124,439,808 / 8 on every rank
    assert "C-ZERO-001 holds" in out


def test_plan_json_is_complete_and_consistent(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "4", "--strategy", "zero2",
                       "--partitioner", "deepspeed", "--json", "--intervals")
    assert code == 0
    data = json.loads(out)
    total = ParamLayout.from_config("tiny").total_numel
    assert data["total_numel"] == total and data["world_size"] == 4 and data["zero_stage"] == 2
    assert data["sharded"] == {"params": False, "grads": True, "optimizer": True}
    assert len(data["ranks"]) == 4
    assert sum(r["grads"]["numel"] for r in data["ranks"]) == total
    assert all(r["params"]["numel"] == total for r in data["ranks"])
    assert all(r["optimizer"]["adam_state_bytes"] == 8 * r["optimizer"]["numel"] for r in data["ranks"])
    assert data["check"]["passed"] is True and data["check"]["contract"] == "C-ZERO-001"
    assert len(data["shard_plan"]["shards"]) == 4


def test_plan_hybrid_json_groups(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "8", "--strategy", "hybrid_shard",
                       "--ranks-per-node", "4", "--json")
    data = json.loads(out)
    assert code == 0 and data["shard_group_size"] == 4 and data["num_shard_groups"] == 2
    assert [r["shard_group"] for r in data["ranks"]] == [0] * 4 + [1] * 4
    assert data["ranks"][1]["params"] == data["ranks"][5]["params"]


def test_plan_for_1024_ranks_elides_the_middle_and_says_so(capsys):
    code, out, _ = run(capsys, "plan", "--world-size", "1024", "--partitioner", "contiguous")
    assert code == 0
    lines = out.splitlines()
    assert len(lines) < 45
    assert "1008 of 1024 ranks elided" in out and "+1008 ranks" in out
    assert any(line.lstrip().startswith("1023 ") for line in lines)
    assert any(line.lstrip().startswith("min ") for line in lines)
    assert "frac (bytes)" in out  # block partitioner: both fractions shown


def test_plan_all_ranks_shows_every_rank(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "40", "--all-ranks")
    assert code == 0 and "elided" not in out
    assert [
        int(line.split()[0]) for line in out.splitlines() if line.split() and line.split()[0].isdigit()
    ] == list(range(40))


@pytest.mark.parametrize("argv, field", [
    (["--world-size", "0"], "world_size"),
    (["--world-size", "-4"], "world_size"),
    (["--ranks-per-node", "3"], "ranks_per_node"),
    (["--ranks-per-node", "0"], "ranks_per_node"),
    (["--strategy", "hybrid_shard:3"], "intra_node_size"),
    (["--strategy", "hybrid_shard:0"], "intra_node_size"),
    (["--strategy", "zero9"], "strategy"),
    (["--partitioner", "magic"], "partitioner"),
    (["--model", "gpt-9000"], "model"),
    (["--dtype", "complex7"], "dtype"),
])
def test_plan_bad_input_is_one_line_and_exit_2(capsys, argv, field):
    code, out, err = run(capsys, "plan", *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"error: invalid {field}=") and err.count("\n") == 1
    assert "Traceback" not in err


# ---- one preset name, one model ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(PRESETS))
def test_a_preset_name_is_the_same_model_in_plan_memory_and_simulate(capsys, name):
    layout = ParamLayout.from_config(name)  # what plan, memory, comm and check partition --model build
    code, out, _ = run(capsys, "plan", "--model", name, "--world-size", "4", "--json")
    assert code == 0 and json.loads(out)["total_numel"] == layout.total_numel
    code, out, _ = run(capsys, "memory", "--model", name, "--world-size", "4", "--json")
    assert code == 0 and json.loads(out)["total_params"] == layout.total_numel
    if name in simulator_presets():
        simulated = RunConfig(model=name, world_size=2).resolve().layout
        assert simulated.tensors == layout.tensors and simulated.aliases == layout.aliases
        assert simulated.blocks == layout.blocks
        assert simulated.tensors == sim_layout(SimModelConfig.from_preset(name)).tensors
        if name == "tiny":  # end to end through the command for the toy (a sim-10m run takes ~15 s)
            code, out, err = run(capsys, "simulate", "--model", name, "--world-size", "2", "--steps", "1",
                                 "--json")
            assert code == 0, err
            assert json.loads(out)["config"]["num_params"] == layout.total_numel
    else:
        code, out, err = run(capsys, "simulate", "--model", name, "--steps", "1")
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and "Traceback" not in err
        assert f"model={name!r}" in err and "block models" in err
        assert all(sim in err for sim in simulator_presets()) and "plan, memory and comm" in err


# ---- zerosim check partition -----------------------------------------------------------------------------
def test_check_partition_correct_impl_exit_0(capsys):
    code, out, _ = run(capsys, "check", "partition", "--impl", "examples.my_partitioner:even_split")
    assert code == 0
    assert out.strip().splitlines()[-1].startswith("C-ZERO-001 holds for examples.my_partitioner:even_split")
    assert "1170 cases" in out


def test_check_partition_buggy_impl_limit_0_lists_every_case_under_its_kind_exit_1(capsys):
    code, out, _ = run(
        capsys,
        "check",
        "partition",
        "--impl",
        "examples.my_partitioner:last_rank_takes_remainder",
        "--world-sizes",
        "1..8",
        "--totals",
        "10,11",
        "--limit",
        "0",
    )
    assert code == 1
    lines = out.strip().splitlines()
    cases = [line for line in lines if line.startswith("  C-ZERO-001 balance ")]
    assert lines[0] == (f"C-ZERO-001 balance: {len(cases)} violations alike (shard holds # elements, not "
                        "within # of total // world_size = #)")
    assert len(lines) == len(cases) + 2 and f"{len(cases)} violations (balance x{len(cases)})" in lines[-1]
    assert "  C-ZERO-001 balance world_size=4 total=10 rank=3 expected=2 got=4" in out
    assert "violated" in lines[-1]


def test_check_partition_groups_violations_by_kind_with_the_first_cases(capsys, tmp_path, monkeypatch):
    """Two kinds of failure (an overlap at world 2, the last rank's remainder elsewhere): one line each
    with its count, its first three cases, how many more; the counts add up to the summary's."""
    (tmp_path / "two_kinds.py").write_text(
        "def split(rank, world_size, total):\n"
        "    base = total // world_size\n"
        "    if world_size == 2:\n"
        "        return (0, total) if rank == 0 else (total // 2, total)\n"
        "    start = rank * base\n"
        "    return (start, total if rank == world_size - 1 else start + base)\n")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "check", "partition", "--impl", "two_kinds.py:split", "--world-sizes", "1..8",
                       "--totals", "10,11")
    assert code == 1
    lines = out.strip().splitlines()
    heads = [line for line in lines if not line.startswith("  ")]
    assert heads[0] == "C-ZERO-001 disjoint: 2 violations alike (# elements owned by ranks # and #)"
    assert heads[1].startswith("C-ZERO-001 balance: 11 violations alike (shard holds # elements")
    assert "13 violations (balance x11, disjoint x2)" in heads[2] and len(heads) == 3
    balance = lines[lines.index(heads[1]) + 1:-1]
    assert len(balance) == 4 and balance[-1].startswith("  ... and 8 more like it"), balance
    assert all(line.startswith("  C-ZERO-001 balance world_size=") for line in balance[:3])


def test_check_partition_json(capsys):
    code, out, _ = run(capsys, "check", "partition", "--impl", "examples.my_partitioner:float_split",
                       "--world-size", "3", "--total", "2**61-1", "--json")
    data = json.loads(out)
    assert code == 1 and data["passed"] is False and data["cases"] == 1
    assert data["world_sizes"] == [3] and data["totals"] == [2**61 - 1]
    assert {v["contract"] for v in data["violations"]} == {"C-ZERO-001"}


def test_check_partition_builtin_at_10_12_by_1024(capsys):
    code, out, _ = run(capsys, "check", "partition", "--partitioner", "seed", "--total", "10**12",
                       "--world-size", "1024")
    assert code == 0 and "C-ZERO-001 holds for partitioner seed" in out and "1,024 intervals" in out
    code, out, _ = run(capsys, "check", "partition", "--partitioner", "deepspeed-zero3", "--model", "tiny",
                       "--world-sizes", "1..5,1024", "--json")
    data = json.loads(out)
    assert code == 0 and data["passed"] and [c["world_size"] for c in data["cases"]] == [1, 2, 3, 4, 5, 1024]


@pytest.mark.parametrize("argv, needle", [
    (["--impl", "examples.nope:fn"], "cannot import 'examples.nope'"),
    (["--impl", "examples.my_partitioner:nope"], "has no attribute 'nope'"),
    (["--impl", "no_colon"], "invalid impl="),
    (["--impl", "zerosim.testing.check_impl:as_intervals"], "raised TypeError"),
    (["--impl", "examples.my_partitioner:even_split", "--world-size", "0"], "invalid world_size=0"),
    (["--impl", "examples.my_partitioner:even_split", "--total", "-1"], "invalid total=-1"),
    (["--impl", "examples.my_partitioner:even_split", "--total", "ten"], "invalid total='ten'"),
    (["--impl", "examples.my_partitioner:even_split", "--balance", "fair"], "invalid balance='fair'"),
    (["--impl", "examples.my_partitioner:even_split", "--model", "tiny"], "invalid model='tiny'"),
    (["--partitioner", "magic"], "invalid partitioner='magic'"),
    (["--partitioner", "seed", "--balance", "1"], "invalid balance='1'"),
    (["--partitioner", "seed", "--model", "gpt-9000"], "invalid model='gpt-9000'"),
    ([], "invalid impl=None"),
])
def test_check_partition_bad_input_exit_2_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "check", "partition", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_check_without_target_prints_help_and_exits_2(capsys):
    code, out, _ = run(capsys, "check")
    assert code == 2 and "partition" in out


def test_console_script_end_to_end():
    exe = [sys.executable, "-m", "zerosim"]
    ok = subprocess.run(exe + ["plan", "--model", "tiny", "--world-size", "4", "--strategy", "zero3"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "C-ZERO-001 holds" in ok.stdout
    bad = subprocess.run(
        exe
        + [
            "check",
            "partition",
            "--impl",
            "examples.my_partitioner:last_rank_takes_remainder",
            "--world-sizes",
            "1..4",
            "--totals",
            "7",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "C-ZERO-001 balance" in bad.stdout and bad.stderr == ""


# ---- zerosim bench check (a smoke run at small sizes; timings are never asserted) -------------------------
def test_bench_check_writes_its_report(capsys, tmp_path):
    out_file = tmp_path / "bench_check.json"
    code, out, _ = run(capsys, "bench", "check", "--total", "10**12", "--world-size", "64", "--repeats", "2",
                       "--flag-sizes", "10**3,10**4", "--out", str(out_file))
    assert code == 0 and "wrote" in out
    data = json.loads(out_file.read_text())
    assert data["interval_check"]["passed"] is True and data["interval_check"]["intervals"] == 64
    assert [s["total"] for s in data["side_by_side"]] == [1000, 10000]
    big = data["flag_check_at_total"]
    assert big["bytes_needed"] == 10**12 and big["fits"] == (10**12 <= big["mem_available"])


def test_bench_check_rejects_flag_sizes_that_would_not_fit(capsys, tmp_path):
    code, _, err = run(capsys, "bench", "check", "--flag-sizes", "10**15", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "invalid flag_sizes=" in err
