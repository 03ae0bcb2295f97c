"""ZeroTrainer's whole-tensor layout (zerogpu.whole_tensor): matrix optimizers step whole tensors on
their owner, elementwise ones keep the flat split; C-ZERO-001 and C-ZERO-004 judge the layout by its
own rules (largest-tensor balance, per-tensor optimizer state)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from zerogpu.module_units import describe_module  # noqa: E402
from zerogpu.whole_tensor import (  # noqa: E402
    OwnedTensor,
    WholeTensorOptimizer,
    choose_layout,
    owned_tensors,
    rank_tensors,
    tensor_owners,
)
from zerosim.checks.holdings import ResidentPlan, check_holdings, whole_tensor_state_numel  # noqa: E402
from zerosim.checks.partition import check_partition_plan  # noqa: E402
from zerosim.cost.optimizer_state import split_tensors  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402
from zerosim.partition import RankShard, get_partitioner  # noqa: E402
from zerosim.values.layout import ParamLayout  # noqa: E402
from zerosim.values.observe import TrainerObservation  # noqa: E402
from zerosim.values.plan import build_plan  # noqa: E402
from zerosim.values.strategy import ShardingStrategy, Topology  # noqa: E402
from zerosim.verify import verify  # noqa: E402
from zerosim.verify.optimizers import phase_config  # noqa: E402

LAUNCH_TIMEOUT_S = 300


class Blocks(torch.nn.Module):
    """Three blocks of uneven sizes (a 7x5 and a 5x3 matrix each, with biases) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 5)) for _ in range(3))
        self.head = torch.nn.Linear(5, 2)


class Sandwich(torch.nn.Module):
    """A stem, two blocks and a head: the root unit (stem and head) is not contiguous in the flat
    order, so a shard that stores units one after the other does not follow that order."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(3, 5)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(5, 5) for _ in range(2))
        self.head = torch.nn.Linear(5, 2)


def _layout() -> Any:
    return describe_module(Blocks()).layout


def test_auto_layout_follows_the_optimizer_class() -> None:
    w = [torch.nn.Parameter(torch.zeros(3, 3))]
    assert choose_layout("auto", torch.optim.AdamW(w)) == "flat"
    assert choose_layout("auto", torch.optim.SGD(w, lr=0.1)) == "flat"
    assert choose_layout("auto", torch.optim.Adafactor(w)) == "whole-tensor"
    assert choose_layout("auto", torch.optim.Muon(w)) == "whole-tensor"
    assert choose_layout("auto", {"name": "muon"}) == "whole-tensor"
    assert choose_layout("auto", {"name": "adam"}) == "flat"
    assert choose_layout("whole-tensor", torch.optim.AdamW(w)) == "whole-tensor"


def test_an_optimizer_spec_of_a_matrix_optimizer_takes_the_whole_tensor_layout() -> None:
    """An OptimizerSpec names its optimizer: Adafactor's spec gets whole tensors and torch's Adafactor
    with the spec's hyper-parameters; Muon's spec (a recipe of two optimizers) is refused naming it,
    never silently built as AdamW on flat slices."""
    from zerogpu.whole_tensor import optimizer_factory
    from zerosim.numerics.optim import OptimizerSpec

    spec = OptimizerSpec.parse("adafactor", lr=1e-2)
    assert choose_layout("auto", spec) == "whole-tensor"
    assert choose_layout("auto", OptimizerSpec.parse("muon")) == "whole-tensor"
    assert choose_layout("auto", OptimizerSpec.parse("adamw")) == "flat"
    with pytest.raises(ConfigError, match="adafactor is not elementwise"):
        choose_layout("flat", spec)
    w = torch.nn.Parameter(torch.ones(3, 2, dtype=torch.float64))
    built = optimizer_factory(spec)([w])
    assert isinstance(built, torch.optim.Adafactor)
    group = built.param_groups[0]
    assert (group["lr"], group["beta2_decay"], group["d"]) == (spec.lr, spec.beta2_decay, spec.d)
    assert group["eps"] == (spec.eps1, spec.eps)
    with pytest.raises(ConfigError, match="'optim'.*muon|muon.*make_optimizer"):
        optimizer_factory(OptimizerSpec.parse("muon"))


@pytest.mark.parametrize("optim", [{"name": "muon"}, {"name": "adafactor"}, {"name": "mine:factory"}])
def test_the_flat_layout_with_a_matrix_optimizer_is_refused(optim: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="not elementwise"):
        choose_layout("flat", optim)
    with pytest.raises(ConfigError, match="layout"):
        choose_layout("rows", optim)


@pytest.mark.parametrize("rule", ["zero-redundancy", "round-robin", "contiguous"])
def test_whole_tensor_partitioners_give_every_tensor_to_one_rank(rule: str) -> None:
    layout = _layout()
    plan = get_partitioner(rule)(layout, 2)
    owners = tensor_owners(layout, plan, rule)
    assert sorted(owners) == sorted(t.name for t in layout.tensors)
    for local in range(2):
        mine = owned_tensors(layout, tuple((s, e, 0) for s, e in plan.shard(local).intervals))
        assert {t.name for t in mine} == {n for n, r in owners.items() if r == local}


@pytest.mark.parametrize("rule", ["fsdp", "seed", "deepspeed"])
def test_a_partitioner_that_splits_tensors_is_refused_for_whole_tensors(rule: str) -> None:
    layout = _layout()
    with pytest.raises(ConfigError, match="whole tensors"):
        tensor_owners(layout, get_partitioner(rule)(layout, 2), rule)


@pytest.mark.parametrize("make", [lambda ts: torch.optim.Adafactor(ts, lr=1e-2),
                                  lambda ts: torch.optim.Muon(ts, lr=0.02)])
def test_the_owner_steps_views_of_its_master_shard_as_torch_steps_the_tensors(make: Any) -> None:
    """Two matrices packed at offsets 3 and 20 of a 40-element shard, padding between: three steps
    of the engine's optimizer equal torch's on the tensors themselves, bit for bit, and the padding
    stays zero."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"a": (4, 4), "b": (5, 4)}
    tensors = [OwnedTensor("a", shapes["a"], 3, 16), OwnedTensor("b", shapes["b"], 20, 20)]
    master = torch.zeros(40, dtype=torch.float64)
    reference = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    for t in tensors:
        master[t.position:t.position + t.numel] = reference[t.name].reshape(-1)
    padding = torch.ones(40, dtype=torch.bool)
    for t in tensors:
        padding[t.position:t.position + t.numel] = False
    engine_opt = WholeTensorOptimizer(make, tensors)
    state = engine_opt.init_state(40, "float64")
    torch_opt = make(list(reference.values()))
    for _ in range(3):
        grad = torch.randn(40, generator=gen, dtype=torch.float64)
        for t in tensors:
            reference[t.name].grad = grad[t.position:t.position + t.numel].view(t.shape).clone()
        engine_opt.step(master, grad, state)
        torch_opt.step()
    assert state["step"] == 3
    for t in tensors:
        assert torch.equal(master[t.position:t.position + t.numel].view(t.shape), reference[t.name])
    assert not master[padding].any()
    assert engine_opt.state_nbytes() > 0


