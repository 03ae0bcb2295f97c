"""zerosim.check_partition: sweeping a user's partition function, and its errors."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from zerosim import ConfigError, OptimizerShard, check_partition
from zerosim.errors import ImplementationError
from zerosim.testing.check_impl import DEFAULT_TOTALS, DEFAULT_WORLD_SIZES, as_intervals, load_impl

SMALL_WS = range(1, 9)
SMALL_TOTALS = (0, 1, 5, 7, 10, 97)


def seed_rule(rank, world_size, total):
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def test_default_sweep_covers_what_the_contract_needs():
    assert set(range(1, 65)) | {1024} == set(DEFAULT_WORLD_SIZES)
    assert {0, 1, 7, 1_000_003, 10**12} <= set(DEFAULT_TOTALS)
    assert any(t < 64 for t in DEFAULT_TOTALS if t > 1)  # totals smaller than the world size
    assert max(DEFAULT_TOTALS) > 2**53  # beyond float precision


def test_correct_function_passes_the_full_default_sweep():
    report = check_partition(seed_rule)
    assert report.passed and report.violations == []
    assert report.cases == len(DEFAULT_WORLD_SIZES) * len(DEFAULT_TOTALS)
    assert report.calls == sum(DEFAULT_WORLD_SIZES) * len(DEFAULT_TOTALS)
    assert "holds" in report.summary()


def test_the_examples_module():
    assert check_partition("examples.my_partitioner:even_split").passed
    remainder = check_partition("examples.my_partitioner:last_rank_takes_remainder")
    assert set(remainder.violations_by_clause) == {"balance"}
    v = remainder.violations[0]
    assert v.ranks == (v.context["world_size"] - 1,)
    floats = check_partition("examples.my_partitioner:float_split")
    assert not floats.passed
    assert all(t > 2**53 for _, t in floats.failing_cases)


def test_forgotten_remainder_reports_coverage_with_case_and_interval():
    def forgets(rank, ws, total):
        base = total // ws
        return rank * base, (rank + 1) * base

    report = check_partition(forgets, SMALL_WS, SMALL_TOTALS)
    assert set(report.violations_by_clause) == {"coverage"}
    v = next(v for v in report.violations if v.context == {"world_size": 3, "total": 7})
    assert v.interval == (6, 7) and v.ranks == (2,)
    assert str(v).startswith("C-ZERO-001 coverage world_size=3 total=7 rank=2 range=[6, 7)")
    assert (3, 7) in report.failing_cases and (1, 7) not in report.failing_cases


def test_overlap_reports_disjoint_with_both_ranks():
    def ceil_unclamped(rank, ws, total):
        c = -(-total // ws)
        return min(rank * c, total), min(rank * c + c + 1, total)  # one element too many

    report = check_partition(ceil_unclamped, SMALL_WS, SMALL_TOTALS, balance="none")
    assert set(report.violations_by_clause) == {"disjoint"}
    v = report.violations[0]
    assert len(v.ranks) == 2 and v.ranks[0] != v.ranks[1] and v.interval[1] - v.interval[0] >= 1


def test_padding_past_total_reported_as_padding():
    def pads(rank, ws, total):
        c = -(-total // ws)
        return rank * c, (rank + 1) * c  # DeepSpeed-style equal parts, padding counted as data

    report = check_partition(pads, SMALL_WS, SMALL_TOTALS, balance="chunk")
    assert set(report.violations_by_clause) == {"padding"}
    v = next(v for v in report.violations if v.context == {"world_size": 4, "total": 7})
    assert v.interval == (7, 8) and v.ranks == (3,)


def test_balance_modes():
    def chunk(rank, ws, total):
        c = -(-total // ws)
        return min(rank * c, total), min((rank + 1) * c, total)  # torch.chunk sizes: 2, 2, 1, 0

    assert not check_partition(chunk, SMALL_WS, SMALL_TOTALS).passed  # the seed's clause is stricter
    assert check_partition(chunk, SMALL_WS, SMALL_TOTALS, balance="chunk").passed
    assert check_partition(chunk, SMALL_WS, SMALL_TOTALS, balance="none").passed
    assert not check_partition(chunk, SMALL_WS, (97,), balance=5).passed  # 97/8: 13 vs 6 -> spread 7
    with pytest.raises(ConfigError) as e:
        check_partition(chunk, balance="fair")
    assert e.value.field == "balance"


@pytest.mark.parametrize("answer", [
    lambda r, w, t: [seed_rule(r, w, t)],                       # list of one range
    lambda r, w, t: range(*seed_rule(r, w, t)),                 # a range object
    lambda r, w, t: list(seed_rule(r, w, t)),                   # [start, end]
    lambda r, w, t: OptimizerShard.for_rank(r, w, t),           # our own OptimizerShard
    lambda r, w, t: np.array(seed_rule(r, w, t), dtype=np.int64),     # numpy pair
    lambda r, w, t: [(np.int64(a), np.int64(b)) for a, b in [seed_rule(r, w, t)]],
    lambda r, w, t: [(s, s + 1) for s in range(*seed_rule(r, w, t))],  # one range per element
])
def test_accepted_return_spellings(answer):
    report = check_partition(answer, SMALL_WS, (0, 1, 5, 97), balance="none")
    assert report.passed, report.lines(3)


def test_multiple_ranges_per_rank_round_robin_elements():
    def strided(rank, ws, total):
        return [(i, i + 1) for i in range(rank, total, ws)]

    assert check_partition(strided, SMALL_WS, SMALL_TOTALS).passed


@pytest.mark.parametrize(
    "bad",
    [None, 3, (1.0, 2.0), ("a", "b"), (1, 2, 3), [(1, 2), 5], {"start": 0}, range(0, 10, 2), (True, False)],
)
def test_wrong_return_type_is_an_implementation_error_naming_the_case(bad):
    with pytest.raises(ImplementationError) as e:
        check_partition(lambda r, w, t: bad, [3], [10], name="buggy")
    msg = str(e.value)
    assert "buggy" in msg and "rank=0" in msg and "world_size=3" in msg and "total=10" in msg


def test_raising_function_is_an_implementation_error_naming_the_case():
    def divides_by_zero_when_small(rank, ws, total):
        if rank == 0:
            return 0, total // (total - ws)  # ZeroDivisionError when total == world_size
        return total, total

    with pytest.raises(ImplementationError) as e:
        check_partition(divides_by_zero_when_small, [2, 4], [4], name="mine")
    assert "ZeroDivisionError" in str(e.value) and "rank=0, world_size=4, total=4" in str(e.value)


def test_sys_exit_in_the_function_is_its_failure_not_our_exit_status():
    """SystemExit(3) would read as "a rank failed"; it is reported as the implementation's error."""

    def exits(rank, ws, total):
        raise SystemExit(7)

    with pytest.raises(ImplementationError, match=r"raised SystemExit: 7 for \(rank=0"):
        check_partition(exits, [2], [4], name="mine")


