"""C-ZERO-007: save at N -> load at M -> gather is bitwise; resuming continues bitwise.

What the matrix covers (simulator, ``tiny``, AdamW, 2 steps trained before the save):

* every pair of world sizes N, M in {1, 2, 3, 4, 8} (25 pairs) for three strategy pairs:
  zero3 -> zero2, no_shard -> zero3, zero1 -> hybrid_shard:2 (hybrid only where 2 divides M);
* every pair of strategies (no_shard, zero1, zero2, zero3, hybrid_shard:2: 25 pairs) for the world
  pairs 4 -> 3, 2 -> 8, 8 -> 4 and 3 -> 1 (hybrid pairs skipped where 2 does not divide the world);
* partitioners: the save under fsdp, loads under deepspeed for one world pair of every strategy;
* resume at the same world size (every strategy, plus bf16 and SGD-momentum variants) against the
  uninterrupted run; at another world size against the run that hands its full state over in memory.

Each saved checkpoint is trained once and loaded by every case that reads it; the module runs in
about 10-15 s on two cores.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import zerosim.checkpoint.engine_state as engine_state
import zerosim.checkpoint.resharding as reshard_mod
from zerosim.checkpoint import reshard
from zerosim.checks.checkpoint import CONTRACT, StateSnapshot, check_checkpoint_equivalence
from zerosim.checks.contracts import get_contract
from zerosim.engine.config import RunConfig
from zerosim.testing.checkpoint_runs import load_and_snapshot, train_and_save, transfer_and_continue

STRATEGIES = ("no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2")
WORLDS = (1, 2, 3, 4, 8)
K = 2  # steps trained before the save
J = 2  # steps trained after the load


def fits(strategy: str, world: int) -> bool:
    return not strategy.startswith("hybrid") or world % 2 == 0


def cfg(strategy: str, world: int, **kw) -> RunConfig:
    return RunConfig(strategy=strategy, world_size=world, steps=K + J, observe="none", **kw)


def pairs() -> list[tuple[str, int, str, int]]:
    out = set()
    for (s1, s2), n, m in itertools.product(
        [("zero3", "zero2"), ("no_shard", "zero3"), ("zero1", "hybrid_shard:2")], WORLDS, WORLDS
    ):
        out.add((s1, n, s2, m))
    for (n, m), s1, s2 in itertools.product([(4, 3), (2, 8), (8, 4), (3, 1)], STRATEGIES, STRATEGIES):
        out.add((s1, n, s2, m))
    return sorted(p for p in out if fits(p[0], p[1]) and fits(p[2], p[3]))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(strategy, N) -> (checkpoint directory, rank 0's snapshot of the saved state); trained once."""
    cache: dict[tuple[str, int], tuple[object, StateSnapshot]] = {}

    def get(strategy: str, world: int) -> tuple[object, StateSnapshot]:
        key = (strategy, world)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{strategy.replace(':', '_')}-{world}")
            snaps = train_and_save(cfg(strategy, world), K, d, block_bytes=4096)
            cache[key] = (d, snaps[0])
        return cache[key]

    return get


def assert_equal(expected: StateSnapshot, got: list, layout, clause: str = "round_trip", **ctx) -> None:
    for r, snap in enumerate(got):
        v = check_checkpoint_equivalence(expected, snap, layout, clause, context={**ctx, "rank": r})
        assert v.passed, "\n".join(map(str, v.violations))


MATRIX = pairs()


def test_the_matrix_is_what_the_docstring_says():
    assert len(MATRIX) >= 100
    assert {(p[0], p[2]) for p in MATRIX if (p[1], p[3]) == (4, 3)} == {
        (a, b) for a in STRATEGIES for b in STRATEGIES if fits(a, 4) and fits(b, 3)
    }


@pytest.mark.parametrize("s1, n, s2, m", MATRIX, ids=[f"{a}@{n}->{b}@{m}" for a, n, b, m in MATRIX])
def test_save_at_n_load_at_m_gathers_bitwise(saved, s1, n, s2, m):
    d, expected = saved(s1, n)
    run = cfg(s2, m).resolve()
    out = load_and_snapshot(run, d)
    assert_equal(expected, [s for s, _ in out], run.layout, src=f"{s1}@{n}", dst=f"{s2}@{m}")
    assert all(res.step == K and not res.missing_keys and not res.unexpected_keys for _, res in out)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_load_under_another_partitioner_is_bitwise(saved, strategy):
    d, expected = saved(strategy, 4)
    run = cfg("zero3" if strategy != "zero3" else "zero2", 8, partitioner="deepspeed").resolve()
    assert_equal(expected, [s for s, _ in load_and_snapshot(run, d)], run.layout)


RESUME_SAME = [(s, 4, {}) for s in STRATEGIES] + [
    ("zero3", 3, {"precision": "bf16"}),
    ("zero2", 2, {"optimizer": "sgd"}),
    ("hybrid_shard:2", 8, {}),
]