def test_c_zero_004_plans_muon_state_tensor_by_tensor_and_catches_a_flat_state() -> None:
    """Muon's recipe keeps one buffer per 2-D element and two per other element, on the owner only.
    A trainer that keeps the planned bytes passes; one that keeps a momentum buffer for every element
    of the model on each rank (state replicated, not owned) fails on the optimizer."""
    layout = _layout()
    strategy = ShardingStrategy.parse("zero2")
    optim = phase_config("muon")
    plan = get_partitioner("zero-redundancy")(layout, 2)
    by_rank = []
    for rank in range(2):
        mine = [t for t in layout.tensors
                if any(s <= layout.tensor_range(t.name)[0] < e for s, e in plan.shard(rank).intervals)]
        by_rank.append(sum(t.numel if len(t.shape) == 2 else 2 * t.numel for t in mine))
    assert [whole_tensor_state_numel(layout, strategy, 2, r, optim, "zero-redundancy")
            for r in range(2)] == by_rank
    resident = ResidentPlan("zero2", layout, 8, 2, optim=optim, partitioner="zero-redundancy",
                            master_copy=True, packed_shards=True)
    unit_shard = max(sum(t.numel for t in layout.tensors
                         if any(s <= layout.tensor_range(t.name)[0] < e for s, e in plan.shard(r).intervals))
                     for r in range(2))
    honest = [{"params": layout.total_numel * 8, "grads": unit_shard * 8,
               "optimizer": (by_rank[r] + unit_shard) * 8} for r in range(2)]
    assert check_holdings(honest, resident).passed
    replicated = [dict(m, optimizer=(layout.total_numel + unit_shard) * 8) for m in honest]
    verdict = check_holdings(replicated, resident)
    assert not verdict.passed
    assert {v.tensor for v in verdict.violations} == {"optimizer"}


@dataclass
class _Step:
    step: int
    phase: str
    ranks: list[TrainerObservation]
    ref: Any = None
    bounds: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


