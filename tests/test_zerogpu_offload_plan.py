"""The offload step plan (zerogpu.offload_plan): replayed through a real OffloadManager on the CPU (the
same fetch outcomes, evictions, bytes and device peak), its budget accounting with gradient shards,
and which copies it issues ahead of their use."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from zerogpu.offload import OffloadBudgetError, OffloadConfig, OffloadManager  # noqa: E402
from zerogpu.offload_plan import plan_step  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402

# units of unequal sizes (bytes of float32 shards), as a small transformer's: embedding, blocks, head
UNITS = [("embed", 4 * 96), ("b0", 4 * 40), ("b1", 4 * 40), ("b2", 4 * 40), ("b3", 4 * 40), ("head", 4 * 64)]


def _replay(budget: int, depth: int, async_prefetch: bool) -> tuple[OffloadManager, list[str]]:
    """One step's fetches through the manager, as the module engine issues them (fetch, use, release;
    forward order, then backward order; every unit's host copy updated after the step)."""
    manager = OffloadManager(OffloadConfig(device_budget_bytes=budget, prefetch_depth=depth,
                                           async_prefetch=async_prefetch))
    for name, nbytes in UNITS:
        manager.register_unit(name, torch.arange(nbytes // 4, dtype=torch.float32))
    manager.validate()
    fwd = [n for n, _ in UNITS]
    bwd = list(reversed(fwd))
    for order in (fwd, bwd):
        for at, name in enumerate(order):
            manager.fetch(name, order[at + 1:])
            manager.release(name)
    for name, nbytes in UNITS:
        manager.update_host(name, torch.zeros(nbytes // 4))
    return manager, fwd


@pytest.mark.parametrize("budget,depth,async_prefetch",
                         list(itertools.product([384, 400, 600, 1000, 4000], [0, 1, 2], [True, False])))
def test_plan_is_the_offload_managers_policy(budget, depth, async_prefetch):
    manager, _ = _replay(budget, depth, async_prefetch)
    plan = plan_step(UNITS, budget, prefetch_depth=depth, async_prefetch=async_prefetch,
                     offload_optimizer=False)
    stats = manager.performance_stats()
    for key, value in plan.counters.items():
        assert stats[key] == value, key
    assert plan.evicted == manager.eviction_log()
    assert plan.device_peak == manager.memory_stats()["device"]["peak"]
    assert plan.bytes_host_to_device == stats["bytes_host_to_device"]
    assert plan.device_peak <= budget


def test_gradient_shards_count_against_the_budget_and_their_copies_hide_behind_the_next_unit():
    budget = 1000
    plan = plan_step(UNITS, budget, prefetch_depth=1)
    assert plan.device_peak <= budget
    for e in plan.events:
        assert e.device_bytes <= budget
    grads = sum(n for _, n in UNITS)
    assert plan.bytes_device_to_host == grads
    d2h = [e for e in plan.events if e.kind == "d2h_grad"]
    assert [e.unit for e in d2h] == [n for n, _ in reversed(UNITS)]
    assert [e.ahead for e in d2h] == [True] * (len(UNITS) - 1) + [False]  # the last one is waited for
    steps = [e.unit for e in plan.events if e.kind == "host_step"]
    assert steps == [e.unit for e in d2h]  # each unit's master is stepped once, after its gradient landed
    # a unit's host step comes after the next unit's backward compute began (the copy ran beside it)
    order = [(e.kind, e.unit) for e in plan.events]
    for a, b in zip(d2h, d2h[1:], strict=False):
        assert order.index(("compute", b.unit)) < order.index(("host_step", a.unit))
    assert plan.bytes_ahead + plan.bytes_blocking == plan.bytes_host_to_device + plan.bytes_device_to_host
    assert 0 < plan.ahead_fraction < 1
    assert plan.counters["invalidations"] == sum(1 for e in plan.events if e.kind == "invalidate")


def test_prefetch_moves_copies_ahead_and_room_saves_copies():
    tight = plan_step(UNITS, 4 * 96 + 2 * 4 * 64, prefetch_depth=1)
    roomy = plan_step(UNITS, 4000, prefetch_depth=1)
    none = plan_step(UNITS, 4000, prefetch_depth=0)
    assert none.ahead_fraction < roomy.ahead_fraction and none.ahead_fraction < tight.ahead_fraction
    # a tight budget evicts and copies units again in backward; room keeps them resident
    assert tight.bytes_host_to_device > roomy.bytes_host_to_device == sum(n for _, n in UNITS)
    assert tight.bytes_blocking >= roomy.bytes_blocking
    # with room for everything, only the first forward fetch and the last gradient copy wait
    assert roomy.bytes_blocking == 4 * 96 + 4 * 96


def test_plan_refuses_what_cannot_fit():
    with pytest.raises(OffloadBudgetError, match=r"fetching of unit 'b3' \(160 bytes\).*gradient shards "
                                                 r"\(256 bytes\)"):
        plan_step(UNITS, 4 * 96, prefetch_depth=0)  # the largest unit fits, a unit beside a gradient not
    with pytest.raises(OffloadBudgetError, match="reduced gradient shard of unit 'head'"):
        plan_step(UNITS, 1000, grad_nbytes={"head": 1001})
    with pytest.raises(OffloadBudgetError, match="fetching of unit 'embed'"):
        plan_step(UNITS, 100, offload_optimizer=False)
    with pytest.raises(ConfigError, match="not a unit of the plan"):
        plan_step(UNITS, 1000, forward_order=["embed", "nope"])
    with pytest.raises(ConfigError, match="distinct"):
        plan_step([("a", 4), ("a", 4)], 1000)