def test_bad_sweep_arguments_are_config_errors():
    for kwargs, field in [({"world_sizes": [0]}, "world_sizes"), ({"world_sizes": [4, -1]}, "world_sizes"),
                          ({"totals": [-5]}, "totals"), ({"totals": []}, "totals"),
                          ({"world_sizes": 7}, "world_sizes")]:
        with pytest.raises(ConfigError) as e:
            check_partition(seed_rule, **kwargs)
        assert e.value.field == field
    with pytest.raises(ConfigError) as e:
        check_partition(42)
    assert e.value.field == "fn"


def test_load_impl_errors(tmp_path, monkeypatch):
    with pytest.raises(ConfigError):
        load_impl("no_colon_here")
    with pytest.raises(ImplementationError, match="cannot import"):
        load_impl("zerosim_no_such_module:fn")
    with pytest.raises(ImplementationError, match="no attribute"):
        load_impl("examples.my_partitioner:nope")
    with pytest.raises(ImplementationError, match="not callable"):
        load_impl("zerosim.testing.check_impl:DEFAULT_TOTALS")
    broken = tmp_path / "broken_part.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImplementationError, match="RuntimeError: boom at import"):
        load_impl("broken_part:fn")
    with pytest.raises(ImplementationError, match="no such file"):
        load_impl(str(tmp_path / "missing.py") + ":fn")
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ImplementationError, match="cannot import 'exits_on_import': SystemExit: 3"):
        load_impl("exits_on_import:fn")


def test_load_impl_from_a_file_path(tmp_path):
    f = tmp_path / "user_rule.py"
    f.write_text(textwrap.dedent("""
        def split(rank, world_size, total):
            base, extra = divmod(total, world_size)
            start = rank * base + min(rank, extra)
            return start, start + base + (rank < extra)
    """))
    report = check_partition(f"{f}:split", SMALL_WS, SMALL_TOTALS)
    assert report.passed and report.impl.endswith("user_rule.py:split")


def test_report_json_and_lines_are_capped():
    def forgets(rank, ws, total):
        return rank * (total // ws), (rank + 1) * (total // ws)

    report = check_partition(forgets, max_violations=30)
    assert len(report.violations) == 30 and report.suppressed > 0
    assert report.total_violations == sum(report.violations_by_clause.values())
    lines = report.lines(10)
    assert len(lines) == 11 and "more violations not shown" in lines[-1]
    data = json.loads(json.dumps(report.to_json()))
    assert data["passed"] is False and data["violations"][0]["contract"] == "C-ZERO-001"
    assert data["total_violations"] == report.total_violations


def test_as_intervals_rejects_ambiguous_and_accepts_empty():
    assert as_intervals([]) == ()
    assert as_intervals(()) == ()
    assert as_intervals((3, 5)) == ((3, 5),)
    assert as_intervals([(1, 2), [3, 4]]) == ((1, 2), (3, 4))
    assert as_intervals([(1, 2), (3,)]) is None
