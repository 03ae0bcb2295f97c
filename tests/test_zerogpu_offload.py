"""The ZeRO-3 CPU offload manager: budgets, LRU eviction, prefetch, statistics, bad input, exactness.

Runs on CPU (the device tier is a separately accounted CPU pool); the CUDA path has one test that
is skipped where no GPU is visible. The property test compares every fetch, eviction and statistic
with an OrderedDict model of the documented policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from zerogpu.offload import OffloadBudgetError, OffloadConfig, OffloadManager  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402

F32 = 4  # bytes per float32 element


def bits(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (bitwise comparison, NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def manager(budget: int, sizes: dict[str, int], *, depth: int = 1, async_prefetch: bool = True,
            host_budget: int | None = None) -> OffloadManager:
    """Units of float32 shards with ``sizes[name]`` elements, values distinct per unit."""
    mgr = OffloadManager(OffloadConfig(device_budget_bytes=budget, host_budget_bytes=host_budget,
                                       prefetch_depth=depth, async_prefetch=async_prefetch))
    for i, (name, numel) in enumerate(sizes.items()):
        mgr.register_unit(name, torch.arange(numel, dtype=torch.float32) + 100.0 * i)
    return mgr


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text, text
    return text


# ------------------------------------------------------------------------------------------- config

@pytest.mark.parametrize(("kwargs", "field"), [
    ({"device_budget_bytes": 0}, "offload.device_budget_bytes"),
    ({"device_budget_bytes": -8}, "offload.device_budget_bytes"),
    ({"device_budget_bytes": 8.0}, "offload.device_budget_bytes"),
    ({"device_budget_bytes": True}, "offload.device_budget_bytes"),
    ({"device_budget_bytes": "64"}, "offload.device_budget_bytes"),
    ({"device_budget_bytes": 64, "host_budget_bytes": 0}, "offload.host_budget_bytes"),
    ({"device_budget_bytes": 64, "host_budget_bytes": -1}, "offload.host_budget_bytes"),
    ({"device_budget_bytes": 64, "host_budget_bytes": 1.5}, "offload.host_budget_bytes"),
    ({"device_budget_bytes": 64, "host_budget_bytes": False}, "offload.host_budget_bytes"),
    ({"device_budget_bytes": 64, "prefetch_depth": -1}, "offload.prefetch_depth"),
    ({"device_budget_bytes": 64, "prefetch_depth": True}, "offload.prefetch_depth"),
    ({"device_budget_bytes": 64, "prefetch_depth": 1.0}, "offload.prefetch_depth"),
    ({"device_budget_bytes": 64, "async_prefetch": "yes"}, "offload.async_prefetch"),
    ({"device_budget_bytes": 64, "pin_memory": 1}, "offload.pin_memory"),
])
def test_bad_config_values_are_refused_naming_field_and_value(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        OffloadConfig(**kwargs)
    text = one_line(err)
    assert err.value.field == field and field in text
    assert repr(err.value.value) in text


def test_good_config_and_defaults() -> None:
    cfg = OffloadConfig(device_budget_bytes=64)
    assert (cfg.host_budget_bytes, cfg.prefetch_depth, cfg.async_prefetch, cfg.pin_memory) == \
        (None, 1, True, True)
    assert OffloadConfig(device_budget_bytes=1, host_budget_bytes=1, prefetch_depth=0).prefetch_depth == 0


@pytest.mark.parametrize("device", ["meta", "not-a-device", 3.5])
def test_bad_device_is_refused(device: object) -> None:
    with pytest.raises(ConfigError) as err:
        OffloadManager(OffloadConfig(device_budget_bytes=64), device=device)  # type: ignore[arg-type]
    assert err.value.field == "offload.device" and one_line(err)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused() -> None:
    with pytest.raises(ConfigError, match="CUDA is not available"):
        OffloadManager(OffloadConfig(device_budget_bytes=64), device="cuda")


# ------------------------------------------------------------------------------------- registration

@pytest.mark.parametrize("shard", [torch.zeros(2, 3), torch.tensor(1.0), torch.zeros(1, 4)])
def test_a_shard_that_is_not_1d_is_refused(shard: torch.Tensor) -> None:
    mgr = manager(64, {})
    with pytest.raises(ConfigError) as err:
        mgr.register_unit("w", shard)
    text = one_line(err)
    assert err.value.field == "offload.shard" and "'w'" in text and "1-D" in text
    assert mgr.units == []


def test_bad_registrations_are_refused() -> None:
    mgr = manager(64, {"a": 4})
    with pytest.raises(ConfigError, match="already registered") as err:
        mgr.register_unit("a", torch.zeros(2))
    assert err.value.field == "offload.unit" and err.value.value == "a" and one_line(err)
    with pytest.raises(ConfigError, match="non-empty string"):
        mgr.register_unit("", torch.zeros(2))
    with pytest.raises(ConfigError, match="torch.Tensor"):
        mgr.register_unit("b", [1.0, 2.0])  # type: ignore[arg-type]
    mgr.register_host_state("a", [torch.zeros(3)])  # its own namespace: optimizer state of unit "a"
    with pytest.raises(ConfigError, match="already registered") as err:
        mgr.register_host_state("a", [torch.zeros(3)])
    assert err.value.field == "offload.host_state"
    with pytest.raises(ConfigError, match="must live on the CPU"):
        mgr.register_host_state("m", [torch.zeros(3, device="meta")])
    with pytest.raises(ConfigError, match="torch.Tensor"):
        mgr.register_host_state("n", [3.0])  # type: ignore[list-item]
    assert mgr.units == ["a"] and mgr.memory_stats()["host"]["state"] == 3 * F32


def test_the_host_copy_is_the_managers_own() -> None:
    mgr = manager(64, {})
    src = torch.tensor([1.0, 2.0, 3.0])
    mgr.register_unit("a", src)
    src.add_(10.0)
    assert bits(mgr.fetch("a")) == bits(torch.tensor([1.0, 2.0, 3.0]))
    assert mgr.unit_nbytes("a") == 3 * F32 and not mgr.memory_stats()["host"]["pinned"]


# --------------------------------------------------------------------------------------- validation

def test_validate_refuses_a_device_budget_below_the_largest_unit_before_any_copy() -> None:
    mgr = manager(40, {"small": 2, "big": 12, "mid": 8})
    with pytest.raises(OffloadBudgetError) as err:
        mgr.validate()
    text = one_line(err)
    assert isinstance(err.value, ConfigError)
    assert err.value.field == "offload.device_budget_bytes" and err.value.value == 40
    assert "'big'" in text and "48 bytes" in text and "40 bytes" in text
    assert text.startswith("invalid offload.device_budget_bytes=40: unit 'big' holds 48 bytes")
    assert err.value.unit == "big" and err.value.needed_bytes == 48
    with pytest.raises(OffloadBudgetError):  # fetch validates first: still nothing copied
        mgr.fetch("small")
    stats = mgr.memory_stats()
    assert stats["device"]["current"] == 0 and stats["device"]["peak"] == 0 and stats["resident_units"] == []
    assert mgr.performance_stats()["bytes_host_to_device"] == 0


def test_validate_accepts_a_budget_of_exactly_the_largest_unit() -> None:
    mgr = manager(48, {"small": 2, "big": 12})
    mgr.validate()
    assert bits(mgr.fetch("big")) == bits(torch.arange(12, dtype=torch.float32) + 100.0)


def test_validate_max_in_use_needs_the_largest_units_together() -> None:
    mgr = manager(48, {"a": 8, "b": 8, "c": 4})  # 32 + 32 + 16 bytes
    mgr.validate()
    with pytest.raises(OffloadBudgetError) as err:
        mgr.validate(max_in_use=2)
    text = one_line(err)
    assert "48 bytes" in text and "64 bytes" in text and "max_in_use=2" in text
    assert "'a'" in text and "'b'" in text
    with pytest.raises(ConfigError) as err:
        mgr.validate(max_in_use=0)
    assert err.value.field == "offload.max_in_use"
    manager(80, {"a": 8, "b": 8, "c": 4}).validate(max_in_use=3)


def test_validate_refuses_a_host_tier_over_its_budget() -> None:
    mgr = manager(64, {"a": 4, "b": 4}, host_budget=64)
    mgr.validate()  # 32 bytes of shards
    mgr.register_host_state("adam", [torch.zeros(4), torch.zeros(6)])  # 40 more
    with pytest.raises(OffloadBudgetError) as err:
        mgr.validate()
    text = one_line(err)
    assert err.value.field == "offload.host_budget_bytes" and err.value.value == 64
    assert "72 bytes" in text and "64 bytes" in text and "'adam'" in text and "40 bytes" in text
    assert mgr.memory_stats()["device"]["current"] == 0
    assert mgr.memory_stats()["host"] | {"pinned": None} == {
        "current": 72, "peak": 72, "budget": 64, "shards": 32, "state": 40, "pinned": None}


def test_registering_after_a_fetch_revalidates() -> None:
    mgr = manager(32, {"a": 4})
    mgr.fetch("a")
    mgr.register_unit("huge", torch.zeros(16))
    with pytest.raises(OffloadBudgetError, match="'huge'"):
        mgr.fetch("a")


# ---------------------------------------------------------------------------------------- bad input

def test_unknown_unit_names_are_refused_everywhere() -> None:
    mgr = manager(64, {"a": 4, "b": 4})
    for call in (lambda: mgr.fetch("zz"), lambda: mgr.release("zz"),
                 lambda: mgr.update_host("zz", torch.zeros(4)), lambda: mgr.unit_nbytes("zz")):
        with pytest.raises(ConfigError) as err:
            call()
        text = one_line(err)
        assert err.value.field == "offload.unit" and "'zz'" in text and "'a', 'b'" in text
    with pytest.raises(ConfigError) as err:
        mgr.fetch("a", ["b", "zz"])
    assert err.value.field == "offload.upcoming" and err.value.value == "zz"
    with pytest.raises(ConfigError, match="not one string"):
        mgr.fetch("a", "b")
    with pytest.raises(ConfigError, match="list or tuple"):
        mgr.fetch("a", iter(["b"]))  # type: ignore[arg-type]
    assert mgr.memory_stats()["device"]["current"] == 0  # refused before anything moved


def test_update_host_with_wrong_numel_or_dtype_is_refused() -> None:
    mgr = manager(64, {"a": 4})
    before = bits(mgr.host_copy("a"))
    with pytest.raises(ConfigError) as err:
        mgr.update_host("a", torch.zeros(5))
    assert err.value.field == "offload.values.numel" and err.value.value == 5
    assert "4 elements" in one_line(err)
    with pytest.raises(ConfigError) as err:
        mgr.update_host("a", torch.zeros(4, dtype=torch.float64))
    assert err.value.field == "offload.values.dtype" and "torch.float64" in one_line(err)
    with pytest.raises(ConfigError):
        mgr.update_host("a", [0.0] * 4)  # type: ignore[arg-type]
    assert bits(mgr.host_copy("a")) == before


# ------------------------------------------------------------------------------- LRU and prefetching

def test_lru_eviction_order_without_prefetch_matches_the_hand_derived_sequence() -> None:
    # four 16-byte units, room for three; every unit released after use
    mgr = manager(48, {"a": 4, "b": 4, "c": 4, "d": 4}, depth=0)
    for name in ["a", "b", "c", "a", "d", "b", "c", "a", "d"]:
        mgr.fetch(name)
        mgr.release(name)
    # a b c | a (hit) -> LRU b c a | d evicts b -> c a d | b evicts c -> a d b | c evicts a -> d b c
    # a evicts d -> b c a | d evicts b -> c a d
    assert mgr.eviction_log() == ["b", "c", "a", "d", "b"]
    perf = mgr.performance_stats()
    assert (perf["misses"], perf["resident_hits"], perf["prefetch_hits"], perf["evictions"]) == (8, 1, 0, 5)
    assert perf["hits"] + perf["misses"] == perf["fetches"] == 9
    assert mgr.prefetch_status()["resident"] == ["c", "a", "d"]
    assert mgr.memory_stats()["device"] == \
        {"current": 48, "peak": 48, "budget": 48, "in_use": 0, "in_flight": 0}


def test_units_in_use_are_never_evicted() -> None:
    mgr = manager(48, {"a": 4, "b": 4, "c": 4, "d": 4}, depth=0)
    mgr.fetch("a")  # kept in use
    for name in ["b", "c", "d", "b"]:
        mgr.fetch(name)
        mgr.release(name)
    assert "a" not in mgr.eviction_log() and mgr.eviction_log() == ["b", "c"]
    assert mgr.prefetch_status()["in_use"] == ["a"]


def test_sequential_prefetch_depth_1_hits_every_unit_after_the_first() -> None:
    order = ["u0", "u1", "u2", "u3", "u4"]
    mgr = manager(32, dict.fromkeys(order, 4), depth=1)  # room for the unit in use plus one
    for i, name in enumerate(order):
        out = mgr.fetch(name, order[i + 1:])
        assert bits(out) == bits(mgr.host_copy(name))
        status = mgr.prefetch_status()
        assert status["in_flight"] == order[i + 1:i + 2] and status["queued"] == []
        assert status["in_use"] == [name]
        mgr.release(name)
    perf = mgr.performance_stats()
    assert (perf["misses"], perf["prefetch_hits"], perf["prefetches_issued"], perf["prefetches_skipped"]) == \
        (1, 4, 4, 0)
    assert mgr.eviction_log() == ["u0", "u1", "u2"]
    assert mgr.memory_stats()["device"]["peak"] == 32
    assert perf["bytes_host_to_device"] == 5 * 16 and perf["copies_host_to_device"] == 5


def test_prefetch_is_skipped_when_nothing_can_be_evicted() -> None:
    mgr = manager(16, {"a": 4, "b": 4, "c": 2}, depth=2)
    mgr.fetch("a", ["b", "c"])  # a in use fills the budget: both prefetches skipped
    perf = mgr.performance_stats()
    assert perf["prefetches_skipped"] == 2 and perf["prefetches_issued"] == 0
    assert mgr.prefetch_status()["skipped"] == ["b", "c"]
    assert mgr.memory_stats()["device"]["peak"] == 16 and mgr.eviction_log() == []


def test_prefetch_does_not_evict_the_units_of_its_own_window() -> None:
    # a, b resident; fetching c with upcoming [a, d]: room for d must not come from a (in the window)
    mgr = manager(48, {"a": 4, "b": 4, "c": 4, "d": 4}, depth=2)
    for name in ["a", "b"]:
        mgr.fetch(name)
        mgr.release(name)
    mgr.fetch("c", ["a", "d"])  # LRU a b c: c's miss fits; d evicts b (a is protected by the window)
    assert mgr.eviction_log() == ["b"]
    assert mgr.prefetch_status()["resident"] == ["a", "c", "d"]
    assert mgr.prefetch_status()["in_flight"] == ["d"]


def test_synchronous_prefetch_makes_units_resident_at_once() -> None:
    order = ["u0", "u1", "u2"]
    mgr = manager(64, dict.fromkeys(order, 4), depth=2, async_prefetch=False)
    mgr.fetch("u0", order[1:])
    assert mgr.prefetch_status()["in_flight"] == [] and mgr.prefetch_status()["resident"] == order
    mgr.release("u0")
    mgr.fetch("u1")
    perf = mgr.performance_stats()
    assert (perf["misses"], perf["resident_hits"], perf["prefetch_hits"], perf["prefetches_issued"]) == \
        (1, 1, 0, 2)
    assert perf["asynchronous_copies"] is False


def test_a_fetch_blocked_by_units_in_use_raises_and_changes_nothing() -> None:
    mgr = manager(32, {"a": 4, "b": 4, "c": 4}, depth=0)
    mgr.fetch("a")
    mgr.fetch("b")
    before = (mgr.memory_stats(), mgr.performance_stats()["fetches"], mgr.prefetch_status())
    with pytest.raises(OffloadBudgetError) as err:
        mgr.fetch("c")
    text = one_line(err)
    assert "'c'" in text and "'a', 'b'" in text and "48 bytes" in text and "32 bytes" in text
    assert (mgr.memory_stats(), mgr.performance_stats()["fetches"], mgr.prefetch_status()) == before
    mgr.release("a")
    mgr.fetch("c")
    assert mgr.eviction_log() == ["a"]


def test_update_host_invalidates_device_copies_and_the_next_fetch_sees_the_new_bits() -> None:
    mgr = manager(64, {"a": 4, "b": 4}, depth=1)
    mgr.fetch("a", ["b"])  # b in flight
    new_a = torch.tensor([float("nan"), -0.0, float("inf"), 1e-45])
    new_b = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # any shape with the right numel
    mgr.update_host("a", new_a)
    mgr.update_host("b", new_b)
    perf = mgr.performance_stats()
    assert perf["invalidations"] == 2 and perf["prefetches_wasted"] == 1 and perf["evictions"] == 0
    assert mgr.memory_stats()["device"]["current"] == 0 and mgr.prefetch_status()["in_use"] == []
    assert bits(mgr.fetch("a")) == bits(new_a)
    assert bits(mgr.fetch("b")) == bits(new_b)
    assert mgr.performance_stats()["misses"] == 3 and mgr.eviction_log() == []


def test_release_keeps_the_unit_resident_and_is_idempotent() -> None:
    mgr = manager(64, {"a": 4})
    mgr.fetch("a")
    mgr.release("a")
    mgr.release("a")
    assert mgr.prefetch_status()["resident"] == ["a"] and mgr.prefetch_status()["in_use"] == []
    mgr.fetch("a")
    assert mgr.performance_stats()["resident_hits"] == 1


def test_reset_drops_device_copies_and_statistics_and_training_continues() -> None:
    mgr = manager(32, {"a": 4, "b": 4, "c": 4}, depth=1)
    mgr.register_host_state("opt", [torch.zeros(8)])
    for name, ahead in [("a", ["b"]), ("b", ["c"]), ("c", [])]:
        mgr.fetch(name, ahead)
        mgr.release(name)
    mgr.update_host("a", torch.full((4,), 7.0))
    assert mgr.eviction_log() and mgr.performance_stats()["fetches"] == 3
    mgr.reset()
    perf = mgr.performance_stats()
    assert all(perf[k] == 0 for k in ("fetches", "hits", "misses", "evictions", "bytes_host_to_device"))
    assert perf["seconds_copying"] == 0.0 and perf["overlap_fraction"] == 0.0
    assert mgr.eviction_log() == [] and mgr.prefetch_status()["resident"] == []
    mem = mgr.memory_stats()
    assert mem["device"]["current"] == 0 and mem["device"]["peak"] == 0
    assert mem["host"]["current"] == 3 * 16 + 32
    assert bits(mgr.fetch("a", ["b"])) == bits(torch.full((4,), 7.0))
    assert mgr.performance_stats()["misses"] == 1 and mgr.prefetch_status()["in_flight"] == ["b"]


def test_performance_statistics_are_consistent_on_cpu() -> None:
    order = [f"u{i}" for i in range(6)]
    mgr = manager(3 * 4096 * F32, dict.fromkeys(order, 4096), depth=2)
    for _ in range(3):
        for i, name in enumerate(order):
            mgr.fetch(name, order[i + 1:])
            mgr.release(name)
    perf = mgr.performance_stats()
    assert perf["seconds_copying"] > 0.0 and perf["seconds_waited"] >= 0.0
    assert 0.0 <= perf["overlap_fraction"] <= 1.0
    # nothing is asynchronous on CPU: every copy blocks the caller, nothing is hidden
    assert perf["seconds_waited"] == perf["seconds_copying"] and perf["overlap_fraction"] == 0.0
    assert perf["asynchronous_copies"] is False
    assert perf["bytes_host_to_device"] == perf["copies_host_to_device"] * 4096 * F32
    assert perf["copies_host_to_device"] == perf["misses"] + perf["prefetches_issued"]
    assert perf["hits"] + perf["misses"] == perf["fetches"] == 18
    assert perf["bytes_device_to_host"] == 0
    assert mgr.memory_stats()["device"]["peak"] <= 3 * 4096 * F32


# ------------------------------------------------------------------------------ the reference model

class LruModel:
    """The documented policy as an OrderedDict: name -> in flight, oldest-used first."""

    def __init__(self, sizes: dict[str, int], budget: int, depth: int, async_prefetch: bool):
        self.sizes, self.budget, self.depth, self.async_prefetch = sizes, budget, depth, async_prefetch
        self.lru: OrderedDict[str, bool] = OrderedDict()
        self.in_use: set[str] = set()
        self.evicted: list[str] = []
        self.used = self.peak = self.hits = self.misses = self.skipped = 0

    def _room(self, need: int, protected: set[str]) -> list[str] | None:
        free = self.budget - self.used
        plan: list[str] = []
        for name in self.lru:
            if need <= free:
                break
            if name not in self.in_use and name not in protected:
                plan.append(name)
                free += self.sizes[name]
        return plan if need <= free else None

    def _evict(self, names: list[str]) -> None:
        for name in names:
            del self.lru[name]
            self.used -= self.sizes[name]
            self.evicted.append(name)

    def _add(self, name: str, in_flight: bool) -> None:
        self.lru[name] = in_flight
        self.used += self.sizes[name]
        self.peak = max(self.peak, self.used)

    def fetch(self, name: str, upcoming: Sequence[str]) -> bool:
        """False when the fetch must be refused (units in use leave no room); state unchanged then."""
        if name in self.lru:
            self.hits += 1
        else:
            plan = self._room(self.sizes[name], set())
            if plan is None:
                return False
            self._evict(plan)
            self._add(name, False)
            self.misses += 1
        self.lru[name] = False
        self.lru.move_to_end(name)
        self.in_use.add(name)
        window = list(upcoming[: self.depth])
        for nxt in window:
            if nxt in self.lru:
                continue
            plan = self._room(self.sizes[nxt], set(window) | {name})
            if plan is None:
                self.skipped += 1
                continue
            self._evict(plan)
            self._add(nxt, self.async_prefetch)
        return True

    def update(self, name: str) -> None:
        if name in self.lru:
            del self.lru[name]
            self.used -= self.sizes[name]
        self.in_use.discard(name)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.float16]

op = st.tuples(st.sampled_from(["fetch", "fetch", "fetch", "update"]), st.integers(0, 5),
               st.lists(st.integers(0, 5), max_size=4), st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(units=st.lists(st.tuples(st.integers(0, 9), st.sampled_from(range(len(DTYPES)))),
                      min_size=1, max_size=6),
       extra=st.integers(0, 120), depth=st.integers(0, 3), async_prefetch=st.booleans(),
       ops=st.lists(op, min_size=1, max_size=40), seed=st.integers(0, 2**31 - 1))
def test_the_manager_follows_the_lru_model_and_never_exceeds_its_budget(
        units: list[tuple[int, int]], extra: int, depth: int, async_prefetch: bool,
        ops: list[tuple[str, int, list[int], bool]], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    names = [f"u{i}" for i in range(len(units))]

    def values(numel: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype.is_floating_point:
            return (torch.randn(numel, generator=gen) * 10).to(dtype)
        return torch.randint(-128, 128, (numel,), generator=gen).to(dtype)

    expected = {n: values(numel, DTYPES[d]) for n, (numel, d) in zip(names, units, strict=True)}
    sizes = {n: t.numel() * t.element_size() for n, t in expected.items()}
    budget = max(max(sizes.values()), 1) + extra
    mgr = OffloadManager(OffloadConfig(device_budget_bytes=budget, prefetch_depth=depth,
                                       async_prefetch=async_prefetch))
    for n in names:
        mgr.register_unit(n, expected[n])
    mgr.validate()
    model = LruModel(sizes, budget, depth, async_prefetch)
    fetches = 0
    for kind, idx, ahead, release in ops:
        name = names[idx % len(names)]
        if kind == "update":
            expected[name] = values(expected[name].numel(), expected[name].dtype)
            mgr.update_host(name, expected[name])
            model.update(name)
        else:
            upcoming = [names[i % len(names)] for i in ahead]
            if model.fetch(name, upcoming):
                out = mgr.fetch(name, upcoming)
                fetches += 1
                assert out.dtype == expected[name].dtype and bits(out) == bits(expected[name])
                if release:
                    mgr.release(name)
                    model.in_use.discard(name)
            else:
                with pytest.raises(OffloadBudgetError):
                    mgr.fetch(name, upcoming)
        mem, perf, status = mgr.memory_stats(), mgr.performance_stats(), mgr.prefetch_status()
        assert mem["device"]["peak"] <= budget and mem["device"]["current"] <= budget
        assert mem["device"]["current"] == model.used and mem["device"]["peak"] == model.peak
        assert status["resident"] == list(model.lru) == mem["resident_units"]
        assert status["in_flight"] == [n for n, flying in model.lru.items() if flying]
        assert set(status["in_use"]) == model.in_use
        assert mgr.eviction_log() == model.evicted
        assert perf["hits"] + perf["misses"] == perf["fetches"] == fetches
        assert (perf["hits"], perf["misses"], perf["prefetches_skipped"]) == \
            (model.hits, model.misses, model.skipped)


# ----------------------------------------------------------------------------------------- exactness

def _train(steps: int, offload: OffloadManager | None) -> tuple[list[torch.Tensor], list[float]]:
    """A small MLP trained with hand-written Adam on host masters; forward reads the parameters
    through ``offload`` when given (fetch with upcoming units, release after use, update_host after
    the step), else straight from the masters."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                              torch.nn.Tanh(), torch.nn.Linear(16, 4))
    names = [n for n, _ in net.named_parameters()]
    shapes = {n: p.shape for n, p in net.named_parameters()}
    master = {n: p.detach().reshape(-1).clone() for n, p in net.named_parameters()}
    m = {n: torch.zeros_like(t) for n, t in master.items()}
    v = {n: torch.zeros_like(t) for n, t in master.items()}
    if offload is not None:
        for n in names:
            offload.register_unit(n, master[n])
            offload.register_host_state(n, [m[n], v[n]])
        offload.validate()
    data = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    target = torch.randn(32, 4, generator=torch.Generator().manual_seed(2))
    losses = []
    for step in range(1, steps + 1):
        params = {}
        for i, n in enumerate(names):
            flat = master[n] if offload is None else offload.fetch(n, names[i + 1:])
            params[n] = flat.detach().clone().view(shapes[n]).requires_grad_(True)
            if offload is not None:
                offload.release(n)
        loss = torch.nn.functional.mse_loss(torch.func.functional_call(net, params, (data,)), target)
        loss.backward()
        losses.append(loss.item())
        for n in names:
            g = params[n].grad.reshape(-1)
            m[n].mul_(0.9).add_(g, alpha=0.1)
            v[n].mul_(0.999).addcmul_(g, g, value=0.001)
            denom = (v[n] / (1 - 0.999 ** step)).sqrt_().add_(1e-8)
            master[n].addcdiv_(m[n] / (1 - 0.9 ** step), denom, value=-1e-2)
            if offload is not None:
                offload.update_host(n, master[n])
    return [master[n].clone() for n in names], losses


