"""Run under mpiexec by tests/test_mpi_comm.py: what only MpiCommunicator has, against numpy.

``out=`` buffers (filled in place, 16-bit results rounded into them, ill-fitting ones rejected
before any rank enters MPI), a plain ``TrafficCounter`` recording call by call like the deferred
one, and the deferred counter's totals. The collectives every Communicator must get right are
checked by tests/test_comm_conformance.py. Every rank builds every rank's input from a seeded
generator; prints ``OK <check>`` per passed check on rank 0; any failure raises (non-zero exit).
"""

from __future__ import annotations

import sys
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
from mpi4py import MPI

from zerosim.comm.base import TrafficCounter
from zerosim.comm.mpi import MpiCommunicator
from zerosim.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the conformance suite's reference
from comm_conformance import rank_order  # noqa: E402

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


def check_close(name: str, got: np.ndarray, want: np.ndarray, bitwise: bool,
                xs: list[np.ndarray] | None = None) -> None:
    """Bitwise, or within the reordering bound of a sum over ``xs``: ``n * eps * sum_k |x_k|`` (each
    side rounds at most n times, n - 1 additions and the division of avg, by eps/2 of at most sum|x|)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape, want.dtype,
                                                                 want.shape)
    if bitwise or xs is None:
        bits = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
        diff = np.flatnonzero(got.view(bits) != want.view(bits))
        assert diff.size == 0, (f"{name}: {diff.size} elements differ bitwise, first at {diff[:5]}: "
                                f"{got[diff[:5]]} vs {want[diff[:5]]}")
    else:
        magnitude = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)
        bound = len(xs) * float(ml_dtypes.finfo(want.dtype).eps) * magnitude
        err = np.abs(got.astype(np.float64) - want.astype(np.float64))
        assert np.all(err <= bound), f"{name}: max error {err.max():.3g} beyond the reordering bound"


def main() -> None:
    world = MPI.COMM_WORLD
    n, me = world.Get_size(), world.Get_rank()
    mode = sys.argv[1] if len(sys.argv) > 1 else "abort"
    comm = MpiCommunicator(timeout_s=20.0, timeout_mode=mode)
    assert (comm.rank, comm.world_size, comm.global_ranks) == (me, n, tuple(range(n)))
    expected = TrafficCounter()
    ok: list[str] = []
    exact_order = n <= 2  # one commutative addition: bitwise equal to the rank-order sum

    # out= receives in place, exactly like the fresh-array form
    x = inputs(n, 4 * n, np.dtype(np.float32), seed=11)
    buf = np.empty(4 * n, np.float32)
    assert comm.all_reduce(x[me], "sum", out=buf) is buf
    expected.record("world", "all_reduce", x[me].nbytes, n)
    check_close("all_reduce out=", buf, rank_order(x, "sum"), exact_order, x)
    rs_buf = np.empty(4, np.float32)
    assert comm.reduce_scatter(x[me], "avg", out=rs_buf) is rs_buf
    expected.record("world", "reduce_scatter", x[me].nbytes, n)
    pieces = [v[me * 4:(me + 1) * 4] for v in x]
    check_close("reduce_scatter out=", rs_buf, rank_order(pieces, "avg"), exact_order, pieces)
    ag_buf = np.empty(4 * n * n, np.float32)
    assert comm.all_gather(x[me], out=ag_buf) is ag_buf
    expected.record("world", "all_gather", x[me].nbytes * n, n)
    check_close("all_gather out=", ag_buf, np.concatenate(x), bitwise=True)
    xb = inputs(n, 2 * n, BF16, seed=12)
    bf_buf = np.empty(2 * n, BF16)  # 16-bit: reduced through float32, rounded into out
    assert comm.all_reduce(xb[me], "sum", out=bf_buf) is bf_buf
    expected.record("world", "all_reduce", xb[me].nbytes, n)
    check_close("all_reduce bf16 out=", bf_buf, rank_order(xb, "sum"), exact_order, xb)
    # an out= that does not fit exactly is our error, before any rank enters MPI
    read_only = np.empty(4 * n * n, np.float32)
    read_only.flags.writeable = False
    for bad_out in (np.empty(4 * n * n, np.float64), np.empty(4 * n * n + 1, np.float32), read_only,
                    np.empty(8 * n * n, np.float32)[::2], np.empty((n, 4 * n), np.float32),
                    [0.0] * (4 * n * n)):
        try:
            comm.all_gather(x[me], out=bad_out)
        except ConfigError as e:
            assert "out" in str(e), e
        else:
            raise AssertionError(f"all_gather accepted out={type(bad_out).__name__} "
                                 f"{getattr(bad_out, 'shape', '')}")
        try:
            comm.reduce_scatter(np.resize(x[me], 4 * n * n), out=bad_out)
        except ConfigError as e:
            assert "out" in str(e), e
        else:
            raise AssertionError(f"reduce_scatter accepted out={type(bad_out).__name__} "
                                 f"{getattr(bad_out, 'shape', '')}")
    ok.append("out=")

    # a plain TrafficCounter (not the deferred one) records the same, call by call
    plain = MpiCommunicator(world, timeout_s=20.0, timeout_mode=mode, group_name="plain",
                            traffic=TrafficCounter())
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

    # traffic: exactly the ring attribution, record by record
    assert comm.traffic.records == expected.records, (comm.traffic.to_json(), expected.to_json())
    assert comm.traffic.total_sent() == sum((r.bytes_sent for r in expected.records.values()), Fraction(0))
    ok.append("traffic")

    gathered = world.gather(len(ok), root=0)
    if me == 0:
        assert len(set(gathered)) == 1, gathered
        for name in ok:
            print(f"OK {name}", flush=True)


if __name__ == "__main__":
    main()
