"""The ZeRO engine on the simulator: every strategy equals ground truth; bad input fails before running."""

from __future__ import annotations

import numpy as np
import pytest
from run_assertions import assert_all_pass

from zerosim.engine.config import RunConfig
from zerosim.engine.reference import ordered_reference
from zerosim.engine.run_result import evaluate
from zerosim.engine.spmd import run_simulated, simulate_observations
from zerosim.errors import ConfigError, NonFiniteGradientError
from zerosim.partition import PARTITIONERS
from zerosim.values.flat_buffers import build_unit_plan
from zerosim.values.layout import ParamLayout
from zerosim.values.strategy import ShardingStrategy

STRATEGIES = ["no_shard", "zero1", "zero2", "zero3", "hybrid_shard:2", "hybrid_shard_zero2:2"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_is_bitwise_equal_to_the_same_order_reference(strategy):
    result = run_simulated(
        RunConfig(strategy=strategy, world_size=4, steps=3, micro_batches=2, max_grad_norm=0.5)
    )
    assert_all_pass(result)
    c2 = result.verdicts["C-ZERO-002"]
    assert c2.details["bitwise_required"] is True
    assert result.steps[0]["clip_coef"] < 1.0  # clipping really happened: the norm had to be global


@pytest.mark.parametrize("partitioner", sorted(PARTITIONERS))
def test_every_partitioner_drives_zero3_and_zero2(partitioner):
    for strategy in ("zero3", "zero2"):
        assert_all_pass(
            run_simulated(RunConfig(strategy=strategy, world_size=3, partitioner=partitioner, steps=2))
        )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["zero1", "zero3", "hybrid_shard:2"])
def test_mixed_precision(precision, strategy):
    assert_all_pass(run_simulated(RunConfig(strategy=strategy, precision=precision, world_size=4, steps=2)))


@pytest.mark.parametrize("world", [1, 2, 5, 8])
def test_world_sizes(world):
    assert_all_pass(run_simulated(RunConfig(strategy="zero3", world_size=world, steps=2, optimizer="sgd")))


def test_hybrid_with_nodes_wider_than_the_shard_group():
    result = run_simulated(RunConfig(strategy="hybrid_shard:2", world_size=8, ranks_per_node=4, steps=2,
                                     optimizer="adam"))
    assert_all_pass(result)
    links = result.comm.link_totals()
    assert links["intra"]["sent"] > 0 and links["inter"]["sent"] > 0  # replicate ring {0,2,4,6} crosses nodes
    assert result.comm.per_rank_links(2)["inter"]["sent"] > 0  # rank 2 -> 4 leaves node 0


@pytest.mark.parametrize("prefetch", [0, 2])
def test_cpu_offload_with_prefetch(prefetch):
    result = run_simulated(
        RunConfig(strategy="zero3", offload=True, prefetch=prefetch, world_size=4, steps=2)
    )
    assert_all_pass(result)
    o = result.observations[0]
    moved = o.offload["steps"][0]
    shard = result.config["packed_numel"] // 4
    assert moved == {"host_to_device": 4 * shard, "device_to_host": 4 * shard}
    mem = o.steps[0].memory
    assert mem.peak_by_location["host"] > 0
    assert o.steps[0].holdings["optimizer"].location == "host"


def test_prefetch_raises_the_device_peak_within_the_bound():
    peaks = []
    for prefetch in (0, 1, 3):
        r = run_simulated(RunConfig(strategy="zero3", prefetch=prefetch, world_size=2, steps=1))
        assert_all_pass(r)
        peaks.append(r.observations[0].steps[0].memory.peak_live_params)
    assert peaks[0] < peaks[1] < peaks[2]


def test_digest_observations_still_check_identity_and_skip_values():
    cfg = RunConfig(strategy="zero3", world_size=2, steps=2, observe="digest")
    r = run_simulated(cfg)
    assert r.verdicts["C-ZERO-002"].details.get("skipped")
    assert r.verdicts["C-ZERO-003"].passed and r.verdicts["C-ZERO-003"].checked > 0


