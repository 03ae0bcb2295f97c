"""``torchrun --nproc-per-node N -m zerogpu selftest-comm``: the TorchCommunicator checked on its own ranks.

Every rank builds every rank's input from a seed, so it can compute the expected result of each
collective with numpy (reductions in rank order, as the simulator does) and compare with what
torch.distributed returned. Checked: every collective and reduce op for float32 / float64 /
bfloat16 / float16 / int64 / bool; every reduce-scatter path (the backend's own, one reduce per
chunk, the all-reduce fallback), with and without a donated input, and all-gather path (the
backend's own, one broadcast per chunk), also gathering straight into interleaved destinations
(``all_gather_into``); torch and numpy arrays in and out, inputs left unmodified; ``split`` (colors, key
order, names, nested splits, opting out); bad input raising our errors; and the traffic counter
against an independent replay of the ring model (:func:`zerosim.comm.base.ring_bytes`).

Rank 0 prints one line per check (``OK name`` or ``FAIL name: rank r: ...``) or, with ``--json``,
a JSON object; exit status 0 when every check passed on every rank, 1 otherwise. Runs on gloo/CPU
(tests/test_zerogpu_torchrun.py) and on NCCL/CUDA (tests/test_zerogpu_gpu.py, ``--device cuda``).
"""

from __future__ import annotations

import json
import sys
import traceback
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

from zerosim.comm.base import TrafficCounter
from zerosim.errors import CollectiveError, ConfigError, ZeroSimError

BF16 = np.dtype(ml_dtypes.bfloat16)


def rank_input(rank: int, n: int, dtype: Any, salt: int = 0) -> np.ndarray:
    """The seeded input of ``rank`` (every rank can compute every other rank's)."""
    rng = np.random.default_rng(1000 * salt + rank)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return rng.standard_normal(n).astype(np.float32).astype(dtype)


