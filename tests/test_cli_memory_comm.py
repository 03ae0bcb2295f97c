"""``zerosim memory`` and ``zerosim comm``: JSON in bytes, tables that name their unit, exit 2 on bad input.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zerosim.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_memory_json_reproduces_the_paper_for_every_strategy(capsys):
    code, out, _ = run_cli(
        capsys, "memory", "--params", "7.5e9", "--world-size", "64", "--strategy", "all", "--json"
    )
    assert code == 0
    data = json.loads(out)
    assert data["units"] == "bytes" and data["settings"]["K"] == 12
    totals = {name: s["per_rank"]["total"]["device"] for name, s in data["strategies"].items()}
    assert totals == {"no_shard": 120_000_000_000, "shard_optimizer": 31_406_250_000,
                      "shard_grad_op": 16_640_625_000, "full_shard": 1_875_000_000}
    for s in data["strategies"].values():
        for cat in ("params", "grads", "optimizer_states", "total"):
            assert set(s["per_rank"][cat]) == {"device", "host"}


def test_memory_all_strategies_in_one_call_at_a_trillion_params_on_1024_ranks(capsys):
    """No --strategy (or --strategy all): every strategy, hybrids too when there are several nodes."""
    code, out, _ = run_cli(
        capsys, "memory", "--params", "1e12", "--world-size", "1024", "--ranks-per-node", "8", "--json"
    )
    assert code == 0
    data = json.loads(out)
    psi, n = 10**12, 1024
    assert list(data["strategies"]) == ["no_shard", "shard_optimizer", "shard_grad_op", "full_shard",
                                        "hybrid_shard:8", "hybrid_shard_zero2:8"]
    expected = {
        "no_shard": (2 * psi, 2 * psi, 12 * psi),
        "shard_optimizer": (2 * psi, 2 * psi, 12 * psi // n),
        "shard_grad_op": (2 * psi, 2 * psi // n, 12 * psi // n),
        "full_shard": (2 * psi // n, 2 * psi // n, 12 * psi // n),
        "hybrid_shard:8": (2 * psi // 8, 2 * psi // 8, 12 * psi // 8),
        "hybrid_shard_zero2:8": (2 * psi, 2 * psi // 8, 12 * psi // 8),
    }
    for name, (p, g, o) in expected.items():
        r = data["strategies"][name]["per_rank"]
        assert (r["params"], r["grads"], r["optimizer_states"]) == (
            {"device": p, "host": 0}, {"device": g, "host": 0}, {"device": o, "host": 0}), name
        assert r["total"] == {"device": p + g + o, "host": 0}
    code, out, _ = run_cli(capsys, "memory", "--params", "1e12", "--world-size", "1024", "--strategy", "all",
                           "--offload", "optimizer", "--json")
    off = json.loads(out)["strategies"]["full_shard"]["per_rank"]
    assert off["optimizer_states"] == {"device": 0, "host": 12 * psi // n}


def test_memory_table_has_no_scientific_notation(capsys):
    code, out, _ = run_cli(capsys, "memory", "--params", "1e12", "--world-size", "1024")
    assert code == 0 and "e+" not in out and "16,000" in out  # DDP: 16 bytes x 10^12 = 16,000 GB
    assert "1,000,000,000,000 params" in out and "unit GB = 1,000,000,000 bytes" in out
    # a bare count has no blocks: the ZeRO-3 transient is unknown, shown as n/a (not as 0), and said why
    full_shard_row = next(line for line in out.splitlines() if "full_shard" in line)
    assert full_shard_row.count("n/a") == 2 and "--largest-block" in out
    code, out, _ = run_cli(
        capsys,
        "memory",
        "--params",
        "1e12",
        "--world-size",
        "1024",
        "--strategy",
        "zero3",
        "--largest-block",
        "1.024e9",
        "--json",
    )
    s = json.loads(out)["strategies"]["full_shard"]
    assert (
        s["transient_modelled"] and s["per_rank"]["transient"]["device"] == 2 * 1_024_000_000 * 2
    )  # (1 + prefetch) x 2 B


def test_memory_table_names_its_unit(capsys):
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5e9", "--world-size", "64", "--strategy", "zero3",
                           "--unit", "GiB")
    assert code == 0 and "GiB = 1,073,741,824 bytes" in out and "params [GiB]" in out
    assert "1.746" in out  # 1.875e9 bytes in GiB
    code, out, _ = run_cli(capsys, "memory", "--params", "7.5e9", "--world-size", "64", "--strategy", "zero1")
    assert "GB = 1,000,000,000 bytes" in out and "31.41" in out


def test_memory_with_a_preset_hybrid_offload_and_sgd(capsys):
    code, out, _ = run_cli(
        capsys,
        "memory",
        "--model",
        "gpt2-small",
        "--world-size",
        "16",
        "--ranks-per-node",
        "4",
        "--strategy",
        "hybrid_shard",
        "--offload",
        "params+optimizer",
        "--optimizer",
        "sgd-momentum",
        "--precision",
        "fp32",
        "--json",
    )
    assert code == 0
    s = json.loads(out)["strategies"]["hybrid_shard:4"]
    n = s["per_rank"]["numel"]["params"]
    assert s["shard_group_size"] == 4 and s["per_rank"]["params"] == {"device": 0, "host": 4 * n}
    assert s["per_rank"]["optimizer_states"]["host"] == 4 * n  # fp32 + SGD momentum: one 4-byte buffer
    assert s["per_rank"]["transient"]["device"] > 0


def test_memory_zero1_reduce_scatter_adds_the_reduce_transient(capsys):
    """``--zero1-reduce reduce_scatter`` (DeepSpeed stage 1): packed fp32 gradient + fp32 chunk during the
    reduce."""
    base = ["memory", "--params", "1003", "--world-size", "4", "--strategy", "zero1", "--precision", "bf16"]
    code, out, _ = run_cli(capsys, *base, "--zero1-reduce", "reduce_scatter", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["settings"]["zero1_grad_reduce"] == "reduce_scatter"
    transient = data["strategies"]["shard_optimizer"]["per_rank"]["transient"]
    assert transient == {
        "device": 1004 * 4 + 251 * 4,
        "phases": {"reduce": 1004 * 4 + 251 * 4, "optimizer": 251 * 4, "refresh": 1004 * 2 + 251 * 4},
    }
    code, out, _ = run_cli(capsys, *base, "--json")
    assert "reduce" not in json.loads(out)["strategies"]["shard_optimizer"]["per_rank"]["transient"]["phases"]
    code, out, _ = run_cli(capsys, *base, "--zero1-reduce", "reduce_scatter", "--unit", "B")
    assert code == 0 and "shard_optimizer (reduce_scatter)" in out


@pytest.mark.parametrize(
    "argv,field",
    [
        (["--params", "lots", "--world-size", "4"], "params"),
        (["--params", "0", "--world-size", "4"], "params"),
        (["--params=-1e9", "--world-size", "4"], "params"),
        (["--params", "-5", "--world-size", "4"], "params"),
        (["--params", "nan", "--world-size", "4"], "params"),
        (["--params", "inf", "--world-size", "4"], "params"),
        (["--params", "abc", "--world-size", "4"], "params"),
        (["--params", "1e9", "--world-size", "0"], "world-size"),
        (["--params", "1e9", "--world-size", "-8"], "world-size"),
        (["--params", "1e9", "--world-size", "two"], "world-size"),
        (["--params", "1e9", "--world-size", "6", "--ranks-per-node", "4"], "ranks-per-node"),
        (["--params", "1e9", "--world-size", "8", "--ranks-per-node", "0"], "ranks-per-node"),
        (["--params", "1e9", "--world-size", "8", "--strategy", "zero9"], "strategy"),
        (["--params", "1e9", "--world-size", "8", "--precision", "fp4"], "precision"),
        (["--params", "1e9", "--world-size", "8", "--prefetch-depth", "-1"], "prefetch-depth"),
        (["--params", "1e9", "--world-size", "8", "--unit", "parsecs"], "unit"),
        (["--params", "1e9", "--world-size", "8", "--zero1-reduce", "scatter"], "zero1_grad_reduce"),
        (
            ["--params", "1e9", "--world-size", "8", "--strategy", "zero2", "--offload", "params+optimizer"],
            "offload",
        ),
        (["--world-size", "8"], "params"),
        (["--model", "gpt5", "--world-size", "8"], "model"),
        (["--params", "7.5e9", "--largest-block", "1e20", "--world-size", "8"], "largest-block"),
        (["--params", "1.5", "--world-size", "8"], "params"),
    ],
)
def test_memory_bad_input_is_one_line_and_exit_2(capsys, argv, field):
    code, out, err = run_cli(capsys, "memory", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: invalid ") and field in err and err.count("\n") == 1


def test_argparse_errors_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["memory", "--params", "-1e9", "--world-size", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--params" in err


def test_bad_input_through_the_console_script_has_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "zerosim", "memory", "--params", "abc", "--world-size", "4"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "params" in proc.stderr


def test_params_in_exponent_notation_are_exact_integers(capsys):
    """``1e30`` is 10**30 exactly, not the float nearest it (1,000,000,000,000,000,019,884,624,838,656)."""
    code, out, _ = run_cli(capsys, "memory", "--params", "1e30", "--world-size", "8", "--json")
    assert code == 0 and json.loads(out)["total_params"] == 10**30


@pytest.mark.parametrize("command", ["memory", "comm"])
def test_a_reader_that_stops_early_ends_the_command_quietly(command):
    """``zerosim memory --json | head -1``: the pipe's reader has gone before the first write; the
    command exits 141 (128 + SIGPIPE, as shell tools do) with nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosim", command, "--params", "7.5e9", "--world-size", "64", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    proc.stdout.close()  # the reader goes away before the command has written anything
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""