def test_parallel_schedule_gives_the_same_bits():
    a = simulate_observations(RunConfig(strategy="hybrid_shard:2", world_size=4, steps=2))
    b = simulate_observations(
        RunConfig(strategy="hybrid_shard:2", world_size=4, steps=2, schedule="parallel")
    )
    for oa, ob in zip(a, b, strict=True):
        assert oa.steps[-1].master.values.tobytes() == ob.steps[-1].master.values.tobytes()


def test_same_engine_on_torch_cpu_tensors_matches_numpy():
    pytest.importorskip("torch")
    base = dict(strategy="zero3", world_size=4, steps=3, micro_batches=2, partitioner="fsdp")
    np_obs = simulate_observations(RunConfig(**base))
    t_obs = simulate_observations(RunConfig(**base, xp="torch"))
    ref = ordered_reference(RunConfig(**base).resolve())
    for o_np, o_t in zip(np_obs, t_obs, strict=True):
        for s_np, s_t in zip(o_np.steps, o_t.steps, strict=True):
            a, b = s_np.master.values, s_t.master.values
            assert a.dtype == b.dtype == np.float32
            # matmuls are not bitwise across libraries; float32 rounding of the gradients, through Adam
            np.testing.assert_allclose(b, a, rtol=0, atol=2e-5 * np.abs(ref.steps[s_np.step].master).max())
            assert s_np.gathered_digest == {} and s_t.gathered is not None
    result = evaluate(RunConfig(**base, xp="torch"), t_obs)
    assert result.verdicts["C-ZERO-002"].details["bitwise_required"] is False
    assert result.passed, [str(v) for vv in result.verdicts.values() for v in vv.violations][:3]


@pytest.mark.parametrize("strategy, precision, micro", [
    ("zero3", "fp32", 0), ("zero2", "fp32", 0), ("zero1", "fp32", 0), ("no_shard", "fp32", 0),
    ("hybrid_shard:2", "fp32", 1), ("hybrid_shard_zero2:2", "bf16", 1), ("zero3", "fp16", 1),
])
def test_non_finite_gradient_on_one_rank_is_reported_not_averaged(strategy, precision, micro):
    cfg = RunConfig(strategy=strategy, world_size=4, steps=2, micro_batches=2, precision=precision,
                    inject_nan={"rank": 3, "step": 1, "tensor": "blocks.0.mlp.w_in", "micro": micro})
    with pytest.raises(NonFiniteGradientError) as e:
        run_simulated(cfg)
    assert e.value.rank == 3 and e.value.tensor == "blocks.0.mlp.w_in" and e.value.step == 1
    assert "rank 3" in str(e.value) and "blocks.0.mlp.w_in" in str(e.value)
    assert "no rank stepped with it" in str(e.value)


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])  # zero3 on the simulator: reduce-scatters run ahead
def test_a_nan_is_caught_before_any_rank_accumulates_it_so_no_rank_ever_holds_it(strategy):
    """Every rank stops at the same point with the same error, and no NaN reached any rank's state."""
    from zerosim.comm.sim import run_spmd
    from zerosim.engine.block_schedule import BlockSchedule, block_rank_state
    from zerosim.numerics.xp import numpy_namespace

    run = RunConfig(strategy=strategy, world_size=4, steps=2, micro_batches=2,
                    inject_nan={"rank": 2, "step": 1, "tensor": "lm_head.weight", "micro": 1}).resolve()

    def program(comm):
        engine = block_rank_state(comm, run, numpy_namespace())
        schedule = BlockSchedule(engine)
        try:
            for s in range(run.steps):
                schedule.step(s)
        except NonFiniteGradientError as e:
            return e, [np.asarray(a, dtype=np.float64) for a in (engine.master, engine.grad_acc,
                                                                  *engine.opt_state.values())]
        return None, []

    out = run_spmd(4, program, timeout_s=30)
    for rank, (err, arrays) in enumerate(out):
        assert isinstance(err, NonFiniteGradientError), rank  # every rank stops, not only rank 2
        assert (err.rank, err.tensor, err.step) == (2, "lm_head.weight", 1)
        assert arrays and all(np.isfinite(a).all() for a in arrays), rank