@pytest.mark.parametrize(("depth", "async_prefetch"), [(0, True), (1, True), (2, False), (3, True)])
def test_offloaded_training_is_bitwise_equal_to_training_without_offload(depth: int,
                                                                         async_prefetch: bool) -> None:
    plain, plain_losses = _train(4, None)
    # the largest parameter is 16x16 fp32 = 1024 bytes: room for about two units at a time
    mgr = OffloadManager(OffloadConfig(device_budget_bytes=1024 + 256, prefetch_depth=depth,
                                       async_prefetch=async_prefetch))
    offloaded, offloaded_losses = _train(4, mgr)
    assert offloaded_losses == plain_losses
    assert [bits(t) for t in offloaded] == [bits(t) for t in plain]
    for name, t in zip(mgr.units, offloaded, strict=True):
        assert bits(mgr.host_copy(name)) == bits(t)
    perf, mem = mgr.performance_stats(), mgr.memory_stats()
    assert mem["device"]["peak"] <= 1024 + 256 and perf["fetches"] == 4 * 6
    assert perf["hits"] + perf["misses"] == perf["fetches"]
    assert mem["host"]["state"] == 2 * mem["host"]["shards"]
    if depth and async_prefetch:
        assert perf["prefetch_hits"] > 0
    assert perf["evictions"] > 0 or perf["invalidations"] > 0