def _owned_records(layout: Any, owner_of: dict[str, int]) -> list[_Step]:
    ranks = []
    for rank in range(2):
        shards = {t.name: [(0, t.numel)] if owner_of[t.name] == rank else [] for t in layout.tensors}
        ranks.append(TrainerObservation("muon", 1, rank, 0.0, {}, shards=shards))
    return [_Step(1, "muon", ranks)]


def test_c_zero_001_judges_whole_tensor_owners_by_the_largest_tensor() -> None:
    """Greedy whole-tensor owners (zero-redundancy) are within the largest tensor of each other; a
    wrong whole-tensor rule that gives rank 1 only the smallest tensor fails the balance clause."""
    layout = _layout()
    numels = {t.name: t.numel for t in layout.tensors}
    good = tensor_owners(layout, get_partitioner("zero-redundancy")(layout, 2), "zero-redundancy")
    assert check_partition_plan(_owned_records(layout, good), numels=numels).passed
    smallest = min(numels, key=lambda n: numels[n])
    lopsided = {n: (1 if n == smallest else 0) for n in numels}
    verdict = check_partition_plan(_owned_records(layout, lopsided), numels=numels)
    assert not verdict.passed
    assert {v.clause for v in verdict.violations} == {"balance"}
    largest = max(numels, key=lambda n: numels[n])
    assert f"{largest!r}, {numels[largest]}" in verdict.violations[0].message  # the rule's tensor, named
    loads = [sum(numels[n] for n, r in lopsided.items() if r == rank) for rank in range(2)]
    assert loads[0] - loads[1] > max(numels.values())  # the wrong rule really is out of bounds


@pytest.mark.parametrize(("adapter", "optimizer"), [("zerogpu-2", "muon"), ("zerogpu-3", "adafactor")])
def test_zerogpu_passes_verify_with_a_matrix_optimizer(adapter: str, optimizer: str) -> None:
    report = verify(adapter, world=2, steps=4, optimizers=optimizer, timeout_s=LAUNCH_TIMEOUT_S)
    assert report.verdict == "pass", report.to_json()
    assert [p["name"] for p in report.phases if p["status"] == "ran"] == [optimizer]
    for contract in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-004", "C-ZERO-005"):
        assert report.contracts[contract].status == "pass", (contract, report.to_json())


def test_zerogpu_hybrid_passes_verify_with_matrix_optimizers_on_a_mesh_of_one_rank_shard_groups() -> None:
    """Hybrid at world 2 is the (2, 1) mesh: each shard group is one rank that owns every tensor, stored
    unit after unit (the root unit first), so the owner's views must be read from the unit plan, not
    from the global flat offsets (reading those put Adafactor off the reference at its first step)."""
    report = verify("zerogpu-hybrid", world=2, steps=4, optimizers="adafactor,muon",
                    timeout_s=LAUNCH_TIMEOUT_S)
    assert report.verdict == "pass", report.to_json()
    assert [p["name"] for p in report.phases if p["status"] == "ran"] == ["adafactor", "muon"]
    for contract in ("C-ZERO-001", "C-ZERO-002", "C-ZERO-003", "C-ZERO-004", "C-ZERO-005"):
        assert report.contracts[contract].status == "pass", (contract, report.to_json())


@pytest.mark.parametrize(("strategy", "world"), [("hybrid_shard:1", 2), ("hybrid_shard:2", 4), ("zero3", 1),
                                                 ("zero3", 2), ("zero2", 2)])
def test_the_owner_steps_its_tensors_where_the_shard_stores_them(strategy: str, world: int) -> None:
    """Every rank's owned views, cut from a master shard packed as the engine packs it (unit after
    unit), hold exactly the tensors' values; under ZeRO-3 and hybrid the root unit (stem and head)
    comes first in the shard, so a block's tensor read at its global flat offset would hold the head."""
    from zerosim.values.flat_buffers import build_unit_plan

    layout = describe_module(Sandwich()).layout
    flat = torch.arange(layout.total_numel, dtype=torch.float64)
    parsed = ShardingStrategy.parse(strategy)
    plan = build_unit_plan(layout, parsed, "zero-redundancy", world)
    seen = set()
    for rank in range(world):
        master = torch.full((plan.shard_numel,), -1.0, dtype=torch.float64)
        for g0, g1, pos in plan.owned_global(rank % plan.k):
            master[pos:pos + g1 - g0] = flat[g0:g1]
        for t in rank_tensors(layout, plan, parsed.shards_optimizer, "zero-redundancy", rank):
            g0, g1 = layout.tensor_range(t.name)
            got = master[t.position:t.position + t.numel]
            assert torch.equal(got, flat[g0:g1]), (t.name, t.position, g0)
            seen.add(t.name)
    assert seen == {t.name for t in layout.tensors}


