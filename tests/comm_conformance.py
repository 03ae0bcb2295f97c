"""The Communicator conformance cases: what every backend (simulator, MPI, torch.distributed) must do.

Each case is ``case(comm, exact) -> None``, run on every rank of a group. It first issues all its
collectives (so the ranks stay in lockstep whatever the outcome), then checks on this rank:

- the values against numpy: every rank rebuilds every rank's seeded input and reduces in rank order
  (the simulator's arithmetic). Moves (all-gather, broadcast), ``max`` and integer sums are compared
  bit for bit. A floating sum or average is compared bit for bit when ``exact`` (the backend
  promises rank order: the simulator) or the group has at most two ranks (one addition commutes);
  otherwise within the reordering bound ``|got - want| <= n * eps * sum_k |x_k|``: each side rounds
  at most ``n`` times (``n - 1`` additions and the division of ``avg``), each time by at most
  ``eps / 2`` of a partial result bounded by ``sum_k |x_k|``;
- the input arrays left unmodified and the result's dtype and shape;
- the traffic the call added to ``comm.traffic`` against the ring model of
  :class:`zerosim.cost.comm_model.CollectiveCost` (all-reduce ``2(n-1)/n S``, reduce-scatter and
  all-gather ``(n-1)/n S`` sent and received; broadcast ``S`` sent by the root, received by the others).

Run in process by tests/test_comm_conformance.py for the simulator; for MPI and torch.distributed
that test launches this file once per backend (``python tests/comm_conformance.py cases --backend
mpi|torch``): every rank runs every case, rank 0 prints one ``CONFORMANCE {json}`` line with each
case's failures per rank. ``fault`` mode runs a short loop of collectives under the backend's rank
failure policy, for the timeout and failed-rank cases (``ZEROSIM_FAULT`` set by the test).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np

from zerosim.comm.base import COLLECTIVES
from zerosim.cost.comm_model import CollectiveCost
from zerosim.errors import CollectiveError, ConfigError, ZeroSimError

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT_DTYPES = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": BF16,
}
INT_DTYPES = {"int32": np.dtype(np.int32), "int64": np.dtype(np.int64)}
MOVE_ONLY_DTYPES = {
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
    "complex64": np.dtype(np.complex64),
}
REDUCE_DTYPES = {**FLOAT_DTYPES, **INT_DTYPES}
ALL_DTYPES = {**REDUCE_DTYPES, **MOVE_ONLY_DTYPES}
ODD_LENGTHS = (1, 7, 33)  # all-reduce buffers; reduce-scatter chunks and all-gather pieces alike

Case = Callable[[Any, bool], None]


# ---- inputs and the rank-order reference --------------------------------------------------------


def rank_input(rank: int, length: int, dtype: np.dtype, salt: int) -> np.ndarray:
    """``rank``'s seeded input; every rank can compute every other rank's."""
    rng = np.random.default_rng([salt, rank, length])
    if dtype.kind == "b":
        return rng.random(length) < 0.4
    if dtype.kind == "u":
        return rng.integers(0, 100, length).astype(dtype)
    if dtype.kind == "i":
        return rng.integers(-100, 100, length).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal(length) + 1j * rng.standard_normal(length)).astype(dtype)
    return rng.standard_normal(length).astype(np.float32).astype(dtype)


def rank_order(xs: list[np.ndarray], op: str) -> np.ndarray:
    """((x0 op x1) op x2) ... in the inputs' dtype; ``avg`` divides that sum in place by the count."""
    acc = xs[0].copy()
    for x in xs[1:]:
        if op == "max":
            np.maximum(acc, x, out=acc)
        else:
            acc += x
    if op == "avg":
        acc /= len(xs)
    return acc


