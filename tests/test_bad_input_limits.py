"""Sizes a command cannot handle in bounded time are refused up front: one line naming the field,
the value and the limit, exit status 2, nothing written; a user partitioner that never answers or
answers without bound ends the check with one line naming the call."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from zerosim.cli import main
from zerosim.engine.config import MAX_SIM_WORLD_SIZE, RunConfig
from zerosim.errors import ConfigError, ImplementationError
from zerosim.partition import MAX_INTERVALS, MAX_WORLD_SIZE, get_partitioner
from zerosim.report.config import MAX_MEASURED_RANKS, MAX_MEASURED_WORLD_SIZE, ReportConfig
from zerosim.testing.check_impl import MAX_CALLS, MAX_RANGES, check_partition
from zerosim.values.layout import ParamLayout
from zerosim.values.plan import build_plan
from zerosim.values.strategy import FULL_SHARD, NO_SHARD, Topology


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerosim", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid "), err
    assert "Traceback" not in err
    return lines[0]


# ---- zerosim plan ----------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", ["99999999999999999999", "10000000", str(MAX_WORLD_SIZE + 1)])
def test_plan_refuses_worlds_above_the_limit_and_states_it(capsys, ws):
    code, out, err = run(capsys, "plan", "--world-size", ws)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert f"world_size={ws}" in line and f"at most {MAX_WORLD_SIZE:,}" in line


def test_build_plan_refuses_worlds_above_the_limit_even_when_nothing_is_sharded():
    layout = ParamLayout.from_config("tiny")
    with pytest.raises(ConfigError, match=f"at most {MAX_WORLD_SIZE:,}") as e:
        build_plan(layout, NO_SHARD, "seed", Topology(MAX_WORLD_SIZE + 1))
    assert e.value.field == "world_size"


def test_plan_at_a_large_but_allowed_world_is_summarised(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "4096", "--partitioner", "fsdp")
    assert code == 0 and "4080 of 4096 ranks elided" in out and "C-ZERO-001 holds" in out


# ---- partitioners ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["seed", "deepspeed", "deepspeed-zero3", "fsdp", "zero-redundancy",
                                  "round-robin", "contiguous"])
def test_every_builtin_partitioner_refuses_a_shard_group_above_the_limit(name):
    with pytest.raises(ConfigError, match=f"at most {MAX_WORLD_SIZE:,}") as e:
        get_partitioner(name)(ParamLayout.from_config("tiny"), MAX_WORLD_SIZE + 1)
    assert e.value.value == MAX_WORLD_SIZE + 1


@pytest.mark.parametrize("name", ["fsdp", "deepspeed-zero3"])
def test_per_tensor_partitioners_refuse_more_intervals_than_the_limit(name):
    layout = ParamLayout.from_config("gpt3-175b")  # 1,000+ tensors of 12,288+ rows each
    with pytest.raises(ConfigError, match=f"above the limit of {MAX_INTERVALS:,}"):
        get_partitioner(name)(layout, 4096)


@pytest.mark.parametrize("name", ["fsdp", "deepspeed-zero3"])
def test_per_tensor_partitioners_give_tail_ranks_padding_only(name):
    layout = ParamLayout.from_list([("a", (3, 2)), ("b", (5,)), ("c", ())])
    plan = get_partitioner(name)(layout, 8)
    stored = plan.meta["padded_shard_numel"]
    assert [s.numel + s.padding for s in plan.shards] == [stored] * 8
    assert sum(s.numel for s in plan.shards) == layout.total_numel
    assert plan.shards[-1].intervals == () and plan.shards[-1].padding == stored


# ---- zerosim check partition -----------------------------------------------------------------------
@pytest.mark.parametrize("ws", ["1000000000", "99999999999999999999"])
def test_check_partition_refuses_a_world_above_the_limit(capsys, ws):
    code, out, err = run(capsys, "check", "partition", "--partitioner", "seed", "--total", "100",
                         "--world-size", ws)
    assert code == 2 and out == ""
    assert f"world_size={ws}" in one_error_line(err) and f"at most {MAX_WORLD_SIZE:,}" in err


@pytest.mark.parametrize("what", [["--partitioner", "seed", "--total", "100"],
                                  ["--impl", "examples.my_partitioner:even_split"]])
def test_check_partition_refuses_a_sweep_above_the_call_limit(capsys, what):
    code, out, err = run(capsys, "check", "partition", *what, "--world-sizes", "1..2000")
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert "world_sizes='1..2000'" in line and "2,001,000" in line and f"{MAX_CALLS:,}" in line


def test_check_partition_api_refuses_the_sweep_before_calling_anything():
    calls = []

    def record(rank, ws, total):
        calls.append(rank)
        return (0, total) if rank == 0 else (total, total)

    with pytest.raises(ConfigError, match="calls"):
        check_partition(record, [MAX_WORLD_SIZE] * 16 + [1], [0])
    assert calls == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon", "1e9"])
def test_call_timeout_must_be_a_sensible_number_of_seconds(capsys, value):
    code, _, err = run(capsys, "check", "partition", "--impl", "examples.my_partitioner:even_split",
                       "--call-timeout", value)
    assert code == 2 and "call-timeout" in one_error_line(err)


def test_call_timeout_applies_to_impl_only(capsys):
    code, _, err = run(capsys, "check", "partition", "--partitioner", "seed", "--call-timeout", "5")
    assert code == 2 and "applies to --impl only" in one_error_line(err)


def test_a_result_above_the_range_limit_is_refused_naming_the_call():
    def five_million(rank, ws, total):
        return [(0, 1)] * 5_000_000

    with pytest.raises(ImplementationError) as e:
        check_partition(five_million, [2], [10])
    msg = str(e.value)
    assert "5,000,000 ranges" in msg and "(rank=0, world_size=2, total=10)" in msg
    assert f"at most {MAX_RANGES:,}" in msg


def test_ranges_are_counted_over_all_ranks_of_a_case():
    def half_each(rank, ws, total):
        return [(0, 1)] * (MAX_RANGES // 2 + 1)

    with pytest.raises(ImplementationError, match=r"\(rank=1, world_size=2, total=3\) after 524,289"):
        check_partition(half_each, [2], [3])


def test_an_impl_that_never_answers_ends_the_command_with_one_line(tmp_path):
    (tmp_path / "sleepy.py").write_text(textwrap.dedent("""
        import time

        def split(rank, world_size, total):
            if rank == 1:
                time.sleep(3600)
            return (0, total) if rank == 0 else (total, total)
    """))
    proc = run_cli("check", "partition", "--impl", "sleepy.py:split", "--world-size", "2", "--total", "4",
                   "--call-timeout", "0.5", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "impl sleepy.py:split" in lines[0] and "no answer within 0.5 s" in lines[0]
    assert "(rank=1, world_size=2, total=4)" in lines[0]


def test_an_impl_whose_import_never_finishes_ends_the_command_with_one_line(tmp_path):
    (tmp_path / "stuck.py").write_text("import time\n\ntime.sleep(3600)\n\n\ndef split(r, w, t):\n"
                                       "    return (0, t)\n")
    proc = run_cli("check", "partition", "--impl", "stuck.py:split", "--call-timeout", "0.5", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "importing the module did not finish within 0.5 s" in proc.stderr.strip()


def test_the_timeout_watch_passes_results_and_errors_through():
    def rule(rank, ws, total):
        base, rem = divmod(total, ws)
        start = rank * base + min(rank, rem)
        return (start, start + base + (rank < rem))

    assert check_partition(rule, [1, 3], [0, 7], call_timeout=5).passed
    assert check_partition(rule, [1, 3], [0, 7], call_timeout=None).passed

    def raises(rank, ws, total):
        raise KeyError("boom")

    with pytest.raises(ImplementationError, match="raised KeyError"):
        check_partition(raises, [2], [4], call_timeout=5)
    with pytest.raises(ConfigError, match="call_timeout"):
        check_partition(rule, [2], [4], call_timeout=0)


# ---- zerosim simulate ------------------------------------------------------------------------------
@pytest.mark.parametrize("ws", ["10000", "99999999999999999999", str(MAX_SIM_WORLD_SIZE + 1)])
def test_simulate_refuses_worlds_above_the_limit_and_states_it(capsys, ws):
    code, out, err = run(capsys, "simulate", "--model", "tiny", "--world-size", ws)
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert f"world_size={ws}" in line and f"at most {MAX_SIM_WORLD_SIZE} ranks" in line


def test_run_config_refuses_worlds_above_the_limit():
    with pytest.raises(ConfigError, match=f"at most {MAX_SIM_WORLD_SIZE} ranks"):
        RunConfig(world_size=MAX_SIM_WORLD_SIZE + 1).validate()


# ---- zerosim report --------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, limit", [("1000000", f"at most {MAX_MEASURED_WORLD_SIZE} ranks per"),
                                          ("99999999999999999999", "per measured world size"),
                                          ("8,16,30,32", f"at most {MAX_MEASURED_RANKS} ranks over all")])
def test_report_refuses_world_sizes_above_the_limit_and_writes_nothing(capsys, tmp_path, sizes, limit):
    out_dir = tmp_path / "report"
    code, out, err = run(capsys, "report", "--world-sizes", sizes, "--out", str(out_dir), "--quiet")
    line = one_error_line(err)
    assert code == 2 and out == ""
    assert "world-sizes=" in line and limit in line
    assert not out_dir.exists()


def test_report_config_refuses_world_sizes_above_the_limit():
    with pytest.raises(ConfigError, match="per measured world size"):
        ReportConfig(world_sizes=(MAX_MEASURED_WORLD_SIZE + 1,))


def test_topology_is_not_touched_by_the_plan_limit():
    # the limit is about building a per-rank plan; the topology of a large world stays a value
    assert Topology(2**40, 8).num_nodes == 2**37
    assert FULL_SHARD.shard_group_size(2**40) == 2**40


# ---- cost functions --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"num_nodes": 0}, "num_nodes"),
    ({"num_nodes": None}, "num_nodes"),
    ({"num_gpus_per_node": "8"}, "num_gpus_per_node"),
    ({"total_params": None}, "total_params"),
    ({"total_params": float("nan")}, "total_params"),
    ({"largest_layer_params": -1}, "largest_layer_params"),
    ({"additional_buffer_factor": float("inf")}, "additional_buffer_factor"),
])
def test_deepspeed_formula_refuses_bad_arguments_naming_the_field(kwargs, field):
    from zerosim.cost.deepspeed_compare import deepspeed_estimator_formula

    args = {"stage": 3, "total_params": 100, "largest_layer_params": 10, "num_gpus_per_node": 8,
            "num_nodes": 1}
    with pytest.raises(ConfigError) as e:
        deepspeed_estimator_formula(**{**args, **kwargs})
    assert e.value.field == field


def test_cost_helpers_refuse_values_of_the_wrong_type():
    from zerosim.cost.deepspeed_compare import largest_layer_numel
    from zerosim.cost.memory_model import all_strategies

    with pytest.raises(ConfigError, match="layout"):
        largest_layer_numel(7)
    with pytest.raises(ConfigError, match="topology"):
        all_strategies(8)
    assert len(all_strategies(Topology(16, 8))) == 6
