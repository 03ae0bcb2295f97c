"""``zerosim verify --precision bf16|fp16 --reduce-dtype ...``: the options, the run value and the policy a
trainer receives as ``optim["mixed_precision"]``; bad input is one line and exit 2 before any rank starts."""

from __future__ import annotations

import subprocess

import pytest

from tests.test_verify_bad_input import error_line
from zerosim.cli.rank_commands import verify_rank_parser, verify_run_from_args
from zerosim.errors import ConfigError
from zerosim.verify.mixed_precision import LOSS_SCALE, policy
from zerosim.verify.run_value import VerifyRun


@pytest.mark.parametrize(
    "args, needles",
    [
        (["ddp", "--world", "2", "--precision", "fp8"],
         ["precision='fp8'", "bf16 (bfloat16) or fp16 (float16)"]),
        (["ddp", "--world", "2", "--precision", "fp16", "--dtype", "float64"],
         ["dtype='float64'", "master dtype is float32"]),
        (["ddp", "--world", "2", "--precision", "bf16", "--dtype", "float64"],
         ["dtype='float64'", "master dtype is float32"]),
        (["ddp", "--world", "2", "--reduce-dtype", "bfloat16"], ["reduce_dtype='bfloat16'", "--precision"]),
        (["ddp", "--world", "2", "--precision", "bf16", "--reduce-dtype", "float64"],
         ["reduce_dtype='float64'", "float32 (fp32), bfloat16 (bf16), float16 (fp16)"]),
        (["ddp", "--world", "2", "--precision", "bf16", "--reduce-dtype", "int8"], ["reduce_dtype='int8'"]),
    ],
    ids=["fp8", "fp16-float64", "bf16-float64", "reduce-without-precision", "reduce-float64", "reduce-int8"],
)
def test_bad_precision_options_are_one_line_exit_2(args: list[str], needles: list[str], capsys) -> None:
    """In process (the refusal comes before any rank starts): exit 2, one line naming field and value."""
    from zerosim.cli import main

    code = main(["verify", *args])
    out, err = capsys.readouterr()
    line = error_line(subprocess.CompletedProcess(args, code, out, err), 2)
    for needle in needles:
        assert needle in line, f"{needle!r} missing from: {line}"


def test_policy_is_absent_in_full_precision_and_complete_under_bf16_and_fp16() -> None:
    assert policy("full") is None
    assert policy("bf16") == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert policy("bf16", "bfloat16") == {"param_dtype": "bfloat16", "reduce_dtype": "bfloat16"}
    fp16 = policy("fp16")
    assert fp16 == {"param_dtype": "float16", "reduce_dtype": "float32", "loss_scale": LOSS_SCALE}
    assert fp16 is not None and fp16["loss_scale"] is not LOSS_SCALE  # a trainer may not change the default
    assert LOSS_SCALE == {"init": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                          "growth_interval": 1000}


def test_rank_options_give_float32_masters_under_precision_and_round_trip_the_run_file() -> None:
    args = verify_rank_parser().parse_args(["m:f", "--precision", "fp16", "--reduce-dtype", "float16"])
    run = verify_run_from_args(args, world=2).validate()
    assert (run.precision, run.reduce_dtype, run.dtype) == ("fp16", "float16", "float32")
    assert VerifyRun.from_json(run.to_json()) == run
    plain = verify_run_from_args(verify_rank_parser().parse_args(["m:f"]), world=2)
    assert (plain.precision, plain.reduce_dtype, plain.dtype) == ("full", "float32", "float64")


@pytest.mark.parametrize(
    "changes, field",
    [({"precision": "fp8"}, "precision"), ({"precision": "bf16"}, "dtype"),
     ({"reduce_dtype": "bfloat16"}, "reduce_dtype"), ({"precision": 3}, "precision")],
)
def test_a_run_file_with_a_bad_precision_field_is_refused_naming_it(changes: dict, field: str) -> None:
    data = {**VerifyRun("ddp", world=2).to_json(), **changes}
    with pytest.raises(ConfigError) as info:
        VerifyRun.from_json(data)
    assert info.value.field == field


def test_all_refuses_precision_before_the_first_cell(tmp_path, capsys) -> None:
    from zerosim.cli import main

    code = main(["verify", "--all", "--precision", "bf16", "--out", str(tmp_path / "m")])
    out, err = capsys.readouterr()
    line = error_line(subprocess.CompletedProcess([], code, out, err), 2)
    assert "precision='bf16'" in line
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("args", [["ddp", "--world", "1"], ["ddp", "--world", "1", "--precision", "bf16"]])
def test_a_full_precision_or_bf16_command_line_passes_the_precision_checks(args: list[str], capsys) -> None:
    """The command line's defaults (no --precision, no --reduce-dtype) are accepted: the run goes on to
    the next check, here the refusal of one rank."""
    from zerosim.cli import main

    code = main(["verify", *args])
    out, err = capsys.readouterr()
    line = error_line(subprocess.CompletedProcess(args, code, out, err), 2)
    assert "world=1" in line and "reduce_dtype" not in line, line
