"""Check someone else's partition function against C-ZERO-001.

A user function ``fn(rank, world_size, total)`` returns the flat range(s) ``rank`` owns:

* ``(start, end)`` (or ``[start, end]``, ``range(start, end)``, or any object with ``param_start`` /
  ``param_end`` such as :class:`zerosim.OptimizerShard`), or
* a list of such ranges (possibly empty: the rank owns nothing).

:func:`check_partition` calls it for every rank of every (world size, total) in a sweep, turns the
answers into a ShardPlan per case and runs :func:`zerosim.checks.partition.check_partition_plan` on
it. The default sweep: world sizes 1..64 and 1024; totals 0, 1, small primes, totals smaller than
the world size, 10^12 and 2^61 - 1 (beyond float precision). About 56,000 calls: a second or two.

Bounds (each refused with one line stating the limit):

* a sweep makes at most :data:`MAX_CALLS` calls (2^20, about half a minute) and no world size is
  above :data:`zerosim.partition.MAX_WORLD_SIZE`; both are checked before the first call;
* one call may take at most ``call_timeout`` seconds (default :data:`DEFAULT_CALL_TIMEOUT_S`): the
  sweep runs in a daemon thread watched by the caller's thread, so a function that never returns
  ends the check with an ImplementationError naming the call, and cannot keep the process alive.
  Importing a ``module:function`` string is bounded the same way;
* the ranges returned for one (world size, total) case may number at most :data:`MAX_RANGES`
  (2^20): C-ZERO-001 sorts them all, and an unbounded answer would take unbounded time and memory.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..checks.judges import judge
from ..checks.partition import CONTRACT
from ..errors import ConfigError, ImplementationError, require_non_negative_int, require_positive_int
from ..files.dotted import import_dotted
from ..partition import MAX_WORLD_SIZE
from ..partition.base import RankShard, ShardPlan, ShardTable
from ..values.verdict import Violation

DEFAULT_WORLD_SIZES: tuple[int, ...] = tuple(range(1, 65)) + (1024,)
DEFAULT_TOTALS: tuple[int, ...] = (
    0, 1, 2, 3, 5, 7, 13, 31, 63, 64, 100, 1023, 1025, 65_537, 1_000_003, 2**31 - 1, 10**12, 2**61 - 1,
)
BALANCE_MODES = ("seed", "chunk", "none")
#: Calls one sweep may make (sum of the world sizes x number of totals): about half a minute of a
#: cheap Python function on two cores. The default sweep makes about 56,000.
MAX_CALLS = 2**20
#: Ranges the ranks of one (world size, total) case may return together (C-ZERO-001 sorts them all).
MAX_RANGES = 2**20
#: Seconds one call of the user's function (or the import of its module) may take.
DEFAULT_CALL_TIMEOUT_S = 10.0

PartitionFn = Callable[[int, int, int], Any]


@dataclass
class PartitionReport:
    """The outcome of sweeping a partition function: every C-ZERO-001 violation, with its case."""

    impl: str
    world_sizes: tuple[int, ...]
    totals: tuple[int, ...]
    balance: str
    cases: int = 0
    calls: int = 0
    violations: list[Violation] = field(default_factory=list)
    violations_by_clause: Counter = field(default_factory=Counter)
    failing_cases: list[tuple[int, int]] = field(default_factory=list)
    suppressed: int = 0  # violations counted but not kept (per-case and overall caps)
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.violations and not self.suppressed

    @property
    def total_violations(self) -> int:
        return len(self.violations) + self.suppressed

    def lines(self, limit: int | None = None) -> list[str]:
        """One line per violation (the first ``limit``), then a line saying how many were left out."""
        shown = self.violations if limit is None else self.violations[:limit]
        out = [str(v) for v in shown]
        hidden = self.total_violations - len(shown)
        if hidden > 0:
            out.append(f"... {hidden} more violations not shown (use --limit 0 or --json)")
        return out

    def summary(self) -> str:
        ws = describe_ints(self.world_sizes)
        head = (f"{self.cases} cases (world sizes {ws}; {len(self.totals)} totals), {self.calls:,} calls, "
                f"{self.elapsed_s:.2f} s")
        if self.passed:
            return f"{CONTRACT} holds for {self.impl}: {head}"
        clauses = ", ".join(f"{k} x{v}" for k, v in sorted(self.violations_by_clause.items()))
        return (f"{CONTRACT} violated by {self.impl}: {self.total_violations} violations ({clauses}) in "
                f"{len(self.failing_cases)} of {head}")

    def to_json(self) -> dict[str, Any]:
        return {
            "contract": CONTRACT, "impl": self.impl, "passed": self.passed, "balance": self.balance,
            "world_sizes": list(self.world_sizes), "totals": list(self.totals), "cases": self.cases,
            "calls": self.calls, "elapsed_s": self.elapsed_s, "total_violations": self.total_violations,
            "violations_by_clause": dict(self.violations_by_clause), "suppressed": self.suppressed,
            "failing_cases": [list(c) for c in self.failing_cases],
            "violations": [v.to_json() for v in self.violations],
        }


# ---- loading a user implementation ------------------------------------------------------------
def load_impl(spec: str, timeout: float | None = None) -> PartitionFn:
    """Import ``package.module:function`` (or ``path/to/file.py:function``); the cwd is importable.

    With ``timeout`` (seconds), an import that has not finished by then is an ImplementationError.
    """
    if timeout is None:
        return import_dotted(spec, "impl", allow_files=True)
    state = _Watched()
    state.call = ("import", time.monotonic())
    return _watch(lambda: import_dotted(spec, "impl", allow_files=True), state, timeout,
                  lambda what: f"impl {spec}: importing the module did not finish within {timeout:g} s "
                               "(the per-call timeout, --call-timeout S)")


class _Watched:
    """What the sweep thread is doing: ``call`` is (what, started) while a user call runs, else None."""

    def __init__(self) -> None:
        self.call: tuple[Any, float] | None = None
        self.cancelled = False


def _watch(target: Callable[[], Any], state: _Watched, timeout: float, message: Callable[[Any], str]) -> Any:
    """Run ``target`` in a daemon thread; return its result or raise what it raised. When the call
    recorded in ``state`` has run longer than ``timeout`` seconds, cancel and raise ImplementationError
    (the thread is abandoned: being a daemon, it never keeps the process alive)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = target()
        except BaseException as e:  # handed to the watching thread, which raises it
            box["error"] = e

    worker = threading.Thread(target=run, name="zerosim-check-impl", daemon=True)
    worker.start()
    poll = min(0.05, timeout / 4)
    while worker.is_alive():
        worker.join(poll)
        call = state.call
        if worker.is_alive() and call is not None and time.monotonic() - call[1] > timeout:
            state.cancelled = True
            raise ImplementationError(message(call[0]))
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _one_range(obj: Any) -> tuple[int, int] | None:
    """A single range in any accepted spelling, or None when ``obj`` is not one."""
    if isinstance(obj, range):
        return (obj.start, obj.stop) if obj.step == 1 else None
    if hasattr(obj, "param_start") and hasattr(obj, "param_end"):
        obj = (obj.param_start, obj.param_end)
    if isinstance(obj, tuple | list) and len(obj) == 2 and _is_int(obj[0]) and _is_int(obj[1]):
        return (int(obj[0]), int(obj[1]))
    return None