def _name(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == BF16 else dtype.name


def check_values(what: str, got: Any, want: np.ndarray, xs: list[np.ndarray] | None, bitwise: bool) -> None:
    """``got`` equals ``want`` bit for bit, or (``bitwise`` False) within the reordering bound over ``xs``."""
    g = np.asarray(got)
    assert g.dtype == want.dtype and g.shape == want.shape, (
        f"{what}: got {_name(g.dtype)}{list(g.shape)}, want {_name(want.dtype)}{list(want.shape)}"
    )
    if bitwise or xs is None:
        if g.tobytes() != want.tobytes():
            got_bytes = np.frombuffer(g.tobytes(), np.uint8).reshape(g.size, -1)
            want_bytes = np.frombuffer(want.tobytes(), np.uint8).reshape(want.size, -1)
            bad = np.flatnonzero((got_bytes != want_bytes).any(axis=1))
            first = int(bad[0])
            raise AssertionError(
                f"{what}: {bad.size} of {g.size} elements not bitwise equal to the rank-order "
                f"reference, first at [{first}]: got {g.reshape(-1)[first]!r}, "
                f"want {want.reshape(-1)[first]!r}"
            )
        return
    n = len(xs)
    eps = float(ml_dtypes.finfo(want.dtype).eps)
    bound = n * eps * np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
    err = np.abs(g.astype(np.float64) - want.astype(np.float64))
    if not np.all(err <= bound):
        worst = int(np.argmax(err - bound))
        raise AssertionError(
            f"{what}: element [{worst}] differs by {err[worst]:.3g} from the rank-order reference, "
            f"beyond the reordering bound n*eps*sum|x| = {bound[worst]:.3g}"
        )


# ---- traffic against the ring model -----------------------------------------------------------


def traffic_snapshot(comm: Any) -> dict[tuple[str, str], tuple[int, Fraction, Fraction]]:
    return {k: (r.calls, r.bytes_sent, r.bytes_received) for k, r in comm.traffic.records.items()}


def ring_model(collective: str, payload_bytes: int, n: int, is_root: bool) -> tuple[Fraction, Fraction]:
    """(sent, received) of one call by the communication model's ring attribution."""
    if collective == "broadcast":
        if n <= 1:
            return Fraction(0), Fraction(0)
        return (Fraction(payload_bytes), Fraction(0)) if is_root else (Fraction(0), Fraction(payload_bytes))
    if collective == "barrier":
        return Fraction(0), Fraction(0)
    cost = CollectiveCost("world", collective, "conformance", 1, n, 1, payload_bytes)
    return cost.bytes_sent, cost.bytes_received


class TrafficExpectation:
    """Replays the calls a case made through the ring model; compares with what the counter added."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.before = traffic_snapshot(comm)
        self.want: dict[tuple[str, str], list[Any]] = {}

    def call(self, group: Any, collective: str, payload_bytes: int, is_root: bool = False) -> None:
        sent, received = ring_model(collective, payload_bytes, group.world_size, is_root)
        entry = self.want.setdefault((group.group_name, collective), [0, Fraction(0), Fraction(0)])
        entry[0] += 1
        entry[1] += sent
        entry[2] += received

    def check(self, what: str) -> None:
        after = traffic_snapshot(self.comm)
        added = {}
        for key, (calls, sent, received) in after.items():
            c0, s0, r0 = self.before.get(key, (0, Fraction(0), Fraction(0)))
            if (calls - c0, sent - s0, received - r0) != (0, 0, 0):
                added[key] = (calls - c0, sent - s0, received - r0)
        want = {k: tuple(v) for k, v in self.want.items()}
        if added != want:
            keys = sorted(set(added) | set(want))
            diff = [
                f"{g}/{c}: recorded (calls, sent, received) = {_fmt(added.get((g, c)))}, ring model "
                f"{_fmt(want.get((g, c)))}"
                for g, c in keys
                if added.get((g, c)) != want.get((g, c))
            ]
            raise AssertionError(f"{what}: traffic differs from the ring model: " + "; ".join(diff))


def _fmt(entry: tuple[int, Fraction, Fraction] | None) -> str:
    if entry is None:
        return "nothing"
    return f"({entry[0]}, {entry[1]}, {entry[2]})"


def _unchanged(what: str, before: np.ndarray, after: Any) -> None:
    assert np.asarray(after).tobytes() == before.tobytes(), f"{what}: the collective modified its input"


# ---- the cases ---------------------------------------------------------------------------------


def all_reduce_case(dtype: np.dtype, op: str, length: int) -> Case:
    def case(comm: Any, exact: bool) -> None:
        n, r = comm.world_size, comm.rank
        xs = [rank_input(k, length, dtype, salt=1) for k in range(n)]
        mine = xs[r].copy()
        traffic = TrafficExpectation(comm)
        got = comm.all_reduce(mine, op)
        traffic.call(comm, "all_reduce", mine.nbytes)
        what = f"rank {comm.global_rank}: all_reduce {_name(dtype)} {op} length {length} over {n} ranks"
        _unchanged(what, xs[r], mine)
        moves_only = op == "max" or dtype.kind in "iub"
        check_values(what, got, rank_order(xs, op), xs, moves_only or exact or n <= 2)
        traffic.check(what)

    return case


def reduce_scatter_case(dtype: np.dtype, op: str, chunk: int) -> Case:
    def case(comm: Any, exact: bool) -> None:
        n, r = comm.world_size, comm.rank
        xs = [rank_input(k, chunk * n, dtype, salt=2) for k in range(n)]
        mine = xs[r].copy()
        traffic = TrafficExpectation(comm)
        got = comm.reduce_scatter(mine, op)
        traffic.call(comm, "reduce_scatter", mine.nbytes)
        what = f"rank {comm.global_rank}: reduce_scatter {_name(dtype)} {op} chunk {chunk} over {n} ranks"
        _unchanged(what, xs[r], mine)
        pieces = [x[r * chunk : (r + 1) * chunk] for x in xs]
        moves_only = op == "max" or dtype.kind in "iub"
        check_values(what, got, rank_order(pieces, op), pieces, moves_only or exact or n <= 2)
        traffic.check(what)
        # a donated input may be used as scratch space; the result and the traffic stay the same
        traffic = TrafficExpectation(comm)
        donated = comm.reduce_scatter(xs[r].copy(), op, donate=True)
        traffic.call(comm, "reduce_scatter", mine.nbytes)
        same = np.asarray(donated).tobytes() == np.asarray(got).tobytes()
        assert same, f"{what}: the result with a donated input differs"
        traffic.check(f"{what} (donated input)")

    return case


def all_gather_case(dtype: np.dtype, length: int) -> Case:
    def case(comm: Any, exact: bool) -> None:
        n, r = comm.world_size, comm.rank
        xs = [rank_input(k, length, dtype, salt=3) for k in range(n)]
        mine = xs[r].copy()
        traffic = TrafficExpectation(comm)
        got = comm.all_gather(mine)
        traffic.call(comm, "all_gather", mine.nbytes * n)
        what = f"rank {comm.global_rank}: all_gather {_name(dtype)} length {length} over {n} ranks"
        _unchanged(what, xs[r], mine)
        check_values(what, got, np.concatenate(xs), None, True)
        traffic.check(what)

    return case


def broadcast_case(dtype: np.dtype) -> Case:
    def case(comm: Any, exact: bool) -> None:
        n, r = comm.world_size, comm.rank
        xs = [rank_input(k, 7, dtype, salt=4).reshape(7, 1) for k in range(n)]
        traffic = TrafficExpectation(comm)
        got = []
        for root in range(n):
            got.append(comm.broadcast(xs[r].copy(), root=root))
            traffic.call(comm, "broadcast", xs[r].nbytes, is_root=root == r)
        for root in range(n):
            check_values(
                f"rank {comm.global_rank}: broadcast {_name(dtype)} from root {root} over {n} ranks",
                got[root],
                xs[root],
                None,
                True,
            )
        traffic.check(f"rank {comm.global_rank}: broadcast {_name(dtype)}")

    return case


def barrier_case(comm: Any, exact: bool) -> None:
    traffic = TrafficExpectation(comm)
    comm.barrier()
    comm.barrier()
    traffic.call(comm, "barrier", 0)
    traffic.call(comm, "barrier", 0)
    traffic.check(f"rank {comm.global_rank}: barrier")


def scalar_case(comm: Any, exact: bool) -> None:
    n = comm.world_size
    traffic = TrafficExpectation(comm)
    got = comm.all_reduce(np.array(comm.rank + 1, dtype=np.float64), "sum")
    traffic.call(comm, "all_reduce", 8)
    check_values(
        f"rank {comm.global_rank}: 0-d all_reduce",
        got,
        np.array(n * (n + 1) / 2, dtype=np.float64),
        None,
        True,
    )
    traffic.check(f"rank {comm.global_rank}: 0-d all_reduce")


def split_case(comm: Any, exact: bool) -> None:
    """Parity groups (odd worlds give groups of different sizes), names, key order, the shared counter."""
    n, r = comm.world_size, comm.rank
    traffic = TrafficExpectation(comm)
    parity = comm.split(r % 2, name=f"parity[{r % 2}]")
    backwards = comm.split(0, key=-r, name="backwards")
    opted_out = comm.split(None)
    unnamed = comm.split(0)
    xs = [rank_input(k, 5, np.dtype(np.float32), salt=5) for k in range(n)]
    members = [k for k in range(n) if k % 2 == r % 2]
    summed = parity.all_reduce(xs[r].copy(), "sum")
    traffic.call(parity, "all_reduce", xs[r].nbytes)
    gathered = backwards.all_gather(xs[r].copy())
    traffic.call(backwards, "all_gather", xs[r].nbytes * n)
    what = f"rank {comm.global_rank}: split"
    assert opted_out is None, f"{what}: split(None) returned {opted_out!r}, not None"
    assert unnamed.group_name.startswith(f"{comm.group_name}/split") and unnamed.group_name.endswith(":0"), (
        f"{what}: an unnamed split is called {unnamed.group_name!r}, not <parent>/split<k>:<color>"
    )
    assert parity.group_name == f"parity[{r % 2}]", f"{what}: group name {parity.group_name!r}"
    assert parity.global_ranks == tuple(members), (
        f"{what}: parity members {parity.global_ranks}, want {members}"
    )
    assert parity.rank == members.index(r) and parity.world_size == len(members), (
        f"{what}: parity rank/size {parity.rank}/{parity.world_size}"
    )
    assert backwards.global_ranks == tuple(reversed(range(n))) and backwards.rank == n - 1 - r, (
        f"{what}: key=-rank gave members {backwards.global_ranks}, rank {backwards.rank}"
    )
    assert parity.traffic is comm.traffic and backwards.traffic is comm.traffic, (
        f"{what}: a split group records into its own counter, not its parent's"
    )
    check_values(
        f"{what}: parity all_reduce",
        summed,
        rank_order([xs[k] for k in members], "sum"),
        [xs[k] for k in members],
        exact or len(members) <= 2,
    )
    check_values(f"{what}: backwards all_gather", gathered, np.concatenate(xs[::-1]), None, True)
    traffic.check(what)


# Calls every backend must refuse before any rank enters the collective (every rank raises alike, so
# nobody waits): name -> (the call on comm with a float32 buffer x of length 2n, the error it raises).
BAD_INPUTS: dict[str, tuple[Callable[[Any, np.ndarray], Any], type[Exception]]] = {
    "op-prod": (lambda comm, x: comm.all_reduce(x, "prod"), ConfigError),
    "avg-of-int64": (lambda comm, x: comm.all_reduce(np.arange(3), "avg"), ConfigError),
    "reduce_scatter-2d": (lambda comm, x: comm.reduce_scatter(x.reshape(2, -1)), CollectiveError),
    "reduce_scatter-indivisible": (
        lambda comm, x: comm.reduce_scatter(np.zeros(2 * comm.world_size + 1, np.float32)),
        CollectiveError,
    ),
    "all_gather-2d": (lambda comm, x: comm.all_gather(x.reshape(2, -1)), CollectiveError),
    "broadcast-root-out-of-range": (lambda comm, x: comm.broadcast(x, root=comm.world_size), ConfigError),
    "split-negative-color": (lambda comm, x: comm.split(-1), ConfigError),
}


def bad_input_case(name: str) -> Case:
    call, exc = BAD_INPUTS[name]

    def case(comm: Any, exact: bool) -> None:
        if name == "reduce_scatter-indivisible" and comm.world_size == 1:
            return  # every length divides by one rank
        x = rank_input(comm.rank, 2 * comm.world_size, np.dtype(np.float32), salt=6)
        traffic = TrafficExpectation(comm)
        what = f"rank {comm.global_rank}: {name}"
        try:
            call(comm, x)
        except exc as e:
            assert str(e), f"{what}: {type(e).__name__} without a message"
        except Exception as e:  # noqa: BLE001 - the wrong type is the finding
            raise AssertionError(f"{what} raised {type(e).__name__}: {e}, not {exc.__name__}") from e
        else:
            raise AssertionError(f"{what} was accepted, not refused with {exc.__name__}")
        traffic.check(f"{what}: refused call")  # nothing recorded for it

    return case


def build_cases() -> dict[str, Case]:
    """Every case by name; the same names on every backend."""
    cases: dict[str, Case] = {}
    for dname, dtype in REDUCE_DTYPES.items():
        for op in ("sum", "avg", "max"):
            if op == "avg" and dtype.kind != "f":
                continue
            for length in ODD_LENGTHS:
                cases[f"all_reduce-{dname}-{op}-{length}"] = all_reduce_case(dtype, op, length)
            cases[f"reduce_scatter-{dname}-{op}-chunk5"] = reduce_scatter_case(dtype, op, 5)
    for length in (1, 5):
        cases[f"reduce_scatter-float32-sum-chunk{length}-odd"] = reduce_scatter_case(
            FLOAT_DTYPES["float32"], "sum", length
        )
    for dname, dtype in ALL_DTYPES.items():
        for length in (1, 5):
            cases[f"all_gather-{dname}-{length}"] = all_gather_case(dtype, length)
        cases[f"broadcast-{dname}-every-root"] = broadcast_case(dtype)
    cases["barrier"] = barrier_case
    cases["scalar-all_reduce"] = scalar_case
    cases["split-parity-and-key"] = split_case
    for name in BAD_INPUTS:
        cases[f"bad-input-{name}"] = bad_input_case(name)
    assert {name.split("-")[0] for name in cases} >= {c for c in COLLECTIVES}
    return cases


CASES = build_cases()


def run_cases(comm: Any, exact: bool, names: list[str] | None = None) -> dict[str, str | None]:
    """Every case on this rank: name -> None (passed) or the failure. A failing collective stops the run
    (the group is unusable afterwards); the cases not reached are reported as such."""
    results: dict[str, str | None] = {}
    todo = list(CASES) if names is None else names
    for i, name in enumerate(todo):
        try:
            CASES[name](comm, exact)
            results[name] = None
        except AssertionError as e:
            results[name] = str(e)
        except (CollectiveError, ConfigError) as e:
            results[name] = f"{type(e).__name__}: {e}"
            for rest in todo[i + 1 :]:
                results[rest] = f"not run: {name} failed with {type(e).__name__}"
            break
    return results


# ---- the launched program (mpiexec / torchrun) ----------------------------------------------------


def _merge(per_rank: list[dict[str, str | None]]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for rank, res in enumerate(per_rank):
        for name, msg in res.items():
            merged.setdefault(name, [])
            if msg is not None:
                merged[name].append(f"rank {rank}: {msg}")
    return merged


def _fault_loop(comm: Any) -> int:
    x = np.arange(4 * comm.world_size, dtype=np.float32)
    for _ in range(4):
        comm.all_reduce(x, "sum")
        comm.reduce_scatter(x, "avg")
        comm.all_gather(x[:3])
    comm.barrier()
    if comm.rank == 0:
        print("finished", flush=True)
    return 0


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("cases", "fault"))
    p.add_argument("--backend", choices=("mpi", "torch"), required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--timeout-mode", default="abort", help="MPI only: abort | raise")
    args = p.parse_args(argv)

    if args.backend == "mpi":
        from mpi4py import MPI

        from zerosim.comm.mpi import MpiCommunicator
        from zerosim.mpi.rank import run_rank

        def world() -> Any:
            return MpiCommunicator(timeout_s=args.timeout, timeout_mode=args.timeout_mode)

        def gather(obj: Any) -> list[Any] | None:
            return MPI.COMM_WORLD.gather(obj, root=0)
    else:
        from zerogpu.comm import init_distributed
        from zerogpu.rank import run_rank  # type: ignore[assignment]

        holder: dict[str, Any] = {}

        def world() -> Any:
            holder["comm"] = init_distributed("gloo", "cpu", args.timeout)
            return holder["comm"]

        def gather(obj: Any) -> list[Any] | None:
            return holder["comm"].gather_object(obj, root=0)

    def body() -> int:
        comm = world()
        if args.mode == "fault":
            return _fault_loop(comm)
        t0 = time.perf_counter()
        results = run_cases(comm, exact=False)
        everyone = gather(results)
        if comm.rank == 0:
            assert everyone is not None
            doc = {
                "backend": args.backend,
                "world_size": comm.world_size,
                "timeout_mode": args.timeout_mode,
                "seconds": round(time.perf_counter() - t0, 3),
                "cases": _merge(everyone),
            }
            print("CONFORMANCE " + json.dumps(doc), flush=True)
        return 0

    run_rank(body)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ZeroSimError as e:  # bad arguments to the program itself
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