ENGINE_MODULES = ("zerosim.engine.rank_state", "zerosim.engine.gradients", "zerosim.engine.step",
                  "zerosim.engine.observation", "zerosim.engine.unit_table", "zerosim.engine.block_schedule",
                  "zerosim.values.flat_buffers", "zerosim.engine.memory_tracker",
                  "zerosim.engine.faults", "zerosim.engine.fault_catalog", "zerosim.engine.config",
                  "zerosim.engine.spmd", "zerosim.engine.run_result", "zerosim.engine.run_file",
                  "zerosim.engine.injection", "zerosim.engine.wire", "zerosim.engine.engine_run")


@pytest.mark.parametrize("module", ENGINE_MODULES)
def test_the_engine_imports_no_numpy(module):
    """The per-rank engine reaches arrays only through the xp seam (zerosim.numerics.xp) and other ranks only
    through the Communicator, which is what lets MPI and torch run it unchanged. (reference.py, the
    unsharded evaluator, is numpy by design and never runs on a rank.)"""
    import ast
    import importlib.util
    import pathlib

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    tree = ast.parse(pathlib.Path(spec.origin).read_text())
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.split(".")[0] in ("numpy", "torch", "mpi4py")], (module, imported)


@pytest.mark.parametrize("changes, field", [
    (dict(strategy="hybrid_shard:3", world_size=4), "strategy"),
    (dict(optimizer="lamb"), "optimizer"),
    (dict(partitioner="nope"), "partitioner"),
    (dict(model="gpt9"), "model"),
    (dict(world_size=0), "world_size"),
    (dict(steps=0), "steps"),
    (dict(micro_batches=-1), "micro_batches"),
    (dict(precision="fp8"), "precision"),
    (dict(ranks_per_node=3, world_size=4), "ranks_per_node"),
    (dict(offload=True, strategy="zero2"), "offload"),
    (dict(fault="no-such-bug"), "fault"),
    (dict(fault="skip-replicate-allreduce", strategy="zero3"), "fault"),
    (dict(inject_nan={"rank": 9, "step": 0, "tensor": "lm_head.weight"}), "inject_nan.rank"),
    (dict(inject_nan={"rank": 0, "step": 0, "tensor": "nope"}), "tensor"),
    (dict(lr=-1.0), "lr"),
    (dict(timeout_s=0), "timeout_s"),
    (dict(schedule="random"), "schedule"),
])
def test_invalid_configurations_fail_before_anything_runs(changes, field):
    with pytest.raises(ConfigError) as e:
        RunConfig(**changes).validate()
    assert e.value.field == field


def test_unit_plan_padding_matches_the_partitioners_own_where_they_pad_per_rank():
    layout = ParamLayout.from_config("tiny")
    for name in ("fsdp", "deepspeed-zero3"):
        up = build_unit_plan(layout, ShardingStrategy.parse("zero3"), name, 4)
        for j in range(4):
            assert up.padding(j) == up.shard_plan.shard(j).padding
    up = build_unit_plan(layout, ShardingStrategy.parse("zero2"), "deepspeed", 4)
    assert [up.padding(j) for j in range(4)] == [up.shard_plan.shard(j).padding for j in range(4)]


