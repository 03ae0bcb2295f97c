"""What only the in-process simulator has: rank-order reductions, read-only shared results, its two
schedules, mismatch and deadlock detection, torch tensors through the same world, 32 ranks.

The collectives every Communicator must get right are in tests/test_comm_conformance.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zerosim.comm.rendezvous import CollectiveAbandoned, CollectiveMismatch
from zerosim.comm.sim import run_spmd
from zerosim.comm.sim_world import SimulatedWorld
from zerosim.errors import CollectiveTimeout, ConfigError, NonFiniteGradientError

SCHEDULES = ("serial", "parallel")


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


def test_split_rejects_disagreeing_names_on_every_rank():
    def fn(comm):
        comm.split(0, name=f"g{comm.rank}")

    with pytest.raises(CollectiveMismatch, match="disagree on the group name"):
        run_spmd(2, fn)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stuck_rank_in_a_sub_group_is_named_with_the_group(schedule):
    def fn(comm):
        rep = comm.split(comm.rank % 2, name=f"replicate[{comm.rank % 2}]")
        if comm.rank == 3:  # the last to arrive at the split; "serial" lets ranks 0-2 run on first
            time.sleep(1.5)
        rep.reduce_scatter(np.zeros(4, np.float32), "avg")

    with pytest.raises(CollectiveTimeout) as e:
        run_spmd(4, fn, timeout_s=0.4, schedule=schedule)
    assert e.value.missing_ranks == [3]
    # rank 1 waits in replicate[1]'s reduce_scatter for its peer 3
    assert (e.value.collective, e.value.group) == ("reduce_scatter", "replicate[1]")
    assert "[3]" in str(e.value)


def test_a_rank_stuck_between_collectives_holding_the_baton_is_named():
    def fn(comm):
        comm.barrier()  # rank 1 completes it and hands the baton to rank 0, the group's first
        if comm.rank == 0:
            time.sleep(1.5)  # an endless computation while rank 1 waits for its turn
        comm.barrier()

    with pytest.raises(CollectiveTimeout) as e:
        run_spmd(2, fn, timeout_s=0.4, schedule="serial")
    assert e.value.missing_ranks == [0]
    assert (e.value.collective, e.value.group) == ("next collective after barrier", "world")


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


def test_bad_world_arguments_are_our_errors():
    with pytest.raises(ConfigError):
        SimulatedWorld(0)
    with pytest.raises(ConfigError):
        SimulatedWorld(2, schedule="random")


def test_our_own_errors_are_raised_as_they_are_naming_the_rank():
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
        return (comm.all_reduce(x, "avg"), comm.reduce_scatter(x, "sum"), comm.all_gather(x[:1]),
                comm.all_reduce(x, "max"))

    out = run_spmd(2, fn)
    assert torch.equal(out[0][0], torch.tensor([0.5, 1.5, 2.5, 3.5]))
    assert torch.equal(out[1][1], torch.tensor([5.0, 7.0]))
    assert torch.equal(out[0][2], torch.tensor([0.0, 1.0]))
    assert torch.equal(out[0][3], torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_thirty_two_ranks_in_lockstep():
    out = run_spmd(32, lambda comm: comm.all_reduce(np.array([comm.rank], np.int64))[0])
    assert out == [sum(range(32))] * 32


def test_a_value_derived_from_a_shared_gather_is_built_once_per_group_and_read_only():
    """Ranks of a group share one all-gathered buffer; what they derive from it (the engine's
    unit-order copy) is built once, handed to every rank of that group, and nobody may write it."""
    built: list[int] = []

    def fn(comm):
        sub = comm.split(comm.rank % 2, name=f"pair{comm.rank % 2}")  # two groups of two
        gathered = sub.all_gather(np.array([comm.rank], np.float32))

        def make():
            built.append(comm.rank)
            return gathered[::-1].copy()

        value = sub.derived(gathered, "reversed", make)
        own = sub.derived(np.zeros(1, np.float32), "reversed", lambda: np.ones(1, np.float32))
        return value, own

    out = run_spmd(4, fn)
    assert len(built) == 2  # once per group, not once per rank
    for rank, (value, own) in enumerate(out):
        expected = np.array([rank % 2 + 2, rank % 2], np.float32)
        np.testing.assert_array_equal(value, expected)
        assert not value.flags.writeable
        assert own.flags.writeable  # a writable (private) source: built by and for this rank only
    assert out[0][0] is out[2][0] and out[1][0] is out[3][0] and out[0][0] is not out[1][0]


# ---- started collectives: the simulator's run-ahead ----------------------------------------------

def _order_sensitive(rank: int, n: int = 6) -> np.ndarray:
    """float32 values whose rank-order sum differs from other orders."""
    big = np.float32(1e8) if rank == 0 else np.float32(-1e8) if rank == 3 else np.float32(1.0)
    return np.full(n, big, np.float32) + np.arange(n, dtype=np.float32) * np.float32(rank)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_started_collectives_equal_the_blocking_ones_bit_for_bit(schedule, op):
    from zerosim.comm.sim import reduce_in_rank_order

    n = 4

    def fn(comm):
        started = comm.reduce_scatter_start(_order_sensitive(comm.rank, 8), op, donate=True)
        blocking = comm.reduce_scatter(_order_sensitive(comm.rank, 8), op)
        gathered = comm.all_gather_start(np.full(2, comm.rank, np.float32))
        x = _order_sensitive(comm.rank, 8)
        in_place = comm.all_reduce_start(x, op)
        reduced = in_place.wait()
        return started.wait(), blocking, gathered.wait(), reduced is x and x, comm.all_reduce(
            _order_sensitive(comm.rank, 8), op)

    results = run_spmd(n, fn, schedule=schedule)
    whole = reduce_in_rank_order([_order_sensitive(r, 8) for r in range(n)], op)
    for r, (started, blocking, gathered, reduced, all_reduced) in enumerate(results):
        expected = whole[2 * r:2 * r + 2]
        assert started.tobytes() == expected.tobytes() == blocking.tobytes(), (r, started, expected)
        assert gathered.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert reduced is not False and reduced.tobytes() == all_reduced.tobytes() == whole.tobytes()
    assert sum(res[0].size for res in results) == 8  # each rank its own chunk


def test_a_reduction_folds_each_rank_as_it_arrives_and_keeps_no_one_elses_buffer():
    import gc
    import weakref

    alive: dict[int, weakref.ref] = {}

    def fn(comm):
        x = _order_sensitive(comm.rank, 8)
        alive[comm.rank] = weakref.ref(x)
        pending = comm.reduce_scatter_start(x, "sum", donate=True)
        del x
        gc.collect()
        # ranks 1.. were added into rank 0's donated buffer on arrival: nothing holds them any more
        kept = alive[comm.rank]() is not None
        return pending.wait(), kept

    results = run_spmd(4, fn)
    assert [kept for _, kept in results] == [True, False, False, False]  # rank 0's buffer is the accumulator


def test_a_non_donated_input_is_never_written():
    def fn(comm):
        x = _order_sensitive(comm.rank, 8)
        before = x.copy()
        comm.reduce_scatter_start(x, "sum").wait()
        comm.all_reduce(x, "avg")
        return x.tobytes() == before.tobytes()

    assert all(run_spmd(4, fn))


def test_a_mismatch_after_some_ranks_were_folded_is_still_reported_on_every_rank():
    def fn(comm):
        n = 12 if comm.rank == 2 else 8  # rank 2 differs; ranks 0 and 1 are folded before it arrives
        try:
            comm.reduce_scatter_start(np.ones(n, np.float32), "sum").wait()
        except CollectiveMismatch as e:
            return str(e)
        return "no error"

    messages = run_spmd(4, fn)
    assert all("shapes/dtypes differ" in m and "rank 2: ((12,), 'float32')" in m for m in messages), messages


def test_started_collectives_let_each_rank_run_to_its_next_wait():
    """Serial schedule: every rank starts its collectives, the last to start completes them, and each
    rank then runs its whole section alone, lowest rank first."""
    events: list[tuple[int, str]] = []

    def fn(comm):
        pending = [comm.all_gather_start(np.full(1, comm.rank, np.float32)) for _ in range(3)]
        for i, p in enumerate(pending):
            p.wait()
            events.append((comm.rank, f"use {i}"))
        comm.barrier()

    run_spmd(4, fn, schedule="serial")
    ranks = [r for r, _ in events]
    assert ranks == sorted(ranks), events  # rank by rank, never interleaved
    assert ranks[:3] == [0, 0, 0]
