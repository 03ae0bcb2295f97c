"""zerogpu's pieces that need no launch: the simulator comparison, exit-status recovery, option checks.

(The launches themselves: tests/test_zerogpu_torchrun.py on gloo, tests/test_zerogpu_gpu.py on CUDA.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from zerogpu.agreement import bitwise_expected, compare_with_simulator  # noqa: E402
from zerogpu.equivalence import default_strategies, parse_strategies  # noqa: E402
from zerogpu.launch import ranks_status  # noqa: E402
from zerogpu.simulate import resolve_setup as resolve_job  # noqa: E402
from zerosim.cli.run_options import torch_rank_run, torch_simulate_parser  # noqa: E402
from zerosim.engine.run_file import RankRun  # noqa: E402
from zerosim.engine.spmd import RunConfig, simulate_observations  # noqa: E402
from zerosim.errors import EXIT_RUN_FAILED, ConfigError  # noqa: E402

RUN = RunConfig(model="tiny", world_size=2, strategy="zero2", steps=1, seed=7, observe="full")


@pytest.fixture(scope="module")
def sim_run() -> list:
    return simulate_observations(RUN)


def test_the_comparison_accepts_the_same_run_bitwise(sim_run: list) -> None:
    again = simulate_observations(RunConfig(model="tiny", world_size=2, strategy="zero2", steps=1, seed=7,
                                            observe="full"))
    summary = compare_with_simulator(again, sim_run, run=RUN.validate(), bitwise=True)
    assert summary["agrees"] and summary["bitwise_equal"] and summary["elements_compared"] > 0, summary


def test_the_comparison_catches_another_run(sim_run: list) -> None:
    other = simulate_observations(RunConfig(model="tiny", world_size=2, strategy="zero2", steps=1, seed=8,
                                            observe="full"))
    summary = compare_with_simulator(other, sim_run, run=RUN.validate(), bitwise=False)
    assert not summary["agrees"] and summary["max_abs_diff"] > 1e-3 and summary["problems"], summary


def test_the_bitwise_comparison_catches_one_ulp(sim_run: list) -> None:
    tweaked = simulate_observations(RunConfig(model="tiny", world_size=2, strategy="zero2", steps=1, seed=7,
                                              observe="full"))
    master = tweaked[1].steps[0].master.values
    master[3] = np.nextafter(master[3], np.float32(np.inf))
    assert compare_with_simulator(tweaked, sim_run, run=RUN.validate(), bitwise=False)["agrees"]  # one ulp
    summary = compare_with_simulator(tweaked, sim_run, run=RUN.validate(), bitwise=True)
    assert not summary["agrees"] and summary["elements_differing"] == 1
    assert "rank 1 step 0 master: 1 of" in summary["problems"][0]


def test_bitwise_is_promised_for_numpy_arrays_and_groups_of_at_most_two() -> None:
    def run(world: int, strategy: str):
        return RunConfig(model="tiny", world_size=world, strategy=strategy).validate()

    assert bitwise_expected(run(2, "zero3"), "numpy") and bitwise_expected(run(4, "hybrid_shard:2"), "numpy")
    assert not bitwise_expected(run(4, "zero3"), "numpy") and not bitwise_expected(run(2, "zero3"), "torch")


@pytest.mark.parametrize(
    ("torchrun", "written", "want"),
    [
        (0, {0: 0, 1: 0}, 0),
        (0, {0: 1, 1: 1}, 1),  # an agreed contract failure (ranks exit 0 under our launcher)
        (0, {0: 2, 1: 2}, 2),  # agreed bad input
        (1, {0: 1, 1: 1}, 1),  # a bare torchrun status file: still the verdict
        (1, {1: EXIT_RUN_FAILED}, EXIT_RUN_FAILED),  # rank 1 failed, rank 0 was SIGTERMed before writing
        (1, {0: 1, 1: EXIT_RUN_FAILED}, EXIT_RUN_FAILED),
        (1, {}, EXIT_RUN_FAILED),  # every rank died without a word (signal, OOM)
        (1, {0: 0}, EXIT_RUN_FAILED),  # torchrun failed though the ranks that wrote succeeded
    ],
)
def test_the_launcher_recovers_the_ranks_status(torchrun: int, written: dict, want: int) -> None:
    assert ranks_status(torchrun, written, 2) == want


def test_default_strategies_cover_every_kind_at_each_world_size() -> None:
    assert default_strategies(1)[-2:] == ["hybrid_shard:1", "hybrid_shard_zero2:1"]
    assert default_strategies(4)[-2:] == ["hybrid_shard:2", "hybrid_shard_zero2:2"]
    assert parse_strategies("all", 2) == default_strategies(2)
    assert parse_strategies(" zero3 , zero1 ", 2) == ["zero3", "zero1"]
    with pytest.raises(ConfigError, match="strategies"):
        parse_strategies(" , ", 2)


def test_the_option_choices_are_the_communicators() -> None:
    import zerogpu.comm as comm
    from zerosim.engine.run_file import BACKEND_OPTIONS

    torch = BACKEND_OPTIONS["torch"]
    assert (torch["dist_backend"], torch["reduce_scatter"], torch["all_gather"]) == (
        comm.DIST_BACKENDS,
        comm.REDUCE_SCATTER_MODES,
        comm.ALL_GATHER_MODES,
    )


def _job(*argv: str) -> RankRun:
    """The run the torchrun rank options describe, as every rank loads it."""
    return torch_rank_run(torch_simulate_parser().parse_args(list(argv)))


def resolve_setup(make_job: Callable[[], RankRun]) -> tuple[Any, str, str]:
    return resolve_job(make_job())


def test_bad_input_names_the_field_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ConfigError, match="launcher"):
        resolve_setup(lambda: _job())
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match=r"world_size=2: torchrun started 3 rank\(s\)"):
        resolve_setup(lambda: _job("--world-size", "2"))
    with pytest.raises(ConfigError, match=r"strategy='hybrid_shard:2'.*does not divide world_size=3"):
        resolve_setup(lambda: _job("--strategy", "hybrid_shard:2"))
    with pytest.raises(ConfigError, match="backend='mpi'"):
        resolve_setup(lambda: _job("--backend", "mpi"))
    with pytest.raises(ConfigError, match="dist_backend='nccl'"):
        resolve_setup(lambda: _job("--device", "cpu", "--dist-backend", "nccl"))
    cfg, device, backend = resolve_job(_job("--device", "cpu", "--strategy", "zero3", "--xp", "numpy"))
    assert (cfg.world_size, cfg.xp, device, backend) == (3, "numpy", "cpu", "gloo")


def test_the_gpu_report_without_cuda_says_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from zerogpu.gpu_report import report
    from zerosim.cli.gpu import report_parser

    def main(argv: list[str]) -> int:
        return report(report_parser().parse_args(argv))

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["--out", "unused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs CUDA" in err[0] and "--cpu" in err[0]


def test_a_gloo_pair_closed_by_a_timeout_is_a_collective_timeout_naming_who_never_arrived() -> None:
    """Under load gloo's own timeout can close the pair before the wait's expires; its error is still a
    timeout, named the same way (the ranks that never arrived); a closed connection is not."""
    from types import SimpleNamespace

    from zerogpu.comm_watchdog import GroupWatch
    from zerosim.errors import CollectiveTimeout

    notes = {1: "not in any collective (4 entered on this group)"}
    board = SimpleNamespace(board_key=lambda name, ranks: "world",
                            survey=lambda key, call, ranks: ([1], notes))
    watch = GroupWatch(SimpleNamespace(board=board, backend="gloo"), None, "world", 0, (0, 1), 2.0)
    closed = RuntimeError("[gloo/transport/tcp/pair.cc:534] Application timeout caused pair closure")
    err = watch.error("all_gather", 4, closed)
    assert isinstance(err, CollectiveTimeout), err
    assert "timed out after 2s; ranks that never arrived: [1]" in str(err) and notes[1] in str(err)
    other = watch.error("all_gather", 4, RuntimeError("Connection closed by peer [127.0.0.1]:41234"))
    assert not isinstance(other, CollectiveTimeout)
    assert "gloo error on rank 0: Connection closed by peer" in str(other) and notes[1] in str(other)