@pytest.mark.parametrize("world", [2, 4, 64])
def test_packing_by_one_gather_and_by_slice_copies_gives_the_same_bits(world):
    """Units whose (rank, segment) pieces are short are packed and unpacked with one fancy-indexed copy,
    the others with a slice copy per piece: both ways give the same packed buffer and the same unit."""
    import dataclasses

    from zerosim.engine import wire
    from zerosim.numerics.xp import numpy_namespace

    layout = ParamLayout.from_config("tiny")
    plan = build_unit_plan(layout, ShardingStrategy.parse("zero3"), "fsdp", world)
    xp = numpy_namespace()
    rng = np.random.default_rng(0)
    kinds = set()
    for unit in plan.units:
        kinds.add(unit.short_pieces)
        grads = {name: rng.standard_normal(shape).astype(np.float32)
                 for name, shape in zip(unit.tensor_names, unit.tensor_shapes, strict=True)}
        packed, unpacked = [], []
        for short in (True, False):
            variant = dataclasses.replace(unit)
            variant.__dict__["short_pieces"] = short  # the cached choice, forced each way
            p = wire.pack_grads(xp, variant, grads, "float32", 0.0)
            back = np.full(unit.numel, np.nan, np.float32)
            wire.unpack_into(xp, back, p, variant)
            packed.append(p)
            unpacked.append(back)
        np.testing.assert_array_equal(packed[0], packed[1])
        np.testing.assert_array_equal(unpacked[0], unpacked[1])
        np.testing.assert_array_equal(unpacked[0], np.concatenate([g.ravel() for g in grads.values()]))
    # the engine's own choice: long pieces at 2 ranks, a mix at 4, all short at 64
    assert kinds == {2: {True, False}, 4: {True, False}, 64: {True}}[world]


# ---- run-ahead on the simulator --------------------------------------------------------------------

def _fingerprint(observations):
    """Per rank and step: loss, norm, master and optimizer-state bytes, traffic, memory peaks."""
    out = []
    for o in observations:
        for s in o.steps:
            out.append((o.rank, s.step, s.loss, s.grad_norm, s.master.values.tobytes(),
                        tuple(sorted((k, v.values.tobytes()) for k, v in s.optimizer.items())),
                        tuple((t.group, t.collective, t.calls, t.bytes_sent) for t in s.traffic),
                        tuple(sorted(s.memory.peak_by_category.items()))))
    return out


@pytest.mark.parametrize("strategy", ["zero3", "hybrid_shard:2"])
def test_run_ahead_changes_no_bit_no_byte_of_traffic_and_no_accounted_peak(strategy, monkeypatch):
    """ZeRO-3 on the simulator starts its gathers and reduce-scatters ahead; the same run waiting for
    each collective in turn (what mpiexec and torchrun do) observes exactly the same."""
    from zerosim.engine.block_schedule import BlockSchedule

    cfg = RunConfig(strategy=strategy, world_size=4, steps=2, micro_batches=2, prefetch=1, max_grad_norm=0.5)
    ahead = simulate_observations(cfg)
    monkeypatch.setattr(BlockSchedule, "_can_run_ahead", lambda self: False)
    in_turn = simulate_observations(cfg)
    assert _fingerprint(ahead) == _fingerprint(in_turn)


def test_run_ahead_computes_each_ranks_micro_batch_in_one_piece(monkeypatch):
    """Serial schedule, ZeRO-3: every rank's forward and backward of a micro-batch run without another
    rank computing in between (its activations stay in cache), lowest rank first."""
    from zerosim.numerics.model import BlockModel

    trace: list[tuple[int, str]] = []
    for name in ("forward", "backward"):
        original = getattr(BlockModel, name)

        def traced(self, block, *args, _original=original, _name=name, **kwargs):
            trace.append((_current_rank(), _name))
            return _original(self, block, *args, **kwargs)

        monkeypatch.setattr(BlockModel, name, traced)
    simulate_observations(RunConfig(strategy="zero3", world_size=4, steps=1, micro_batches=1))
    runs = [r for i, (r, _) in enumerate(trace) if i == 0 or trace[i - 1][0] != r]
    assert runs == [0, 1, 2, 3], runs  # one contiguous run of forward + backward per rank


def _current_rank() -> int:
    import threading

    return int(threading.current_thread().name.removeprefix("sim-rank-"))