# ---------------------------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU visible to torch)")
def test_cuda_prefetch_on_a_side_stream_returns_exact_bits_within_the_budget() -> None:
    order = [f"u{i}" for i in range(8)]
    numel = 1 << 16
    mgr = OffloadManager(OffloadConfig(device_budget_bytes=3 * numel * F32, prefetch_depth=2), device="cuda")
    host = {n: torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(order)}
    for n in order:
        mgr.register_unit(n, host[n])
    mgr.validate()
    assert mgr.memory_stats()["host"]["pinned"]
    for _ in range(2):
        for i, n in enumerate(order):
            out = mgr.fetch(n, order[i + 1:])
            assert out.is_cuda and bits(out.cpu()) == bits(host[n])
            mgr.release(n)
    host["u0"] = torch.randn(numel, generator=torch.Generator().manual_seed(99))
    mgr.update_host("u0", host["u0"].cuda())
    assert bits(mgr.fetch("u0").cpu()) == bits(host["u0"])
    perf, mem = mgr.performance_stats(), mgr.memory_stats()
    assert mem["device"]["peak"] <= 3 * numel * F32 and perf["prefetch_hits"] > 0
    assert perf["hits"] + perf["misses"] == perf["fetches"] == 17
    assert perf["bytes_device_to_host"] == numel * F32 and perf["asynchronous_copies"] is True
    assert perf["seconds_copying"] > 0 and 0.0 <= perf["overlap_fraction"] <= 1.0


