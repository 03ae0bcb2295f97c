"""Run under mpiexec by tests/test_mpi_comm.py: every MpiCommunicator collective against numpy.

Every rank builds every rank's input from a seeded generator, so each rank can compute the expected
result itself. Prints ``OK <check>`` per passed check on rank 0; any failure raises (non-zero exit).
"""

from __future__ import annotations

import sys
from fractions import Fraction

import ml_dtypes
import numpy as np
from mpi4py import MPI

from zerosim.comm.base import TrafficCounter, ring_bytes
from zerosim.comm.mpi import MpiCommunicator
from zerosim.errors import CollectiveError, ConfigError

BF16 = np.dtype(ml_dtypes.bfloat16)


def inputs(n_ranks: int, length: int, dtype: np.dtype, seed: int) -> list[np.ndarray]:
    out = []
    for r in range(n_ranks):
        rng = np.random.default_rng(seed * 1000 + r)
        if dtype.kind in "iu":
            out.append(rng.integers(-50 if dtype.kind == "i" else 0, 50, size=length).astype(dtype))
        elif dtype.kind == "b":
            out.append(rng.random(length) < 0.3)
        else:
            out.append(rng.standard_normal(length).astype(dtype))
    return out


def rank_order(xs: list[np.ndarray], op: str) -> np.ndarray:
    """The simulator's arithmetic: ((x0 op x1) op x2) ..., avg = that sum divided in place."""
    acc = xs[0].copy()
    for x in xs[1:]:
        if op == "max":
            np.maximum(acc, x, out=acc)
        else:
            acc += x
    if op == "avg":
        acc /= len(xs)
    return acc


def check_close(name: str, got: np.ndarray, want: np.ndarray, bitwise: bool) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (
        name,
        got.dtype,
        got.shape,
        want.dtype,
        want.shape,
    )
    if bitwise:
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
        diff = np.flatnonzero(got.view(bits) != want.view(bits))
        assert diff.size == 0, (
            f"{name}: {diff.size} elements differ bitwise, first at {diff[:5]}: {got[diff[:5]]} vs "
            f"{want[diff[:5]]}"
        )
    else:
        np.testing.assert_allclose(
            got.astype(np.float64),
            want.astype(np.float64),
            rtol=2e-2 if got.dtype.itemsize == 2 else 1e-5,
            atol=1e-2 if got.dtype.itemsize == 2 else 1e-6,
            err_msg=name,
        )