def test_split_tensors_names_each_tensor_no_rank_owns_whole() -> None:
    layout = _layout()
    plan = get_partitioner("zero-redundancy")(layout, 2)
    assert split_tensors(layout, plan) == []
    assert [(t.name, ranks) for t, ranks in split_tensors(layout, get_partitioner("seed")(layout, 2))] == [
        (t.name, (0, 1)) for t in layout.tensors
        if layout.tensor_range(t.name)[0] < layout.total_numel // 2 < layout.tensor_range(t.name)[1]]


def _moved_boundary(layout: Any, plan: Any) -> tuple[str, Any, Any]:
    """A tensor of rank 0 whose last element is handed to rank 1: the name, and both ranks' new shards."""
    name = next(t.name for t in layout.tensors if t.numel > 1
                and any(s <= layout.tensor_range(t.name)[0] < e for s, e in plan.shard(0).intervals))
    g0, g1 = layout.tensor_range(name)
    zero = [(s, e) for s, e in plan.shard(0).intervals]
    cut = [(s, min(e, g1 - 1)) if s <= g0 < e else (s, e) for s, e in zero]
    cut += [(g1, e) for s, e in zero if s <= g0 < e and e > g1]
    one = sorted(list(plan.shard(1).intervals) + [(g1 - 1, g1)])
    return name, RankShard(0, tuple(sorted(cut))), RankShard(1, tuple(one))


@pytest.mark.parametrize("rule", ["zero-redundancy", "round-robin", "contiguous"])
def test_c_zero_001_names_a_tensor_a_whole_tensor_plan_splits(rule: str) -> None:
    """The engine's plan under a whole-tensor partitioner passes; the same plan with one element of a
    tensor moved to the other rank (coverage and disjointness intact) fails ``whole_tensor`` naming it."""
    layout = ParamLayout.from_config("tiny")
    state = build_plan(layout, ShardingStrategy.parse("zero2"), rule, Topology(2))
    assert check_partition_plan(state).passed
    name, zero, one = _moved_boundary(layout, state.shard_plan)
    ranks = list(state.ranks)
    ranks[0] = dataclasses.replace(ranks[0], optimizer=zero)
    ranks[1] = dataclasses.replace(ranks[1], optimizer=one)
    verdict = check_partition_plan(dataclasses.replace(state, ranks=tuple(ranks)))
    split = [v for v in verdict.violations if v.clause == "whole_tensor"]
    assert [v.tensor for v in split] == [name], verdict.violations
    assert name in split[0].message and split[0].ranks == (0, 1)
    assert split[0].context["state"] == "optimizer"
    assert {v.clause for v in verdict.violations} <= {"whole_tensor", "balance"}


def test_a_flat_partitioner_s_plan_is_not_held_to_whole_tensors() -> None:
    layout = ParamLayout.from_config("tiny")
    seed = build_plan(layout, ShardingStrategy.parse("zero2"), "seed", Topology(2))
    assert split_tensors(layout, seed.shard_plan)  # the flat split does cut tensors
    assert check_partition_plan(seed).passed


def test_c_zero_001_holds_a_whole_tensor_plan_to_its_partitioner_s_balance_bound() -> None:
    """A zero-redundancy StatePlan whose optimizer state gives rank 1 only the smallest tensor keeps
    every tensor whole (no ``whole_tensor`` finding) but is further apart than the largest tensor,
    zero-redundancy's bound: ``balance`` fails with both ranks and the bound."""
    layout = ParamLayout.from_config("tiny")
    state = build_plan(layout, ShardingStrategy.parse("zero2"), "zero-redundancy", Topology(2))
    smallest = min((t for t in layout.tensors if t.numel), key=lambda t: t.numel)
    g0, g1 = layout.tensor_range(smallest.name)
    rest = tuple(iv for iv in ((0, g0), (g1, layout.total_numel)) if iv[1] > iv[0])
    ranks = list(state.ranks)
    ranks[0] = dataclasses.replace(ranks[0], optimizer=RankShard(0, rest))
    ranks[1] = dataclasses.replace(ranks[1], optimizer=RankShard(1, ((g0, g1),)))
    verdict = check_partition_plan(dataclasses.replace(state, ranks=tuple(ranks)))
    assert [v.clause for v in verdict.violations] == ["balance"], verdict.violations
    bound = max(t.numel for t in layout.tensors)
    assert verdict.violations[0].expected == bound and verdict.violations[0].got > bound
    assert set(verdict.violations[0].ranks) == {0, 1}