def test_each_unit_goes_offloaded_in_flight_in_use_sharded_and_back() -> None:
    """One state per unit: a prefetch puts it in flight, a fetch in use, a release back to its resident
    shard, an eviction or an update of its host values back to the host tier only."""
    from zerosim.values.unit_state import UnitState

    mgr = manager(32, {"a": 4, "b": 4, "c": 4}, depth=1)  # room for two units
    assert {mgr.state_of(n) for n in "abc"} == {UnitState.OFFLOADED}
    mgr.fetch("a", ["b"])
    assert (mgr.state_of("a"), mgr.state_of("b"), mgr.state_of("c")) == \
        (UnitState.IN_USE, UnitState.IN_FLIGHT, UnitState.OFFLOADED)
    mgr.release("a")
    mgr.release("b")  # never fetched: releasing it leaves it in flight
    assert (mgr.state_of("a"), mgr.state_of("b")) == (UnitState.SHARDED, UnitState.IN_FLIGHT)
    mgr.fetch("b")
    assert mgr.state_of("b") is UnitState.IN_USE
    mgr.fetch("c")  # evicts a, the least recently used unit not in use
    assert (mgr.state_of("a"), mgr.state_of("c")) == (UnitState.OFFLOADED, UnitState.IN_USE)
    mgr.update_host("b", mgr.host_copy("b").clone())
    assert mgr.state_of("b") is UnitState.OFFLOADED
    status = mgr.prefetch_status()
    assert status["in_use"] == ["c"] and status["in_flight"] == []