def main() -> None:
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    mode = sys.argv[1] if len(sys.argv) > 1 else "abort"
    comm = MpiCommunicator(timeout_s=20.0, timeout_mode=mode)
    assert (comm.rank, comm.world_size, comm.global_ranks) == (me, n, tuple(range(n)))
    expected = TrafficCounter()
    ok: list[str] = []
    exact_order = n <= 2  # one commutative addition: bitwise equal to the rank-order sum

    for dtype in (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.int64), np.dtype(np.float16), BF16):
        for op in ("sum", "avg", "max"):
            if op == "avg" and dtype.kind in "iu":
                continue
            length = 6 * n + 12
            xs = inputs(n, length, dtype, seed=len(ok))
            bitwise = exact_order or op == "max" or dtype.kind in "iu"
            got = comm.all_reduce(xs[me], op)
            expected.record("world", "all_reduce", xs[me].nbytes, n)
            check_close(f"all_reduce {dtype} {op}", got, rank_order(xs, op), bitwise)
            assert np.array_equal(xs[me], inputs(n, length, dtype, seed=len(ok))[me]), "input modified"
            rs = comm.reduce_scatter(xs[me], op)
            expected.record("world", "reduce_scatter", xs[me].nbytes, n)
            c = length // n
            check_close(
                f"reduce_scatter {dtype} {op}",
                rs,
                rank_order([x[me * c : (me + 1) * c] for x in xs], op),
                bitwise,
            )
            ok.append(f"reduce {dtype} {op}")

    for dtype in (np.dtype(np.float32), BF16, np.dtype(np.bool_), np.dtype(np.int8), np.dtype(np.complex64)):
        xs = inputs(n, 5, dtype, seed=7)
        g = comm.all_gather(xs[me])
        expected.record("world", "all_gather", xs[me].nbytes * n, n)
        check_close(f"all_gather {dtype}", g, np.concatenate(xs), bitwise=True)
        for root in range(n):
            b = comm.broadcast(xs[me].reshape(5, 1), root=root)
            expected.record("world", "broadcast", xs[me].nbytes, n, is_root=me == root)
            check_close(f"broadcast {dtype} root={root}", b, xs[root].reshape(5, 1), bitwise=True)
        ok.append(f"gather/broadcast {dtype}")

    # out= receives in place, exactly like the fresh-array form
    x = inputs(n, 4 * n, np.dtype(np.float32), seed=11)
    buf = np.empty(4 * n, np.float32)
    assert comm.all_reduce(x[me], "sum", out=buf) is buf
    expected.record("world", "all_reduce", x[me].nbytes, n)
    check_close("all_reduce out=", buf, rank_order(x, "sum"), exact_order)
    rs_buf = np.empty(4, np.float32)
    assert comm.reduce_scatter(x[me], "avg", out=rs_buf) is rs_buf
    expected.record("world", "reduce_scatter", x[me].nbytes, n)
    check_close(
        "reduce_scatter out=", rs_buf, rank_order([v[me * 4 : (me + 1) * 4] for v in x], "avg"), exact_order
    )
    ag_buf = np.empty(4 * n * n, np.float32)
    assert comm.all_gather(x[me], out=ag_buf) is ag_buf
    expected.record("world", "all_gather", x[me].nbytes * n, n)
    check_close("all_gather out=", ag_buf, np.concatenate(x), bitwise=True)
    xb = inputs(n, 2 * n, BF16, seed=12)
    bf_buf = np.empty(2 * n, BF16)  # 16-bit: reduced through float32, rounded into out
    assert comm.all_reduce(xb[me], "sum", out=bf_buf) is bf_buf
    expected.record("world", "all_reduce", xb[me].nbytes, n)
    check_close("all_reduce bf16 out=", bf_buf, rank_order(xb, "sum"), exact_order)
    # an out= that does not fit exactly is our error, before any rank enters MPI
    read_only = np.empty(4 * n * n, np.float32)
    read_only.flags.writeable = False
    for bad_out in (
        np.empty(4 * n * n, np.float64),
        np.empty(4 * n * n + 1, np.float32),
        read_only,
        np.empty(8 * n * n, np.float32)[::2],
        np.empty((n, 4 * n), np.float32),
        [0.0] * (4 * n * n),
    ):
        try:
            comm.all_gather(x[me], out=bad_out)
        except ConfigError as e:
            assert "out" in str(e), e
        else:
            raise AssertionError(
                f"all_gather accepted out={type(bad_out).__name__} {getattr(bad_out, 'shape', '')}"
            )
        try:
            comm.reduce_scatter(np.resize(x[me], 4 * n * n), out=bad_out)
        except ConfigError as e:
            assert "out" in str(e), e
        else:
            raise AssertionError(
                f"reduce_scatter accepted out={type(bad_out).__name__} {getattr(bad_out, 'shape', '')}"
            )
    ok.append("out=")

    # a plain TrafficCounter (not the deferred one) records the same, call by call
    plain = MpiCommunicator(
        world, timeout_s=20.0, timeout_mode=mode, group_name="plain", traffic=TrafficCounter()
    )
    want = TrafficCounter()
    plain.all_reduce(x[me], "avg")
    want.record("plain", "all_reduce", x[me].nbytes, n)
    plain.reduce_scatter(x[me])
    want.record("plain", "reduce_scatter", x[me].nbytes, n)
    plain.all_gather(x[me], out=ag_buf)
    want.record("plain", "all_gather", x[me].nbytes * n, n)
    plain.broadcast(x[me], root=0)
    want.record("plain", "broadcast", x[me].nbytes, n, is_root=me == 0)
    assert plain.traffic.records == want.records, (plain.traffic.to_json(), want.to_json())
    ok.append("plain counter")

    # a scalar (0-d) all_reduce keeps its shape, like the simulator
    s = comm.all_reduce(np.float64(me + 1), "sum")
    expected.record("world", "all_reduce", 8, n)
    assert s.shape == () and float(s) == n * (n + 1) / 2, s
    comm.barrier()
    expected.record("world", "barrier", 0, n)
    ok.append("scalar+barrier")

    # bad input: our errors, raised before any rank enters MPI (so every rank raises, nobody hangs)
    bad_inputs = [(lambda: comm.all_reduce(x[me], "prod"), ConfigError),
                  (lambda: comm.reduce_scatter(np.zeros((n, 2), np.float32)), CollectiveError),
                  (lambda: comm.broadcast(x[me], root=n), ConfigError),
                  (lambda: comm.all_reduce(np.arange(3), "avg"), ConfigError),
                  (lambda: comm.all_reduce(x[me], out=np.empty(1, np.float32)), ConfigError),
                  (lambda: comm.split(-1), ConfigError)]
    if n > 1:  # every length divides by one rank
        bad_inputs.append((lambda: comm.reduce_scatter(np.zeros(n * 2 + 1, np.float32)), CollectiveError))
    for bad, exc in bad_inputs:
        try:
            bad()
        except exc as e:
            assert str(e), "empty message"
        else:
            raise AssertionError(f"{bad} did not raise {exc.__name__}")
    ok.append("bad input")

    # split: node-major shard groups of 2 and the replicate groups across them, sharing one counter
    if n % 2 == 0:
        shard = comm.split(me // 2, name=f"shard[{me // 2}]")
        replicate = comm.split(me % 2, name=f"replicate[{me % 2}]")
        assert shard.traffic is comm.traffic and replicate.traffic is comm.traffic
        assert shard.global_ranks == (me // 2 * 2, me // 2 * 2 + 1), shard.global_ranks
        assert replicate.global_ranks == tuple(range(me % 2, n, 2)), replicate.global_ranks
        xs = inputs(n, 8, np.dtype(np.float32), seed=13)
        got = shard.all_reduce(xs[me], "avg")
        expected.record(f"shard[{me // 2}]", "all_reduce", 32, 2)
        check_close("shard all_reduce", got, rank_order([xs[r] for r in shard.global_ranks], "avg"), True)
        got = replicate.all_gather(xs[me])
        expected.record(f"replicate[{me % 2}]", "all_gather", 32 * replicate.world_size, replicate.world_size)
        check_close(
            "replicate all_gather", got, np.concatenate([xs[r] for r in replicate.global_ranks]), True
        )
        # key reverses the order; a default name follows the simulator's <parent>/split<k>:<color>
        rev = comm.split(0, key=-me)
        assert rev.global_ranks == tuple(reversed(range(n))) and rev.rank == n - 1 - me
        assert rev.group_name.startswith("world/split") and rev.group_name.endswith(":0"), rev.group_name
        assert comm.split(None) is None
        ok.append("split")

    # traffic: exactly the ring attribution, record by record
    assert comm.traffic.records == expected.records, (comm.traffic.to_json(), expected.to_json())
    assert comm.traffic.total_sent() == sum((r.bytes_sent for r in expected.records.values()), Fraction(0))
    sent, _ = ring_bytes("all_reduce", 4 * 4 * n, n)
    assert comm.traffic.records[("world", "all_reduce")].bytes_sent >= sent
    ok.append("traffic")

    gathered = world.gather(len(ok), root=0)
    if me == 0:
        assert len(set(gathered)) == 1, gathered
        for name in ok:
            print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