@pytest.mark.parametrize("run_ahead", [True, False])
def test_each_unit_is_gathered_only_while_it_computes_and_sharded_between_steps(run_ahead, monkeypatch):
    """ZeRO-3: the unit a block computes with is GATHERED; with run-ahead the units whose gathers were
    started and not taken are IN_FLIGHT; after the step every unit is back to SHARDED. ZeRO-2 holds the
    full parameters: every unit GATHERED throughout."""
    from zerosim.comm.sim import run_spmd
    from zerosim.engine.block_schedule import BlockSchedule, block_rank_state
    from zerosim.numerics.xp import numpy_namespace
    from zerosim.values.unit_state import UnitState

    if not run_ahead:
        monkeypatch.setattr(BlockSchedule, "_can_run_ahead", lambda self: False)

    def program(run):
        def rank(comm):
            engine = block_rank_state(comm, run, numpy_namespace())
            schedule = BlockSchedule(engine)
            seen = []
            forward = schedule.model.forward

            def recording(block, *args, **kwargs):
                unit = engine.unit_by_block.get(block, engine.units.units[0])  # ZeRO-2: one unit, the model
                states = sorted(s.value for s in engine.unit_table.values())
                seen.append((engine.unit_table[unit.name], states))
                return forward(block, *args, **kwargs)

            schedule.model.forward = recording
            schedule.step(0)
            return schedule.runs_ahead, seen, set(engine.unit_table.values())
        return rank

    run = RunConfig(strategy="zero3", world_size=2, steps=1, prefetch=0).resolve()
    for ahead, seen, after in run_spmd(2, program(run), timeout_s=30):
        assert ahead is run_ahead
        assert seen and all(state is UnitState.GATHERED for state, _ in seen)
        assert any("in_flight" in states for _, states in seen) is run_ahead
        assert after == {UnitState.SHARDED}
    run = RunConfig(strategy="zero2", world_size=2, steps=1).resolve()
    for _, seen, after in run_spmd(2, program(run), timeout_s=30):
        assert {state for state, _ in seen} == after == {UnitState.GATHERED}


# ---- the engine's seams: finite vote, composition --------------------------------------------------

def test_the_finite_vote_names_the_lowest_offending_rank_and_tensor():
    """Every set of offending (rank, tensor) keys decodes to its lowest key; no offender decodes to None."""
    import itertools

    from zerosim.engine import finite_vote
    from zerosim.numerics.xp import numpy_namespace

    xp, world, tensors = numpy_namespace(), 3, 4
    assert finite_vote.offender(float(finite_vote.vote(xp, 0, 1, world, tensors)[0]), world, tensors) is None
    keys = [(r, t) for r in range(world) for t in range(tensors)]
    for chosen in itertools.chain(itertools.combinations(keys, 1), itertools.combinations(keys, 2)):
        first = {r: min(t for q, t in chosen if q == r) for r, _ in chosen}  # each rank's first bad tensor
        votes = [float(finite_vote.vote(xp, first.get(r, -1) + 1, r, world, tensors)[0])
                 for r in range(world)]
        assert finite_vote.offender(max(votes), world, tensors) == min(chosen), chosen


def engine_subclasses(source: str) -> list[str]:
    """Classes in ``source`` that derive from RankState (a schedule holds the state; it is no kind of it)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases}
            if "RankState" in bases:
                found.append(node.name)
    return found


def test_no_driver_or_mutant_subclasses_the_engine_and_every_fault_is_data():
    from pathlib import Path

    from zerosim.engine.fault_catalog import FAULTS, Fault

    root = Path(__file__).resolve().parents[1]
    offenders = {str(p.relative_to(root)): engine_subclasses(p.read_text())
                 for package in ("zerosim", "zerogpu") for p in (root / package).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
    broken = "class Broken(rank_state.RankState):\n    pass\n"
    assert engine_subclasses(broken) == ["Broken"]  # the scan sees one
    assert FAULTS and all(isinstance(f, Fault) for f in FAULTS.values())