@pytest.mark.parametrize(
    "strategy, world, extra",
    RESUME_SAME,
    ids=[f"{s}@{w}{'-' + '-'.join(map(str, e.values())) if e else ''}" for s, w, e in RESUME_SAME],
)
def test_resume_at_the_same_world_equals_the_run_that_never_stopped(tmp_path, strategy, world, extra):
    run = cfg(strategy, world, **extra).resolve()
    uninterrupted = train_and_save(run, K + J, None)
    train_and_save(run, K, tmp_path, block_bytes=4096)
    resumed = load_and_snapshot(run, tmp_path, continue_steps=(K, K + J))
    assert_equal(uninterrupted[0], [s for s, _ in resumed], run.layout, "resume")


RESUME_OTHER = [
    ("zero3", 4, "zero2", 3, {}),
    ("no_shard", 1, "zero3", 4, {}),
    ("hybrid_shard:2", 4, "zero1", 2, {}),
    ("zero2", 2, "hybrid_shard:2", 8, {"precision": "bf16"}),
    ("zero1", 3, "no_shard", 2, {}),
]


@pytest.mark.parametrize(
    "s1, n, s2, m, extra", RESUME_OTHER, ids=[f"{a}@{n}->{b}@{m}" for a, n, b, m, _ in RESUME_OTHER]
)
def test_resume_at_another_world_equals_the_in_memory_hand_over(tmp_path, s1, n, s2, m, extra):
    """Uninterrupted training at N and at M group their reductions differently; the reference trains
    K steps at N and hands the full state to fresh ranks at M in memory, which train J more."""
    before = train_and_save(cfg(s1, n, **extra), K, tmp_path, block_bytes=4096)
    run = cfg(s2, m, **extra).resolve()
    reference = transfer_and_continue(before[0], run, (K, K + J))
    resumed = load_and_snapshot(run, tmp_path, continue_steps=(K, K + J))
    assert_equal(reference[0], [s for s, _ in resumed], run.layout, "resume")
    assert all(s.step == K + J for s, _ in resumed)
    # and the hand-over is not a no-op: the state moved on from the save
    assert not np.array_equal(reference[0].states["master"], before[0].states["master"])


# ---- deliberately wrong implementations ------------------------------------------------------------


def test_a_load_that_reads_another_ranks_shard_fails_naming_tensor_and_range(saved, monkeypatch):
    d, expected = saved("zero3", 4)
    run = cfg("zero3", 3).resolve()

    def neighbours_pieces(engine):  # each rank loads the global ranges its right neighbour owns
        return tuple(engine.units.owned_global((engine.local + 1) % engine.k))

    monkeypatch.setattr(engine_state, "engine_pieces", neighbours_pieces)
    got = load_and_snapshot(run, d)
    v = check_checkpoint_equivalence(expected, got[0][0], run.layout, context={"rank": 0})
    assert not v.passed
    first = v.violations[0]
    text = str(first)
    assert first.contract == CONTRACT and first.clause == "round_trip"
    assert first.tensor and first.interval and f"tensor={first.tensor}" in text and "range=[" in text


def test_a_resharder_that_drops_the_last_ranks_remainder_fails_naming_the_range(saved, tmp_path, monkeypatch):
    d, expected = saved("zero3", 4)
    total = expected.states["master"].shape[0]
    m = 5
    rem = total % m
    assert rem, "the case needs a remainder"
    real = reshard_mod.write_shard_file

    def dropping(directory, name, rank, ranges, states, dtype, chunks, block, meta, **kw):
        def chunks_without_tail(state, a, b):
            pos = a
            for arr in chunks(state, a, b):
                arr = arr.copy()
                arr[max(0, total - rem - pos) :] = 0  # the last ``rem`` elements of the model never copied
                pos += arr.shape[0]
                yield arr

        last = rank == m - 1
        return real(
            directory,
            name,
            rank,
            ranges,
            states,
            dtype,
            chunks_without_tail if last else chunks,
            block,
            meta,
            **kw,
        )

    monkeypatch.setattr(reshard_mod, "write_shard_file", dropping)
    reshard(d, m, "zero2", "seed", tmp_path / "out")
    monkeypatch.undo()
    run = cfg("zero2", m, partitioner="seed").resolve()
    got = load_and_snapshot(run, tmp_path / "out")
    v = check_checkpoint_equivalence(expected, got[0][0], run.layout)
    assert not v.passed
    ranges = {x.interval for x in v.violations}
    last_tensor = run.layout.tensors[-1].name
    assert any(x.tensor == last_tensor and x.interval[1] == total for x in v.violations), ranges
    assert all(x.interval[0] >= total - rem for x in v.violations if x.interval)


def test_a_lost_step_counter_is_its_own_clause(saved):
    _, expected = saved("zero2", 2)
    wrong = StateSnapshot(0, expected.states, expected.params)
    v = check_checkpoint_equivalence(expected, wrong, cfg("zero2", 2).resolve().layout)
    assert [x.clause for x in v.violations] == ["step_counter"]
    assert "step counter is 0, not 2" in str(v.violations[0])


def test_the_spec_names_this_check_and_its_clauses():
    spec = get_contract(CONTRACT)
    from zerosim.checks.checkpoint import CLAUSES

    assert spec.resolve_check() is check_checkpoint_equivalence
    assert set(spec.clauses) == set(CLAUSES) and spec.tolerance["kind"] == "bitwise"