def as_intervals(result: Any) -> tuple[tuple[int, int], ...] | None:
    """Normalise a partition function's answer to a tuple of ``(start, end)``; None if malformed."""
    if hasattr(result, "tolist") and not isinstance(result, tuple | list):
        result = result.tolist()  # numpy arrays of shape (2,) or (k, 2)
    single = _one_range(result)
    if single is not None:
        return (single,)
    if isinstance(result, tuple | list):
        out = []
        for item in result:
            r = _one_range(item)
            if r is None:
                return None
            out.append(r)
        return tuple(out)
    return None


def describe_ints(values: Sequence[int]) -> str:
    """``1..64, 1024`` style summary of a sorted list of ints."""
    parts, vals = [], sorted(set(values))
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        parts.append(f"{vals[i]}..{vals[j]}" if j - i >= 2 else ", ".join(map(str, vals[i:j + 1])))
        i = j + 1
    return ", ".join(parts)


def balance_for(balance: str | int, world_size: int, total: int) -> tuple[int, dict[str, int]]:
    """(balance_bound, extra plan meta) for a balance mode."""
    if balance == "seed":
        return 1, {"balance_target": total // world_size, "balance_tolerance": 1}
    if balance == "chunk":
        return -(-total // world_size), {}
    if balance == "none":
        return total, {}
    return int(balance), {}


def _validate_balance(balance: Any) -> str | int:
    if isinstance(balance, str):
        if balance in BALANCE_MODES:
            return balance
        try:
            balance = int(balance)
        except ValueError:
            raise ConfigError(
                "balance", balance, f"must be one of {', '.join(BALANCE_MODES)} or an integer"
            ) from None
    return require_non_negative_int("balance", balance)


def _validate_ints(field_name: str, values: Iterable[int], positive: bool) -> tuple[int, ...]:
    try:
        vals = tuple(values)
    except TypeError:
        raise ConfigError(field_name, values, "must be a list of integers") from None
    if not vals:
        raise ConfigError(field_name, vals, "must not be empty")
    check = require_positive_int if positive else require_non_negative_int
    return tuple(check(field_name, v) for v in vals)


# ---- the sweep ------------------------------------------------------------------------------------
def check_partition(
    fn: PartitionFn | str,
    world_sizes: Iterable[int] = DEFAULT_WORLD_SIZES,
    totals: Iterable[int] = DEFAULT_TOTALS,
    *,
    balance: str | int = "seed",
    name: str | None = None,
    limit_per_case: int = 10,
    max_violations: int = 1000,
    call_timeout: float | None = DEFAULT_CALL_TIMEOUT_S,
) -> PartitionReport:
    """Sweep ``fn`` over every (world size, total) and check C-ZERO-001 on each resulting plan.

    ``balance``: ``"seed"`` (default: every shard within 1 of ``total // world_size`` and spread
    <= 1), ``"chunk"`` (spread <= ceil(total / world_size), for ceil-sized rules like torch.chunk),
    ``"none"``, or an integer bound on the spread. ``fn`` may be a ``module:function`` string.
    Raises ImplementationError if ``fn`` raises, returns something that is not a range or a list
    of ranges, returns more than :data:`MAX_RANGES` ranges for one case, or does not return within
    ``call_timeout`` seconds (each naming the rank, world size and total; ``call_timeout=None`` calls
    ``fn`` in this thread, unbounded); ConfigError for bad arguments, or a sweep above
    :data:`MAX_CALLS` calls or a world size above :data:`zerosim.partition.MAX_WORLD_SIZE`.
    """
    if call_timeout is not None:
        if isinstance(call_timeout, bool) or not isinstance(call_timeout, int | float) or not (
                0 < call_timeout < float("inf")):
            raise ConfigError("call_timeout", call_timeout, "must be a positive number of seconds (or None)")
    ws_list = _validate_ints("world_sizes", world_sizes, positive=True)
    total_list = _validate_ints("totals", totals, positive=False)
    balance = _validate_balance(balance)
    check_sweep_size(ws_list, len(total_list))
    if isinstance(fn, str):
        name = name or fn
        fn = load_impl(fn, call_timeout)
    if not callable(fn):
        raise ConfigError("fn", fn, "must be a callable (rank, world_size, total) -> (start, end)")
    name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
    report = PartitionReport(name, ws_list, total_list, str(balance))
    state = _Watched()
    t0 = time.perf_counter()
    if call_timeout is None:
        _sweep(fn, name, report, balance, limit_per_case, max_violations, state)
    else:
        _watch(lambda: _sweep(fn, name, report, balance, limit_per_case, max_violations, state), state,
               call_timeout,
               lambda call: f"impl {name}: no answer within {call_timeout:g} s for (rank={call[0]}, "
                            f"world_size={call[1]}, total={call[2]}) "
                            "(the per-call timeout, --call-timeout S)")
    report.elapsed_s = time.perf_counter() - t0
    return report


def check_sweep_size(world_sizes: Sequence[int], n_cases: int, what: str = "calls") -> None:
    """ConfigError unless every world size is at most MAX_WORLD_SIZE and the sweep over ``n_cases``
    totals (or layouts) makes at most MAX_CALLS ``what`` (one per rank of every case)."""
    for ws in world_sizes:
        if ws > MAX_WORLD_SIZE:
            raise ConfigError("world_size", ws, f"at most {MAX_WORLD_SIZE:,} (2^20) ranks: the function "
                              "is called once per rank and every shard is checked, seconds per case at "
                              "2^20 ranks")
    n = sum(world_sizes) * n_cases
    if n > MAX_CALLS:
        raise ConfigError("world_sizes", describe_ints(world_sizes),
                          f"the sweep makes {n:,} {what} ({sum(world_sizes):,} ranks x {n_cases} "
                          f"total(s)), above the limit of {MAX_CALLS:,} (2^20, about half a minute on two "
                          "cores); check fewer or smaller world sizes")


def _sweep(fn: PartitionFn, name: str, report: PartitionReport, balance: str | int, limit_per_case: int,
           max_violations: int, state: _Watched) -> None:
    """Call ``fn`` for every rank of every case and check each case's plan; ``state.call`` names the
    call in progress (for the watchdog) and ``state.cancelled`` stops the sweep."""
    for total in report.totals:
        for ws in report.world_sizes:
            shards = []
            ranges = 0
            for rank in range(ws):
                if state.cancelled:
                    return
                state.call = ((rank, ws, total), time.monotonic())
                try:
                    result = fn(rank, ws, total)
                except (Exception, SystemExit) as e:  # sys.exit() in user code is its failure too
                    raise ImplementationError(
                        f"impl {name}: raised {type(e).__name__}: {e} "
                        f"for (rank={rank}, world_size={ws}, total={total})") from e
                finally:
                    state.call = None
                n = _length(result)
                if ranges + n > MAX_RANGES:
                    raise ImplementationError(
                        f"impl {name}: returned {n:,} ranges for (rank={rank}, world_size={ws}, "
                        f"total={total})"
                        + (f" after {ranges:,} from the ranks before it" if ranges else "")
                        + f"; at most {MAX_RANGES:,} (2^20) ranges per (world size, total) case are checked "
                        "(C-ZERO-001 sorts them all; more would take unbounded time and memory)")
                intervals = as_intervals(result)
                if intervals is None:
                    raise ImplementationError(
                        f"impl {name}: returned {_short(result)} for (rank={rank}, world_size={ws}, "
                        f"total={total}); "
                        "expected (start, end) as ints, range(start, end), or a list of those"
                    )
                ranges += len(intervals)
                shards.append(RankShard(rank, intervals, 0))
            report.calls += ws
            bound, meta = balance_for(balance, ws, total)
            table = ShardTable.from_lists([sh.intervals for sh in shards], [0] * ws)
            plan = ShardPlan(name, ws, total, tuple(shards) if table is None else table, bound,
                             "user partition function", meta)
            verdict = judge(CONTRACT, plan, limit=limit_per_case)
            report.cases += 1
            counts = verdict.details.get("violations_by_clause", {})
            if counts:
                report.failing_cases.append((ws, total))
                report.violations_by_clause.update(counts)
                room = max(0, max_violations - len(report.violations))
                report.violations += verdict.violations[:room]
                report.suppressed += sum(counts.values()) - min(room, len(verdict.violations))


def _length(result: Any) -> int:
    """Ranges an answer holds at most, without converting it (a single range counts as one)."""
    if _one_range(result) is not None:
        return 1
    try:
        return len(result) if isinstance(result, tuple | list) or hasattr(result, "tolist") else 1
    except TypeError:  # a 0-d array, or a length that cannot be taken: as_intervals rejects it
        return 1


def _short(obj: Any, width: int = 80) -> str:
    text = f"{type(obj).__name__} {obj!r}"
    return text if len(text) <= width else text[: width - 3] + "..."
