"""The in-process simulator: collective semantics, rank-order reductions, traffic, groups, failures."""

from __future__ import annotations

import time
from fractions import Fraction

import numpy as np
import pytest

from zerosim.comm.base import Communicator
from zerosim.comm.sim import (
    CollectiveAbandoned,
    CollectiveMismatch,
    RankFailed,
    SimulatedWorld,
    run_spmd,
)
from zerosim.errors import CollectiveError, CollectiveTimeout, ConfigError, NonFiniteGradientError

SCHEDULES = ("serial", "parallel")


def data(rank: int, n: int = 12, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(rank)
    return rng.standard_normal(n).astype(dtype)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_collectives_match_their_definitions(world, schedule):
    def fn(comm):
        assert isinstance(comm, Communicator)
        x = data(comm.rank)
        return (comm.all_reduce(x, "sum"), comm.all_reduce(x, "avg"), comm.all_reduce(x, "max"),
                comm.reduce_scatter(x, "avg"), comm.all_gather(x[:2]), comm.broadcast(x, root=world - 1))

    out = run_spmd(world, fn, schedule=schedule)
    xs = [data(r) for r in range(world)]
    total = xs[0].copy()
    for x in xs[1:]:
        total += x  # rank order, exactly as the simulator promises
    c = 12 // world
    for rank, (s, a, m, rs, ag, bc) in enumerate(out):
        assert s.tobytes() == total.tobytes()
        assert a.tobytes() == (total / world).astype(np.float32).tobytes()
        np.testing.assert_array_equal(m, np.max(np.stack(xs), axis=0))
        assert rs.tobytes() == (total / world)[rank * c:(rank + 1) * c].tobytes()
        np.testing.assert_array_equal(ag, np.concatenate([x[:2] for x in xs]))
        np.testing.assert_array_equal(bc, xs[world - 1])


def test_reductions_are_bitwise_reproducible_and_in_rank_order():
    def fn(comm):
        # values whose float32 sum depends on the order of addition
        x = np.array([1e8 if comm.rank == 0 else (1.0 if comm.rank < 3 else -1e8)], dtype=np.float32)
        return comm.all_reduce(x, "sum")

    runs = [run_spmd(4, fn, schedule=s)[0] for s in SCHEDULES for _ in range(2)]
    expected = ((np.float32(1e8) + np.float32(1.0)) + np.float32(1.0)) + np.float32(-1e8)
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    assert runs[0][0] == expected


def test_results_are_private_or_read_only():
    def fn(comm):
        a = comm.all_reduce(np.ones(4, np.float32))
        a += comm.rank  # each rank owns its all-reduce result
        g = comm.all_gather(np.ones(2, np.float32))
        with pytest.raises(ValueError):
            g[0] = 5.0  # the shared all-gather output cannot be corrupted by one rank
        return a

    out = run_spmd(3, fn)
    assert [float(a[0]) for a in out] == [3.0, 4.0, 5.0]


def test_traffic_follows_the_ring_attribution():
    def fn(comm):
        comm.all_reduce(np.zeros(8, np.float32))
        comm.reduce_scatter(np.zeros(8, np.float32))
        comm.all_gather(np.zeros(2, np.float32))
        comm.broadcast(np.zeros(5, np.float64), root=1)
        return comm.traffic

    out = run_spmd(4, fn)
    for rank, t in enumerate(out):
        assert t.total_sent(collective="all_reduce") == Fraction(2 * 3 * 32, 4)
        assert t.total_sent(collective="reduce_scatter") == Fraction(3 * 32, 4)
        assert t.total_sent(collective="all_gather") == Fraction(3 * 32, 4)
        assert t.total_sent(collective="broadcast") == (40 if rank == 1 else 0)
        assert t.total_received(collective="broadcast") == (0 if rank == 1 else 40)


def test_split_groups_names_and_traffic_go_to_the_parent_counter():
    def fn(comm):
        node = comm.split(comm.rank // 2, name=f"shard[{comm.rank // 2}]")
        rep = comm.split(comm.rank % 2, key=-comm.rank, name=f"replicate[{comm.rank % 2}]")
        none = comm.split(None)
        s = node.all_reduce(np.array([comm.rank], np.int64))
        r = rep.all_gather(np.array([comm.rank], np.int64))
        return node.group_name, node.global_ranks, rep.global_ranks, none, int(s[0]), list(r), comm.traffic

    out = run_spmd(4, fn)
    assert out[0][:2] == ("shard[0]", (0, 1))
    assert out[3][:2] == ("shard[1]", (2, 3))
    assert out[0][2] == (2, 0)  # key=-rank orders the replicate group backwards
    assert out[1][3] is None
    assert [o[4] for o in out] == [1, 1, 5, 5]
    assert out[0][5] == [2, 0]
    assert ("shard[0]", "all_reduce") in out[0][6].records and ("replicate[0]", "all_gather") in out[0][
        6
    ].records


def test_split_rejects_disagreeing_names_on_every_rank():
    def fn(comm):
        comm.split(0, name=f"g{comm.rank}")

    with pytest.raises(CollectiveMismatch, match="disagree on the group name"):
        run_spmd(2, fn)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_rank_that_never_arrives_times_out_naming_the_collective_and_the_rank(schedule):
    def fn(comm):
        if comm.rank == 2:
            time.sleep(1.5)
        comm.all_reduce(np.zeros(2))

    t = time.monotonic()
    with pytest.raises(CollectiveTimeout) as e:
        run_spmd(3, fn, timeout_s=0.5, schedule=schedule)
    assert time.monotonic() - t < 10
    assert e.value.missing_ranks == [2]
    assert e.value.collective == "all_reduce"
    assert "all_reduce" in str(e.value) and "[2]" in str(e.value)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stuck_rank_in_a_sub_group_is_named_with_the_group(schedule):
    def fn(comm):
        rep = comm.split(comm.rank % 2, name=f"replicate[{comm.rank % 2}]")
        if comm.rank == 3:  # the last to arrive at the split: under "serial" it holds the baton while stuck
            time.sleep(1.5)
        rep.reduce_scatter(np.zeros(4, np.float32), "avg")

    with pytest.raises(CollectiveTimeout) as e:
        run_spmd(4, fn, timeout_s=0.4, schedule=schedule)
    assert e.value.missing_ranks == [3]
    if schedule == "parallel":  # rank 1 waits in replicate[1]'s reduce_scatter for its peer 3
        assert (e.value.collective, e.value.group) == ("reduce_scatter", "replicate[1]")
    else:  # nobody could enter the next collective: rank 3 never came back after the split
        assert e.value.collective == "next collective after split" and e.value.group == "world"
    assert "[3]" in str(e.value)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_barrier_holds_every_rank_until_the_last_arrives(schedule):
    events: list[tuple[str, int]] = []

    def fn(comm):
        if comm.rank == 0:
            time.sleep(0.2)
        events.append(("before", comm.rank))
        comm.barrier()
        events.append(("after", comm.rank))
        return comm.traffic.total_sent()

    sent = run_spmd(4, fn, schedule=schedule)
    kinds = [k for k, _ in events]
    assert kinds == ["before"] * 4 + ["after"] * 4, events
    assert sent == [0] * 4  # a barrier moves no data


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_rank_that_finishes_early_is_reported_at_once(schedule):
    def fn(comm):
        if comm.rank != 1:
            comm.barrier()
            comm.all_gather(np.zeros(1))

    t = time.monotonic()
    with pytest.raises(CollectiveAbandoned) as e:
        run_spmd(3, fn, timeout_s=30, schedule=schedule)
    assert time.monotonic() - t < 5  # detected, not waited out
    assert e.value.missing_ranks == [1] and e.value.collective == "barrier"
    assert "rank 1 finished" in str(e.value)


def test_mismatched_collectives_and_shapes_fail_on_every_rank():
    def kinds(comm):
        return comm.all_gather(np.zeros(2)) if comm.rank == 1 else comm.all_reduce(np.zeros(2))

    with pytest.raises(CollectiveMismatch, match="rank 1 called all_gather"):
        run_spmd(3, kinds)

    def shapes(comm):
        return comm.all_reduce(np.zeros(2 + comm.rank))

    with pytest.raises(CollectiveMismatch, match="shapes/dtypes differ"):
        run_spmd(2, shapes)


def test_bad_arguments_are_our_errors():
    def rs(comm):
        comm.reduce_scatter(np.zeros(5))

    with pytest.raises(CollectiveError, match="not divisible by the group size 2"):
        run_spmd(2, rs)

    def op(comm):
        comm.all_reduce(np.zeros(2), "prod")

    with pytest.raises(ConfigError, match="prod"):
        run_spmd(2, op)
    with pytest.raises(ConfigError):
        SimulatedWorld(0)
    with pytest.raises(ConfigError):
        SimulatedWorld(2, schedule="random")


def test_first_failure_is_propagated_naming_the_rank():
    def fn(comm):
        if comm.rank == 2:
            raise KeyError("boom")
        comm.barrier()

    with pytest.raises(RankFailed) as e:
        run_spmd(4, fn)
    assert e.value.rank == 2 and "rank 2 failed: KeyError" in str(e.value)
    assert isinstance(e.value.__cause__, KeyError)

    def ours(comm):
        if comm.rank == 1:
            raise NonFiniteGradientError(1, "w", 0)
        comm.barrier()

    with pytest.raises(NonFiniteGradientError, match="rank 1"):
        run_spmd(3, ours)


def test_torch_tensors_go_through_the_same_collectives():
    torch = pytest.importorskip("torch")

    def fn(comm):
        x = torch.arange(4, dtype=torch.float32) + comm.rank
        return (
            comm.all_reduce(x, "avg"),
            comm.reduce_scatter(x, "sum"),
            comm.all_gather(x[:1]),
            comm.all_reduce(x, "max"),
        )

    out = run_spmd(2, fn)
    assert torch.equal(out[0][0], torch.tensor([0.5, 1.5, 2.5, 3.5]))
    assert torch.equal(out[1][1], torch.tensor([5.0, 7.0]))
    assert torch.equal(out[0][2], torch.tensor([0.0, 1.0]))
    assert torch.equal(out[0][3], torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_thirty_two_ranks_in_lockstep():
    out = run_spmd(32, lambda comm: comm.all_reduce(np.array([comm.rank], np.int64))[0])
    assert out == [sum(range(32))] * 32