def test_memory_compare_deepspeed_runs_with_or_without_deepspeed(capsys):
    code, out, err = run_cli(
        capsys,
        "memory",
        "--model",
        "gpt2-small",
        "--world-size",
        "8",
        "--ranks-per-node",
        "4",
        "--compare-deepspeed",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert len(report["rows"]) == 5 and report["num_nodes"] == 2
    code, _, err = run_cli(capsys, "memory", "--params", "1e9", "--world-size", "8", "--compare-deepspeed")
    assert code == 2 and "model" in err


def test_memory_compare_deepspeed_degrades_to_the_labelled_formula_without_deepspeed(capsys, monkeypatch):
    """Without deepspeed (an optional extra): the table shows zerosim's restatement, labelled so."""
    import zerosim.cost.deepspeed_compare as dsc

    monkeypatch.setattr(dsc, "deepspeed_available", lambda: False)
    code, out, err = run_cli(
        capsys,
        "memory",
        "--model",
        "gpt2-small",
        "--world-size",
        "16",
        "--ranks-per-node",
        "8",
        "--compare-deepspeed",
    )
    assert code == 0 and "deepspeed is not installed" in err
    assert "DS formula gpu" in out and "formula restated by zerosim" in out and "DS real" not in out
    code, out, _ = run_cli(
        capsys,
        "memory",
        "--model",
        "gpt2-small",
        "--world-size",
        "16",
        "--ranks-per-node",
        "8",
        "--compare-deepspeed",
        "--json",
    )
    report = json.loads(out)
    assert all(r["ds_real"] is None for r in report["rows"]) and "restated" in report["deepspeed"]


def test_a_broken_deepspeed_install_falls_back_to_the_formula(monkeypatch):
    import zerosim.cost.deepspeed_compare as dsc
    from zerosim.values.layout import ParamLayout

    def broken(*args, **kwargs):
        raise ImportError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(dsc, "deepspeed_available", lambda: True)
    monkeypatch.setattr(dsc, "deepspeed_estimator_real", broken)
    report = dsc.compare_with_deepspeed(ParamLayout.from_config("tiny"), 2, 2)
    assert "estimator failed (ImportError: libcudart" in report["deepspeed"]
    assert all(r["ds_real"] is None and r["ds_formula"]["gpu"] > 0 for r in report["rows"])


def test_comm_json_has_the_paper_multiples_and_link_split(capsys):
    code, out, _ = run_cli(capsys, "comm", "--params", "7.5e9", "--world-size", "64", "--ranks-per-node", "8",
                           "--strategy", "all", "--json")
    assert code == 0
    data = json.loads(out)["strategies"]
    psi, n = 7_500_000_000, 64
    ring = (n - 1) / n
    assert data["no_shard"]["per_rank"]["elements_sent"] == pytest.approx(2 * ring * psi)
    assert data["shard_grad_op"]["per_rank"]["elements_sent"] == pytest.approx(2 * ring * psi)
    assert data["full_shard"]["per_rank"]["elements_sent"] == pytest.approx(3 * ring * psi)
    for s in data.values():  # intra + inter = everything each rank sends
        links = s["links_mean_sent"]
        assert links["intra"] + links["inter"] == pytest.approx(s["per_rank"]["bytes_sent"])
    # hybrid: the cross-node all-reduce moves only the shard (1/k of the model)
    h = data["hybrid_shard:8"]
    rep = [c for c in h["collectives"] if c["group_kind"] == "replicate"][0]
    assert rep["payload_elements"] == psi // 8 and rep["group_size"] == 8
    assert h["links_mean_sent"]["inter"] < data["no_shard"]["links_mean_sent"]["inter"]


def test_comm_json_splits_every_collective_by_link_class(capsys):
    code, out, _ = run_cli(
        capsys, "comm", "--params", "1e9", "--world-size", "32", "--ranks-per-node", "8", "--json"
    )
    assert code == 0
    data = json.loads(out)["strategies"]
    for name, s in data.items():
        rows = s["collectives_by_link"]
        assert len(rows) == len(s["collectives"])
        for row, coll in zip(rows, s["collectives"], strict=True):
            assert row["collective"] == coll["collective"] and row["group_kind"] == coll["group_kind"]
            for unit in ("bytes_sent", "elements_sent"):
                assert row["intra"][unit] + row["inter"][unit] == pytest.approx(coll[unit])
        for cls in ("intra", "inter"):
            assert sum(r[cls]["bytes_sent"] for r in rows) == pytest.approx(s["links_mean_sent"][cls]), (
                name,
                cls,
            )
    # a world ring over 4 nodes of 8: one rank in 8 sends across nodes
    ar = data["no_shard"]["collectives_by_link"][0]
    assert ar["inter"]["bytes_sent"] == pytest.approx(ar["intra"]["bytes_sent"] / 7)
    # hybrid: shard-group collectives stay inside the node, the replica all-reduce crosses nodes
    for row in data["hybrid_shard:8"]["collectives_by_link"]:
        crossing = row["group_kind"] == "replicate"
        assert (row["inter"]["bytes_sent"] > 0) == crossing and (row["intra"]["bytes_sent"] > 0) != crossing


def test_comm_table_and_bad_input(capsys):
    code, out, _ = run_cli(
        capsys, "comm", "--model", "tiny", "--world-size", "4", "--strategy", "zero3", "--unit", "KiB"
    )
    assert code == 0 and "sent [KiB]" in out and "KiB = 1,024 bytes" in out and "full_shard" in out
    for argv, field in ((["--params", "x", "--world-size", "4"], "params"),
                        (["--params", "0", "--world-size", "4"], "params"),
                        (["--params", "-5", "--world-size", "4"], "params"),
                        (["--params", "nan", "--world-size", "4"], "params"),
                        (["--params", "inf", "--world-size", "4"], "params"),
                        (["--params", "1e6", "--world-size", "-2"], "world-size"),
                        (["--params", "1e6", "--world-size", "8", "--ranks-per-node", "0"], "ranks-per-node"),
                        (["--params", "1e6", "--world-size", "0"], "world-size"),
                        (["--params", "1e6", "--world-size", "8", "--ranks-per-node", "3"], "ranks-per-node"),
                        (["--params", "1e6", "--world-size", "8", "--micro-batches", "0"], "micro-batches")):
        code, out, err = run_cli(capsys, "comm", *argv)
        assert code == 2 and out == "" and field in err and err.count("\n") == 1
