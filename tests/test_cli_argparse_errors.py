"""Bad input argparse finds itself (an unknown option, a missing value, a choice outside the list, a number
that does not parse, a missing argument) is one line, ``error: invalid FIELD...``, and exit status 2 in
every subcommand, as every other bad input is; precision and dtype options take both spellings
(bf16 / bfloat16, fp32 / float32, ...) and mean the same by either."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from zerosim.cli import build_parser, main
from zerosim.cli.verify import precision_options
from zerosim.errors import ConfigError
from zerosim.values.dtypes import precision_name

#: every subcommand, with the words that reach its own parser and its required arguments
COMMANDS = [["plan"], ["check", "partition"], ["simulate"], ["mutants"], ["memory", "--world", "2"],
            ["comm", "--world", "2"], ["report"], ["bench", "peers"], ["verify"],
            ["checkpoint", "inspect", "DIR"], ["gpu-check"]]


def _refusal(argv: list[str], capsys: Any) -> str:
    """The one stderr line ``zerosim argv`` ends with; it must exit 2 and print nothing else."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert info.value.code == 2, (argv, err)
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: invalid "), (argv, err)
    assert "usage:" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("words", COMMANDS, ids=[" ".join(w[:2]) for w in COMMANDS])
def test_an_unknown_option_is_one_line_naming_it_and_the_command(words: list[str], capsys: Any) -> None:
    line = _refusal([*words, "--no-such-option"], capsys)
    command = " ".join(w for w in words if w.islower() and not w.startswith("-") and not w.isdigit())
    assert "option='--no-such-option'" in line and f"zerosim {command} takes no such option" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["simulate", "--backend", "cluster"], "invalid backend='cluster': must be one of sim, mpi, torch"),
        (["simulate", "--steps", "three"], "invalid steps='three': must be an integer"),
        (["simulate", "--lr", "fast"], "invalid lr='fast': must be a number"),
        (["simulate", "--strategy"], "invalid strategy: --strategy expected one argument"),
        (["bench", "peers", "--steps"], "invalid steps: --steps expected one argument"),
        (["checkpoint", "inspect"], "invalid path: zerosim checkpoint inspect needs PATH"),
        (["memory", "--model", "tiny"], "invalid world_size: zerosim memory needs --world-size/--world"),
        (["memory", "--params", "1e9", "--model", "tiny", "--world", "2"],
         "invalid model: --model cannot be given with --params"),
        (["no-such-command"], "invalid command='no-such-command': must be one of plan, check, simulate"),
        (["plan", "extra-word"], "invalid argument='extra-word': zerosim plan takes no such argument"),
    ],
)
def test_argparse_refusals_name_the_field_and_the_value(argv: list[str], expected: str, capsys: Any) -> None:
    assert expected in _refusal(argv, capsys)


def test_the_installed_command_exits_2_with_the_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "zerosim", "simulate", "--precision", "fp8"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: invalid precision='fp8': must be one of fp32 (float32), bf16 (bfloat16), fp16 (float16)"]


# ---- both spellings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("short", "long"), [("fp64", "float64"), ("fp32", "float32"), ("bf16", "bfloat16"),
                                             ("fp16", "float16")])
def test_precision_name_is_the_short_name_whichever_spelling(short: str, long: str) -> None:
    assert precision_name(short) == precision_name(long) == precision_name(long.upper()) == short
    assert precision_name(f"torch.{long}") == short


def test_precision_name_refuses_a_name_outside_the_allowed_ones_naming_the_field() -> None:
    with pytest.raises(ConfigError) as info:
        precision_name("float64", "precision", allowed=("fp32", "bf16", "fp16"))
    assert (info.value.field, info.value.value) == ("precision", "float64")
    assert "fp32 (float32), bf16 (bfloat16), fp16 (float16)" in str(info.value)


def _simulate_json(precision: str, capsys: Any) -> dict[str, Any]:
    code = main(["simulate", "--precision", precision, "--steps", "1", "--world-size", "2", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_simulate_trains_the_same_run_under_bf16_and_bfloat16(capsys: Any) -> None:
    short, long = _simulate_json("bf16", capsys), _simulate_json("bfloat16", capsys)
    assert short["config"]["precision"] == long["config"]["precision"] == "bf16"
    assert short["verdicts"] == long["verdicts"]


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--precision", "bfloat16", "--reduce-dtype", "bf16"], ("bf16", "bfloat16", "float32")),
        (["--precision", "bf16", "--reduce-dtype", "bfloat16"], ("bf16", "bfloat16", "float32")),
        (["--precision", "float16", "--reduce-dtype", "fp32"], ("fp16", "float32", "float32")),
        (["--precision", "fp32"], ("full", "float32", "float32")),
        (["--precision", "float64"], ("full", "float32", "float64")),
        (["--precision", "fp32", "--dtype", "float32"], ("full", "float32", "float32")),
        (["--dtype", "fp32"], ("full", "float32", "float32")),
        ([], ("full", "float32", "float64")),
    ],
)
def test_verify_reads_both_spellings_of_precision_reduce_dtype_and_dtype(
    options: list[str], expected: tuple[str, str, str]
) -> None:
    args = build_parser("verify").parse_args(["verify", "ddp", *options])
    assert precision_options(args) == expected


def test_verify_refuses_a_precision_that_contradicts_dtype(capsys: Any) -> None:
    code = main(["verify", "ddp", "--world", "2", "--precision", "fp32", "--dtype", "float64"])
    err = capsys.readouterr().err.strip()
    expected = "error: invalid dtype='float64': --precision fp32 trains everything in float32"
    assert code == 2 and err.startswith(expected), err


def test_memory_reads_bfloat16_as_bf16(capsys: Any) -> None:
    tables = []
    for spelling in ("bf16", "bfloat16"):
        assert main(["memory", "--model", "tiny", "--world", "4", "--precision", spelling, "--json"]) == 0
        tables.append(json.loads(capsys.readouterr().out))
    assert tables[0] == tables[1]


def test_bench_peers_reads_fp64_as_float64(capsys: Any, tmp_path: Any) -> None:
    """The dtype is accepted in its short spelling: the run goes on to the next check, the world size."""
    code = main(["bench", "peers", "--dtype", "fp64", "--world", "0", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: invalid world=0"), err
    code = main(["bench", "peers", "--dtype", "bf16", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    expected = "error: invalid dtype='bf16': must be one of float32 (fp32), float64 (fp64)"
    assert code == 2 and err == expected, err