def rank_order(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The simulator's reduction: ((x0 op x1) op x2) ... in the inputs' dtype; avg = sum / n."""
    acc = xs[0].copy()
    for x in xs[1:]:
        if op == "max":
            acc = np.maximum(acc, x)
        elif acc.dtype == np.bool_:
            acc = acc | x
        else:
            acc = (acc + x).astype(acc.dtype)
    if op == "avg":
        acc = (acc / np.array(len(xs), dtype=acc.dtype)).astype(acc.dtype)
    return acc


class Checks:
    """Collects named checks; a failing check records its message and the others go on."""

    def __init__(self, rank: int):
        self.rank = rank
        self.results: dict[str, str | None] = {}  # name -> None (passed) or the failure message

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results.setdefault(name, None)
        except CollectiveError:
            raise  # the group is unusable after a collective failed: stop here
        except Exception as e:  # noqa: BLE001 - a failed check is a result
            detail = "" if isinstance(e, (AssertionError, ZeroSimError)) else "\n" + traceback.format_exc()
            self.results[name] = f"{type(e).__name__}: {e}{detail}"


def _equal(
    got: Any, want: np.ndarray, exact: bool, what: str, n: int, xs: list[np.ndarray] | None = None
) -> None:
    """Bitwise equality where the result is exact (moves, max, integers, two-rank sums); otherwise the
    rounding bound of a sum taken in another order: ``|got - want| <= n * eps * sum_k |x_k|``."""
    g = np.asarray(got)
    assert g.dtype == want.dtype and g.shape == want.shape, (
        f"{what}: got {g.dtype}{g.shape}, want {want.dtype}{want.shape}"
    )
    if exact or want.dtype.kind in "biu" or n <= 2 or xs is None:
        assert np.array_equal(g.view(np.uint8), want.view(np.uint8)), f"{what}: not bitwise equal to numpy"
        return
    eps = float(ml_dtypes.finfo(want.dtype).eps)
    bound = n * eps * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    err = np.abs(g.astype(np.float64) - want.astype(np.float64))
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), (
        f"{what}: element {worst} differs by {err[worst]:.3g}, beyond the reordering bound {bound[worst]:.3g}"
    )


def run_checks(comm: Any) -> dict[str, str | None]:
    """Every check on this rank; returns name -> None or failure message."""
    import torch

    from .comm import TorchCommunicator, UnsupportedCollective

    n, r = comm.world_size, comm.rank
    ns = comm._ns
    checks = Checks(comm.global_rank)
    expected = TrafficCounter()  # an independent replay of what every call should record

    def on(c: Any) -> TorchCommunicator:
        return c

    # -- reductions ----------------------------------------------------------------------------
    cases = [
        ("float32", "sum"),
        ("float32", "avg"),
        ("float32", "max"),
        ("float64", "sum"),
        ("float64", "avg"),
        ("bfloat16", "sum"),
        ("bfloat16", "avg"),
        ("float16", "max"),
        ("int64", "sum"),
        ("int64", "max"),
    ]
    for dtype_name, op in cases:
        dtype = BF16 if dtype_name == "bfloat16" else np.dtype(dtype_name)

        def reduce_case(dtype: np.dtype = dtype, op: str = op, dtype_name: str = dtype_name) -> None:
            xs = [rank_input(k, 8 * n, dtype, salt=1) for k in range(n)]
            x = ns.from_numpy(xs[r], copy=True)
            before = x.clone()
            got = comm.all_reduce(x, op)
            expected.record(comm.group_name, "all_reduce", xs[r].nbytes, n)
            assert isinstance(got, torch.Tensor) and str(got.device).startswith(comm.device.split(":")[0])
            assert torch.equal(x, before), "all_reduce modified its input"
            _equal(ns.to_numpy(got), rank_order(xs, op), op == "max", f"all_reduce {dtype_name} {op}", n, xs)
            if op == "sum":
                got_rs = comm.reduce_scatter(x, op)
                expected.record(comm.group_name, "reduce_scatter", xs[r].nbytes, n)
                _equal(ns.to_numpy(got_rs), rank_order(xs, op)[r * 8:(r + 1) * 8], False,
                       f"reduce_scatter {dtype_name} {op}", n, [x[r * 8:(r + 1) * 8] for x in xs])

        checks.run(f"reduce {dtype_name} {op}", reduce_case)

    # -- every path of reduce-scatter and all-gather: the same values, the same recorded traffic -------
    def paths_comm(name: str, reduce_scatter: str = "auto", all_gather: str = "auto") -> TorchCommunicator:
        return TorchCommunicator(comm.process_group, comm.device, timeout_s=comm.timeout_s,
                                 group_name=f"paths.{name}", traffic=TrafficCounter(),
                                 reduce_scatter=reduce_scatter, all_gather=all_gather)

    def native_available(run: Callable[[], Any]) -> bool:
        try:
            run()
        except UnsupportedCollective:
            return False  # this backend has no such collective of its own
        return True

    def reduce_scatter_paths() -> None:
        xs = [rank_input(k, 6 * n, np.float32, salt=2) for k in range(n)]
        want = rank_order(xs, "avg")[r * 6:(r + 1) * 6]
        chunks = [x[r * 6:(r + 1) * 6] for x in xs]
        results, traffic = {}, {}
        for mode in ("native", "reduce", "all_reduce"):
            c = paths_comm("rs", reduce_scatter=mode)
            given = xs[r].copy()

            def run(c: TorchCommunicator = c, given: np.ndarray = given, mode: str = mode) -> None:
                results[mode] = c.reduce_scatter(given, "avg")  # numpy in -> numpy out

            if not native_available(run):
                continue
            assert isinstance(results[mode], np.ndarray), "numpy in should give numpy out"
            assert np.array_equal(given, xs[r]), f"reduce_scatter ({mode}) modified its input"
            _equal(results[mode], want, False, f"reduce_scatter avg ({mode})", n, chunks)
            donated = c.reduce_scatter(xs[r].copy(), "avg", donate=True)  # the input as scratch space
            assert np.array_equal(donated, results[mode]), \
                f"reduce_scatter ({mode}) with a donated input differs"
            traffic[mode] = c.traffic.to_json()
            if mode == "all_reduce" and n > 1:
                assert c.fallbacks.get("reduce_scatter") == 2, f"fallback calls counted: {c.fallbacks}"
        assert len(set(map(json.dumps, traffic.values()))) == 1, \
            f"every path must be recorded as the reduce-scatter the engine asked for: {traffic}"

    checks.run("reduce_scatter paths", reduce_scatter_paths)

    def all_gather_paths() -> None:
        for dtype_name in ("float32", "bool"):
            xs = [rank_input(k, 5, np.dtype(dtype_name), salt=7) for k in range(n)]
            traffic = {}
            for mode in ("native", "broadcast"):
                c = paths_comm("ag", all_gather=mode)
                got: list[Any] = []

                def run(c: TorchCommunicator = c, got: list[Any] = got, x: np.ndarray = xs[r]) -> None:
                    got.append(c.all_gather(x.copy()))

                if not native_available(run):
                    continue
                _equal(got[0], np.concatenate(xs), True, f"all_gather {dtype_name} ({mode})", n)
                traffic[mode] = c.traffic.to_json()
            assert len(set(map(json.dumps, traffic.values()))) == 1, \
                f"every path must be recorded as the all-gather the engine asked for: {traffic}"

    checks.run("all_gather paths", all_gather_paths)

    def all_gather_into_paths() -> None:
        # each rank's chunk: one piece long enough to be broadcast into directly, two short ones that
        # travel staged, and padding nobody receives; the pieces land interleaved in one full buffer
        from .comm import DIRECT_GATHER_MIN

        long, short = DIRECT_GATHER_MIN, 7
        chunk = long + 2 * short + 3
        xs = [rank_input(k, chunk, np.float32, salt=8) for k in range(n)]
        for mode in ("native", "broadcast"):
            c = paths_comm("agi", all_gather=mode)
            full = torch.full((n * (chunk - 3),), float("nan"), device=c._torch_device)
            want = np.empty(n * (chunk - 3), np.float32)
            dests = []
            for j in range(n):
                at = j * short  # the short pieces first, the long one after all of them
                spans = [(0, n * 2 * short + j * long, long), (long, at, short),
                         (long + short, n * short + at, short)]
                dests.append([(off, full[start:start + size]) for off, start, size in spans])
                for off, start, size in spans:
                    want[start:start + size] = xs[j][off:off + size]
            mine = torch.from_numpy(xs[r].copy()).to(c._torch_device)
            try:
                c.all_gather_into(mine, dests)
            except UnsupportedCollective:
                continue  # this backend has no all-gather of its own
            _equal(ns.to_numpy(full), want, True, f"all_gather_into ({mode})", n)
            reference = TrafficCounter()
            reference.record(c.group_name, "all_gather", xs[r].nbytes * n, n)
            assert c.traffic.to_json() == reference.to_json(), \
                f"all_gather_into ({mode}) must be recorded as one all-gather: {c.traffic.to_json()}"

    checks.run("all_gather_into paths", all_gather_into_paths)

    # -- gathers and broadcasts move every dtype exactly ---------------------------------------------
    for dtype_name in ("float32", "bfloat16", "int64", "bool"):
        dtype = BF16 if dtype_name == "bfloat16" else np.dtype(dtype_name)

        def gather_case(dtype: np.dtype = dtype, dtype_name: str = dtype_name) -> None:
            xs = [rank_input(k, 5, dtype, salt=3) for k in range(n)]
            got = comm.all_gather(ns.from_numpy(xs[r], copy=True))
            expected.record(comm.group_name, "all_gather", xs[r].nbytes * n, n)
            _equal(ns.to_numpy(got), np.concatenate(xs), True, f"all_gather {dtype_name}", n)
            for root in range(n):
                shaped = rank_input(r, 6, dtype, salt=4 + root).reshape(2, 3)
                got_b = comm.broadcast(ns.from_numpy(shaped, copy=True), root)
                expected.record(comm.group_name, "broadcast", shaped.nbytes, n, is_root=r == root)
                _equal(ns.to_numpy(got_b), rank_input(root, 6, dtype, salt=4 + root).reshape(2, 3), True,
                       f"broadcast {dtype_name} root={root}", n)

        checks.run(f"gather/broadcast {dtype_name}", gather_case)

    def scalar_and_barrier() -> None:
        got = comm.all_reduce(np.float64(r + 1), "sum")  # 0-d numpy in -> 0-d numpy out
        expected.record(comm.group_name, "all_reduce", 8, n)
        assert isinstance(got, np.ndarray) and got.shape == () and float(got) == n * (n + 1) / 2, got
        comm.barrier()
        expected.record(comm.group_name, "barrier", 0, n)

    checks.run("scalar+barrier", scalar_and_barrier)

    # -- bad input: our errors, raised before anything moves -------------------------------------------
    def bad_input() -> None:
        x = ns.from_numpy(np.zeros(2 * n, np.float32))
        cases: list[tuple[Callable[[], Any], type[Exception]]] = [
            (lambda: comm.all_reduce(x, "prod"), ConfigError),
            (lambda: comm.all_reduce(ns.from_numpy(np.zeros(3, np.int64)), "avg"), ConfigError),
            (lambda: comm.broadcast(x, n), ConfigError),
            (lambda: comm.broadcast(x, True), ConfigError),
            (lambda: comm.reduce_scatter(ns.from_numpy(np.zeros((n, 2), np.float32))), CollectiveError),
            (lambda: comm.all_gather(ns.from_numpy(np.zeros((2, 2), np.float32))), CollectiveError),
            (lambda: comm.split(-1), ConfigError),
            (lambda: comm.split(0, key=1.5), ConfigError),
            (lambda: comm.all_reduce("not an array"), ConfigError),
        ]
        if n > 1:
            cases.append(
                (lambda: comm.reduce_scatter(ns.from_numpy(np.zeros(n + 1, np.float32))), CollectiveError)
            )
        for i, (call, err) in enumerate(cases):
            try:
                call()
            except err:
                continue
            except Exception as e:  # noqa: BLE001
                raise AssertionError(
                    f"bad input #{i}: raised {type(e).__name__}: {e}, want {err.__name__}"
                ) from e
            raise AssertionError(f"bad input #{i}: nothing raised, want {err.__name__}")

    checks.run("bad input", bad_input)

    # -- split: colors, key order, names, nesting, opting out; traffic into the parent's counter --------
    def split_case() -> None:
        color = r % 2
        sub = comm.split(color, key=-r, name=f"parity[{color}]")  # key reverses the rank order
        members = sorted((k for k in range(n) if k % 2 == color), reverse=True)
        assert sub is not None and sub.group_name == f"parity[{color}]", sub
        assert sub.traffic is comm.traffic, "a split group must record into its parent's counter"
        assert list(sub.global_ranks) == [comm.global_ranks[k] for k in members], (sub.global_ranks, members)
        assert sub.rank == members.index(r) and sub.world_size == len(members)
        xs = {k: rank_input(k, 4 * len(members), np.float32, salt=9) for k in members}
        got = sub.all_reduce(ns.from_numpy(xs[r], copy=True), "sum")
        expected.record(sub.group_name, "all_reduce", xs[r].nbytes, len(members))
        _equal(ns.to_numpy(got), rank_order([xs[k] for k in members], "sum"), False, "all_reduce on a split",
               len(members), [xs[k] for k in members])
        got = sub.all_gather(ns.from_numpy(xs[r][:2], copy=True))
        expected.record(sub.group_name, "all_gather", xs[r][:2].nbytes * len(members), len(members))
        _equal(
            ns.to_numpy(got), np.concatenate([xs[k][:2] for k in members]), True, "all_gather on a split", n
        )
        default = comm.split(0)
        assert default is not None and default.world_size == n
        assert default.group_name.startswith(f"{comm.group_name}/split") and default.group_name.endswith(":0")
        out = comm.split(None if r == 0 else 1, name="all-but-0")
        assert (out is None) == (r == 0), out
        if out is not None:
            assert out.world_size == n - 1 and 0 not in out.global_ranks
        if len(members) > 1:  # a split of a split (local synchronisation)
            nested = sub.split(0, name=f"parity[{color}].nested")
            assert nested is not None and nested.world_size == len(members)
            got = nested.broadcast(ns.from_numpy(np.array([r], np.int64)), 0)
            expected.record(nested.group_name, "broadcast", 8, len(members), is_root=nested.rank == 0)
            assert int(ns.to_numpy(got)[0]) == members[0], (got, members)

    checks.run("split", split_case)

    # -- traffic: the counter equals the ring-model replay of every call above --------------------------
    def traffic_case() -> None:
        got = {
            k: (v.calls, v.bytes_sent, v.bytes_received, v.payload_bytes)
            for k, v in comm.traffic.records.items()
        }
        want = {
            k: (v.calls, v.bytes_sent, v.bytes_received, v.payload_bytes) for k, v in expected.records.items()
        }
        assert got == want, f"traffic differs from the ring model: got {got}, want {want}"
        if n > 1:
            assert comm.traffic.total_sent(collective="all_reduce") > Fraction(0)

    checks.run("traffic", traffic_case)
    return checks.results


def selftest_rank(args: Any) -> None:
    """One rank of ``selftest-comm``; ``args`` are its parsed options (``device``, ``dist_backend``,
    ``timeout``, ``json``: :func:`zerosim.cli.gpu.selftest_parser`)."""
    from .rank import fail_on_bad_input, run_rank

    try:
        from .comm import resolve_backend, resolve_device

        device = resolve_device(args.device)
        backend = resolve_backend(args.dist_backend, device)
    except ZeroSimError as e:
        fail_on_bad_input(e)

    def body() -> int:
        from .comm import init_distributed

        comm = init_distributed(backend, device, args.timeout)
        results = run_checks(comm)
        everyone = comm.gather_object(results, root=0)
        code = 0
        if comm.rank == 0:
            assert everyone is not None
            merged: dict[str, list[str]] = {}
            for rank, res in enumerate(everyone):
                for name, msg in res.items():
                    merged.setdefault(name, [])
                    if msg is not None:
                        merged[name].append(f"rank {rank}: {msg}")
            code = 0 if not any(merged.values()) else 1
            if args.json:
                json.dump({"world_size": comm.world_size, "device": comm.device, "backend": comm._job.backend,
                           "passed": code == 0, "checks": merged}, sys.stdout, indent=2)
                print()
            else:
                for name, fails in merged.items():
                    print(f"OK {name}" if not fails else f"FAIL {name}: {'; '.join(fails)}")
            sys.stdout.flush()
        return int(comm.broadcast_object(code, root=0))

    run_rank(body)
