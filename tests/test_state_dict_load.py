"""Rank-0 load, broadcast and shard of a full state dict on the simulator (C-ZERO-006), its bad input.

* C-ZERO-006 holds for every strategy at world sizes 1-4 (hybrid where 2 divides it), other
  partitioners, bucketed broadcasts, both file formats: every rank keeps exactly its slice of the
  full state dict, bit for bit, and computes with the full working parameters.
* Only rank 0 opens the file: the others are given a path that does not exist; opens are counted.
* The engine's own rank-0 path (``load="broadcast"``) gives bitwise the state of ``load="seed"``
  and no rank other than 0 receives more than one tensor at a time.
* Two deliberately wrong loads (each rank keeps its neighbour's pieces; the broadcast misses a
  replica group) fail C-ZERO-006 naming the rank, the tensor and the element range.
* Bad input: one-line ConfigError naming the tensor or file, the same on every rank, nothing applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zerosim.checkpoint import broadcast as bc
from zerosim.checks.state_dict import check_broadcast_shard
from zerosim.comm.sim import run_spmd
from zerosim.engine.config import RunConfig
from zerosim.engine.fault_catalog import FAULTS
from zerosim.engine.observation import full_params_view
from zerosim.engine.rank_state import RankState
from zerosim.errors import ConfigError
from zerosim.numerics.xp import numpy_namespace
from zerosim.testing.state_dict_runs import check_load, load_on_ranks, plan_pieces, random_state_dict
from zerosim.values.layout import ParamLayout
from zerosim.values.observe import ShardValues

STRATEGIES = ("no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2")
CASES = [(s, n) for s in STRATEGIES for n in (1, 2, 3, 4) if not (s.startswith("hybrid") and n % 2)]


def _run(strategy: str = "zero3", world: int = 4, **kw: Any):
    return RunConfig(strategy=strategy, world_size=world, **kw).resolve()


def _assert_holds(run, state, loads) -> None:
    v = check_load(run, state, loads)
    assert v.passed and v.checked == 2 * run.world_size, [str(x) for x in v.violations]


@pytest.mark.parametrize("strategy, world", CASES, ids=[f"{s}@{n}" for s, n in CASES])
def test_every_rank_keeps_exactly_its_slice_of_the_state_dict(strategy: str, world: int) -> None:
    run = _run(strategy, world)
    state = random_state_dict(run.layout)
    loads = load_on_ranks(run, state)
    _assert_holds(run, state, loads)
    assert [ld.result.files_opened for ld in loads] == [0] * world  # an in-memory dict opens no file
    assert all(ld.result.missing_keys == [] == ld.result.unexpected_keys for ld in loads)


@pytest.mark.parametrize("partitioner", ["seed", "deepspeed", "zero-redundancy"])
@pytest.mark.parametrize("strategy", ["zero1", "zero3"])
def test_other_partitioners_and_buckets(partitioner: str, strategy: str) -> None:
    run = _run(strategy, 3, partitioner=partitioner)
    state = random_state_dict(run.layout, seed=11)
    largest = max(t.numel for t in run.layout.tensors) * 4
    loads = load_on_ranks(run, state, bucket_bytes=2 * largest)
    _assert_holds(run, state, loads)
    r = loads[1].result
    assert r.broadcasts < len(run.layout.tensors) and r.largest_buffer_bytes <= 2 * largest


def test_bf16_mixed_precision_loads_into_the_float32_master() -> None:
    run = _run("zero3", 2, precision="bf16")
    state = random_state_dict(run.layout)
    _assert_holds(run, state, load_on_ranks(run, state))


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_only_rank_0_opens_the_file(tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = _run("zero3", 4)
    state = random_state_dict(run.layout)
    path = tmp_path / f"model.{fmt}"
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file(state, str(path))
    else:
        torch = pytest.importorskip("torch")
        torch.save({k: torch.from_numpy(v) for k, v in state.items()}, path)
    opened: list[Any] = []
    real_open = bc.open_state_dict
    monkeypatch.setattr(bc, "open_state_dict", lambda src: opened.append(src) or real_open(src))
    loads = load_on_ranks(run, str(path), other_source=str(tmp_path / "absent.safetensors"))
    _assert_holds(run, state, loads)
    assert opened == [str(path)]
    assert [ld.result.files_opened for ld in loads] == [1, 0, 0, 0]
    assert [ld.result.bytes_read > 0 for ld in loads] == [True, False, False, False]


def _recording(sizes: list[int]) -> type[RankState]:
    """An engine whose load broadcasts append their element counts to ``sizes``."""

    class Recording(RankState):
        def load_comm(self) -> Any:
            comm = super().load_comm()
            real = comm.broadcast

            def broadcast(x: Any, root: int = 0) -> Any:
                sizes.append(int(x.shape[0]))
                return real(x, root)

            comm.broadcast = broadcast  # type: ignore[method-assign]
            return comm

    return Recording


def _initial_state(run, cls: type[RankState]) -> list[tuple[np.ndarray, np.ndarray]]:
    def program(comm: Any) -> tuple[np.ndarray, np.ndarray]:
        e = cls(comm, run, numpy_namespace())
        return e.master.copy(), full_params_view(e)

    return run_spmd(run.world_size, program)


def test_the_engine_broadcast_load_is_bitwise_the_seed_load_and_holds_one_tensor_at_a_time() -> None:
    for strategy, world in CASES:
        precision = "bf16" if strategy == "zero2" else "fp32"
        seed = _initial_state(_run(strategy, world, precision=precision), RankState)
        run = _run(strategy, world, precision=precision, load="broadcast")
        sizes: list[int] = []
        loaded = _initial_state(run, _recording(sizes))
        assert max(sizes) == max(t.numel for t in run.layout.tensors)
        assert len(sizes) == world * len(run.layout.tensors)
        for (m0, p0), (m1, p1) in zip(seed, loaded, strict=True):
            assert m0.dtype == m1.dtype and m0.tobytes() == m1.tobytes(), (strategy, world)
            assert p0.tobytes() == p1.tobytes(), (strategy, world)


class KeepsNeighboursPieces(RankState):
    """Wrong: each rank keeps the pieces of the next rank of its shard group."""

    def owned_in(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        mine = self.owned_pieces
        self.owned_pieces = tuple(self.units.owned_global((self.local + 1) % self.k))
        try:
            return super().owned_in(lo, hi)
        finally:
            self.owned_pieces = mine


def test_keeping_the_neighbours_pieces_fails_naming_rank_tensor_and_range() -> None:
    run = _run("zero3", 4)
    state = random_state_dict(run.layout)
    v = check_load(run, state, load_on_ranks(run, state, engine_cls=KeepsNeighboursPieces))
    assert not v.passed
    first = v.violations[0]
    assert first.clause == "shard" and first.ranks == (0,) and first.tensor == "embedding.weight"
    assert str(first).startswith("C-ZERO-006 shard rank=0 tensor=embedding.weight range=[0, ")


def test_a_broadcast_that_misses_a_replica_group_fails_naming_the_other_group() -> None:
    run = _run("hybrid_shard:2", 4)
    state = random_state_dict(run.layout)
    fault = FAULTS["load-broadcast-misses-group"].corrupts
    v = check_load(run, state, load_on_ranks(run, state, fault=fault))
    assert not v.passed
    assert {r for x in v.violations for r in x.ranks} == {2, 3}
    assert all(x.tensor and x.interval for x in v.violations if x.clause == "shard")


def test_the_check_names_wrong_pieces() -> None:
    layout = ParamLayout.from_list([("a", (4,)), ("b", (4,))])
    full = np.arange(8, dtype=np.float32)
    plan = {0: ((0, 4, 0),), 1: ((4, 8, 0),)}
    got = {0: ShardValues(((0, 4, 0),), full[:4].copy()), 1: ShardValues(((0, 4, 0),), full[:4].copy())}
    v = check_broadcast_shard(full, layout, got, plan)
    assert [(x.clause, x.ranks) for x in v.violations] == [("pieces", (1,))]
    got[1] = ShardValues(((4, 8, 0),), np.array([4, 5, 0, 7], np.float32))
    (x,) = check_broadcast_shard(full, layout, got, plan).violations
    assert (x.tensor, x.interval, x.expected, x.got) == ("b", (6, 7), 6.0, 0.0)


# ---- bad input ------------------------------------------------------------------------------------

def _errors(run, state, strict: bool = True) -> list[Any]:
    """Per rank: the error text it raised (or its result) and whether its master is unchanged."""

    def program(comm: Any) -> tuple[str, bool, Any]:
        e = RankState(comm, run, numpy_namespace())
        before = e.master.copy()
        try:
            result = bc.broadcast_and_shard_state_dict(e, state if comm.rank == 0 else None, strict=strict)
        except ConfigError as err:
            return str(err), bool((e.master == before).all()), None
        return "", bool((e.master == before).all()), (result, e.master.copy(), e.owned_pieces)

    return run_spmd(run.world_size, program)


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.pop("blocks.0.mlp.w_in"), "invalid state_dict='blocks.0.mlp.w_in': missing from state_dict"),
    (lambda s: s.__setitem__("extra.weight", np.zeros(3, np.float32)),
     "invalid state_dict='extra.weight': unexpected key in state_dict"),
    (lambda s: s.__setitem__("lm_head.weight", np.zeros((3, 3), np.float32)),
     "invalid state_dict='lm_head.weight': has shape (3, 3), the model"),
    (lambda s: s.__setitem__("lm_head.weight", s["lm_head.weight"].astype(np.float64)),
     "invalid state_dict='lm_head.weight': has dtype float64, the model float32"),
    (lambda s: s.__setitem__("lm_head.weight", [1.0]), "invalid state_dict='lm_head.weight': is a list"),
])
def test_bad_state_dicts_raise_the_same_one_line_error_on_every_rank(mutate, match: str) -> None:
    run = _run("zero3", 3)
    state: dict[str, Any] = dict(random_state_dict(run.layout))
    mutate(state)
    out = _errors(run, state)
    assert len({text for text, _, _ in out}) == 1, out
    text = out[0][0]
    assert text.startswith(match) and "\n" not in text and "found by rank 0; nothing was loaded" in text
    assert all(unchanged for _, unchanged, _ in out)


def test_non_strict_loads_what_both_have_and_reports_the_rest() -> None:
    run = _run("zero2", 2)
    state: dict[str, Any] = dict(random_state_dict(run.layout))
    del state["blocks.0.mlp.w_in"]
    state["extra.bias"] = np.zeros(2, np.float32)
    out = _errors(run, state, strict=False)
    fresh = _errors(run, {}, strict=False)  # loads nothing: the seed's weights
    for (text, _, (result, master, pieces)), (_, _, (_, seed_master, _)) in zip(out, fresh, strict=True):
        assert text == "" and result.missing_keys == ["blocks.0.mlp.w_in"]
        assert result.unexpected_keys == ["extra.bias"]
        g0, g1 = run.layout.tensor_range("blocks.0.mlp.w_in")
        for a, b, pos in pieces:
            lo, hi = max(a, g0), min(b, g1)
            if lo < hi:  # the missing tensor keeps its current value
                assert (master[pos + lo - a:pos + hi - a] == seed_master[pos + lo - a:pos + hi - a]).all()


def test_aliases_of_tied_weights_are_accepted() -> None:
    layout = ParamLayout.from_list([("wte", (2, 3)), ("ln", (3,))], aliases={"head": "wte"})
    entries = {"head": ((2, 3), "float32"), "ln": ((3,), "float32")}
    chosen, missing, unexpected = bc.plan_load(layout, entries, True, "f")
    assert chosen == {"wte": "head", "ln": "ln"} and missing == unexpected == []
    entries["wte"] = ((2, 3), "float32")
    assert bc.plan_load(layout, entries, True, "f")[0]["wte"] == "wte"


def test_bad_files_are_one_line_errors_naming_the_file(tmp_path: Path) -> None:
    run = _run("zero3", 2)
    cases = {
        tmp_path / "absent.safetensors": "no such file",
        tmp_path / "model.npz": "unknown state dict format",
        tmp_path / "bad.safetensors": "not a readable safetensors file",
    }
    (tmp_path / "model.npz").write_bytes(b"x")
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    for path, reason in cases.items():
        out = _errors(run, str(path))
        assert all(text.startswith(f"invalid checkpoint='{path}': {reason}") for text, _, _ in out), out
        assert all("\n" not in text for text, _, _ in out)


def test_a_pt_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    run = _run("zero3", 2)
    path = tmp_path / "evil.pt"
    torch.save({"x": _Payload()}, path)
    out = _errors(run, str(path))
    want = f"invalid checkpoint='{path}': not a loadable torch state dict"
    assert all(text.startswith(want) for text, _, _ in out), out
    assert not _Payload.ran


class _Payload:
    ran = False

    def __reduce__(self) -> Any:
        return (_Payload._run, ())

    @staticmethod
    def _run() -> None:
        _Payload.ran = True


def test_bucket_bytes_is_validated() -> None:
    run = _run("zero3", 1)
    with pytest.raises(ConfigError, match="bucket_bytes"):
        load_on_ranks(run, random_state_dict(run.layout), bucket_bytes=-1)


def test_plan_pieces_match_the_engine() -> None:
    run = _run("hybrid_shard:2", 4)
    loads = load_on_ranks(run, random_state_dict(run.layout))
    assert {ld.rank: ld.shard.pieces for ld in loads} == plan_pieces(run)
