"""Fuzzing the public entry points: random, mostly invalid, inputs to the CLI commands and the Python API.

The property: whatever comes in, only zerosim's own exception type comes out (the CLI turns it into
one line and exit status 2), every command ends with a documented exit status, and nothing runs
unbounded. The CLI options are read from the parser itself, so a new option is fuzzed as soon as it
exists. Values mix the plausible (small sizes, real names) with the hostile: zero, negatives,
10^30, NaN, empty strings, junk; each example must finish within ``EXAMPLE_LIMIT_S`` (valid sizes are
kept small: a legitimately large valid run is a benchmark, not a fuzz case; a hostile size must be
refused up front, which is fast).

``ZEROSIM_FUZZ_EXAMPLES`` sets the number of examples per test (default 150; the closing run of a
change uses thousands).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from zerosim.cli import build_parser, main
from zerosim.errors import ZeroSimError

EXAMPLES = int(os.environ.get("ZEROSIM_FUZZ_EXAMPLES", "150"))
EXAMPLE_LIMIT_S = 60
EXIT_STATUSES = {0, 1, 2, 3}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

#: options never fuzzed: they start other processes (slow launches are tested elsewhere) or write files
SKIPPED = {"--backend", "--out", "--impl", "--inject-nan", "--help", "-h"}
COMMANDS = {"plan": ["plan"], "check partition": ["check", "partition"], "simulate": ["simulate"],
            "memory": ["memory"], "comm": ["comm"]}

SMALL = st.integers(-3, 9).map(str)
HOSTILE = st.sampled_from(["0", "-1", "1e30", "99999999999999999999", "18446744073709551617", "nan", "inf",
                           "-inf", "", " ", "abc", "0.5", "1e-9", "1.5e3", "none", "2**10", "1..3", "4,2",
                           "hybrid_shard:0", "hybrid_shard:3", "0x10"])
NAMES = st.sampled_from(["tiny", "sim-10m", "gpt2-small", "gpt-7.5b", "zero1", "zero2", "zero3", "no_shard",
                         "hybrid_shard:2", "fsdp", "seed", "deepspeed", "zero-redundancy", "sgd", "adam",
                         "adamw", "fp16", "bf16", "fp32", "mixed", "float32", "GB", "MiB", "stale-params",
                         "padding-leak", "shard-off-by-one", "broadcast", "seed"])
VALUES = st.one_of(SMALL, HOSTILE, NAMES, st.text(max_size=5))


def _options(words: list[str]) -> list[tuple[str, bool]]:
    """(option string, takes a value) of the sub-command reached by ``words``."""
    parser: argparse.ArgumentParser = build_parser()
    for word in words:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    out = []
    for action in parser._actions:
        flags = [s for s in action.option_strings if s.startswith("--")]
        if flags and flags[0] not in SKIPPED:
            out.append((flags[0], action.nargs != 0))
    return out


OPTIONS = {name: _options(words) for name, words in COMMANDS.items()}


@st.composite
def command_lines(draw: Any) -> list[str]:
    name = draw(st.sampled_from(sorted(COMMANDS)))
    argv = list(COMMANDS[name])
    for flag, takes_value in draw(st.lists(st.sampled_from(OPTIONS[name]), max_size=6)):
        argv.append(flag)
        if takes_value:
            argv.append(draw(VALUES))
    if name == "simulate":
        argv += ["--steps", draw(st.sampled_from(["1", "2"])), "--timeout", "30"]
    if name == "check partition" and not any(a in argv for a in ("--partitioner",)):
        argv += ["--partitioner", draw(st.sampled_from(["seed", "fsdp", "deepspeed", "nope"]))]
    return argv


class Unbounded(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int, what: Any) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Unbounded(f"{what} ran longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_cli(argv: list[str]) -> int:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit(EXAMPLE_LIMIT_S, argv):
        try:
            code = main(argv)
        except SystemExit as e:  # argparse rejects unknown choices and missing values with exit 2
            code = e.code if isinstance(e.code, int) else 2
    if code == 2:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        assert lines and not any("Traceback" in line for line in lines), (argv, err.getvalue())
    return code


@FUZZ
@given(command_lines())
def test_every_command_line_ends_with_a_documented_status_and_no_traceback(argv: list[str]) -> None:
    code = run_cli(argv)
    event(f"{argv[0]} exit {code}")  # --hypothesis-show-statistics: how many ran, failed, were refused
    assert code in EXIT_STATUSES, (argv, code)


# ---- the Python API -----------------------------------------------------------------------------------

ANY = st.one_of(st.none(), st.booleans(), st.integers(-2, 9), st.sampled_from([10**30, -10**30, 2**63]),
                st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), NAMES,
                st.lists(st.integers(-1, 4), max_size=3))

RUN_FIELDS = ("model", "world_size", "strategy", "partitioner", "optimizer", "precision", "steps",
              "micro_batches", "seed", "ranks_per_node", "lr", "max_grad_norm", "batch_size", "seq_len",
              "offload", "prefetch", "timeout_s", "observe", "fault", "load", "reshard_at",
              "zero1_grad_reduce")


@FUZZ
@given(st.dictionaries(st.sampled_from(RUN_FIELDS), ANY, max_size=5))
def test_run_config_accepts_or_refuses_with_our_error(fields: dict[str, Any]) -> None:
    from zerosim.engine.config import RunConfig

    with time_limit(EXAMPLE_LIMIT_S, fields):
        try:
            RunConfig(**fields).resolve()
        except ZeroSimError:
            pass


@FUZZ
@given(st.sampled_from(["memory", "shard_sizes", "comm", "plan", "verify"]),
       st.lists(ANY, min_size=1, max_size=4))
def test_cost_plan_and_verify_functions_refuse_bad_arguments_with_our_error(entry: str,
                                                                            args: list[Any]) -> None:
    """The functions behind memory, comm, plan and verify: positional junk in, ZeroSimError (or a
    result) out."""
    from zerosim.cost import comm_model, memory_model
    from zerosim.values.layout import ParamLayout, TensorSpec
    from zerosim.values.plan import build_plan
    from zerosim.values.strategy import ShardingStrategy, Topology
    from zerosim.verify.runner import validate_options

    def call() -> None:
        if entry == "shard_sizes":
            memory_model.shard_sizes(*args[:2])
        elif entry == "memory":
            memory_model.memory_per_rank(*args)
        elif entry == "comm":
            comm_model.comm_per_step(*args)
        elif entry == "plan":
            layout = ParamLayout([TensorSpec("w", (4, 3))])
            partitioner = str(args[1]) if len(args) > 1 else "seed"
            build_plan(layout, ShardingStrategy.parse(str(args[0])), partitioner,
                       Topology(args[2] if len(args) > 2 else 2, 1))
        else:
            keys = ("world", "steps", "dtype", "device", "model", "optimizers", "timeout_s")
            validate_options(**{k: (args[i] if i < len(args) else d) for i, (k, d) in enumerate(zip(
                keys, (2, None, "float64", "cpu", "gpt", "sgd,adamw", None), strict=True))})

    with time_limit(EXAMPLE_LIMIT_S, (entry, args)):
        try:
            call()
        except ZeroSimError:
            pass
        except TypeError as e:  # a wrong *number* of positional arguments is Python's, not a value check
            if "positional argument" not in str(e) and "required" not in str(e):
                raise


@pytest.mark.parametrize("argv", [
    ["plan", "--world-size", "99999999999999999999"],
    ["check", "partition", "--partitioner", "seed", "--total", "100", "--world-size", "1000000000"],
    ["simulate", "--model", "tiny", "--world-size", "10000"],
    ["memory", "--params", "1e30", "--world-size", "0"],
    ["simulate", "--micro-batches", "99999999999999999999"],   # found by the fuzzer: ran unbounded
    ["simulate", "--steps", "200000"],
    ["simulate", "--batch-size", "100000000", "--seq-len", "100000000"],
])
def test_the_sizes_from_the_field_reports_end_quickly(argv: list[str]) -> None:
    """Each of these ran for minutes or without end; now each is refused (exit 2) before any work."""
    assert run_cli(argv) == 2
