"""Every Communicator passes the same conformance cases: simulator, MPI (mpi4py) and torch.distributed (gloo).

The cases live in tests/comm_conformance.py: each collective on odd sizes and every dtype the
communicators move or reduce, values against a rank-order numpy reference, inputs unmodified,
traffic equal to the ring model, splits, bad input rejected before any rank waits. The simulator
runs them in this process; MPI and torch run them in one launch per backend (every case, every
rank), and each case is then one test here. A rank that never arrives must raise our
``CollectiveTimeout`` naming it; a rank that fails must end every rank, named once (exit 3).

What stays in the backend files is what only that backend has: the simulator's schedules,
mismatch and deadlock detection (tests/test_sim_comm.py); MPI's ``out=`` buffers and counters
(tests/test_mpi_comm.py); the torch launcher and selftest command (tests/test_zerogpu_*.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import comm_conformance as conformance
import numpy as np
import pytest

from zerosim.comm.sim import RankFailed, run_spmd
from zerosim.errors import CollectiveTimeout

PROGRAM = Path(__file__).parent / "comm_conformance.py"
LAUNCH_BOUND_S = 180.0  # one launch runs every case; generous for a loaded 2-core machine


class Backend(NamedTuple):
    name: str
    kind: str  # sim | mpi | torch
    world_size: int
    option: str  # sim: schedule; mpi: timeout mode; torch: unused


BACKENDS = [
    Backend("sim-serial-3", "sim", 3, "serial"),
    Backend("sim-parallel-4", "sim", 4, "parallel"),
    Backend("mpi-abort-3", "mpi", 3, "abort"),
    Backend("mpi-raise-4", "mpi", 4, "raise"),
    Backend("torch-gloo-3", "torch", 3, ""),
]
BY_NAME = {b.name: b for b in BACKENDS}

# Known departures from the conformance cases, per backend kind and case: the reason (a strict xfail,
# so the test turns red once the backend is fixed and the entry must go).
KNOWN_GAPS: dict[tuple[str, str], str] = {}


def _unavailable(kind: str) -> str | None:
    if kind == "mpi":
        from zerosim.mpi.launch import mpi_unavailable_reason

        return mpi_unavailable_reason()
    if kind == "torch":
        from zerogpu.launch import torch_unavailable_reason

        return torch_unavailable_reason()
    return None


def _marks(kind: str) -> list[Any]:
    marks: list[Any] = []
    if kind == "mpi":
        marks.append(pytest.mark.mpi)
    if kind == "torch":
        marks.append(pytest.mark.torchdist)
    reason = _unavailable(kind)
    if reason is not None:
        marks.append(pytest.mark.skip(reason=f"{kind} unavailable: {reason}"))
    return marks


def _parse(stdout: str) -> dict[str, Any]:
    docs = [
        json.loads(line.removeprefix("CONFORMANCE "))
        for line in stdout.splitlines()
        if line.startswith("CONFORMANCE ")
    ]
    assert len(docs) == 1, f"expected one CONFORMANCE line from rank 0, got {len(docs)}:\n{stdout[-2000:]}"
    return docs[0]


def _launch(
    backend: Backend, args: list[str], env: dict[str, str] | None = None, bound_s: float = LAUNCH_BOUND_S
) -> tuple[int, str, str, float]:
    """(status, stdout, stderr, elapsed) of the conformance program under the backend's launcher."""
    argv = [str(PROGRAM), *args, "--backend", backend.kind]
    if backend.kind == "mpi":
        from zerosim.mpi.launch import run_mpiexec

        r = run_mpiexec(backend.world_size, [*argv, "--timeout-mode", backend.option], bound_s, env=env)
        assert not r.timed_out, f"{backend.name}: the launch outlived {bound_s} s:\n{r.stderr[-3000:]}"
        return r.returncode, r.stdout, r.stderr, r.elapsed_s
    from zerogpu.launch import run_ranks

    r2 = run_ranks(backend.world_size, argv, bound_s, env={"PYTHONWARNINGS": "ignore", **(env or {})})
    assert not r2.timed_out, f"{backend.name}: the launch outlived {bound_s} s:\n{r2.stderr[-3000:]}"
    return r2.returncode, r2.stdout, r2.stderr, r2.elapsed_s


_LAUNCHED: dict[str, dict[str, Any]] = {}


def launched_results(backend: Backend, shared_dir: Path) -> dict[str, Any]:
    """Every case's result on a launched backend: one launch per backend and test session, shared by
    pytest-xdist workers through a locked file in the session's common temporary folder."""
    if backend.name in _LAUNCHED:
        return _LAUNCHED[backend.name]
    path = shared_dir / f"conformance-{backend.name}.json"
    with open(shared_dir / f"conformance-{backend.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            doc = json.loads(path.read_text())
        else:
            code, out, err, elapsed = _launch(backend, ["cases"])
            doc = (
                _parse(out)
                if code == 0
                else {"error": f"the conformance launch exited {code}:\n{err[-3000:]}"}
            )
            doc["launch_s"] = elapsed
            path.write_text(json.dumps(doc))
    assert "error" not in doc, f"{backend.name}: {doc['error']}"
    _LAUNCHED[backend.name] = doc
    return doc


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def sim_results(backend: Backend, name: str) -> dict[str, list[str]]:
    per_rank = run_spmd(
        backend.world_size,
        lambda comm: conformance.run_cases(comm, exact=True, names=[name]),
        timeout_s=30.0,
        schedule=backend.option,
    )
    return conformance._merge(per_rank)


def _case_params() -> list[Any]:
    params = []
    for b in BACKENDS:
        for name in conformance.CASES:
            marks = _marks(b.kind)
            gap = KNOWN_GAPS.get((b.kind, name))
            if gap is not None:
                marks.append(pytest.mark.xfail(reason=gap, strict=True))
            params.append(pytest.param(b.name, name, id=f"{b.name}:{name}", marks=marks))
    return params


@pytest.mark.parametrize(("backend_name", "case"), _case_params())
def test_conformance_case(backend_name: str, case: str, shared_dir: Path) -> None:
    backend = BY_NAME[backend_name]
    if backend.kind == "sim":
        merged = sim_results(backend, case)
    else:
        doc = launched_results(backend, shared_dir)
        assert doc["world_size"] == backend.world_size
        merged = doc["cases"]
    assert case in merged, f"{backend.name}: case {case} was not run: {sorted(merged)[:5]}..."
    assert not merged[case], f"{backend.name}: {case} failed:\n" + "\n".join(merged[case])


def test_every_backend_runs_the_same_cases() -> None:
    names = list(conformance.CASES)
    assert len(names) == len(set(names)) and len(names) >= 90
    collectives = {n.split("-")[0] for n in names}
    assert {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier"} <= collectives
    for dtype in conformance.ALL_DTYPES:
        assert any(f"-{dtype}-" in n for n in names if n.startswith(("all_gather", "broadcast"))), dtype
    for dtype in conformance.REDUCE_DTYPES:
        assert any(f"-{dtype}-" in n for n in names if n.startswith("all_reduce")), dtype


# ---- a rank that never arrives, a rank that fails ----------------------------------------------

FAULT_PARAMS = [pytest.param(b.name, id=b.name, marks=_marks(b.kind)) for b in BACKENDS]


def _failure_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("rank ") and " failed: " in line]


@pytest.mark.parametrize("backend_name", FAULT_PARAMS)
def test_a_rank_that_never_arrives_raises_collective_timeout_naming_it(backend_name: str) -> None:
    backend = BY_NAME[backend_name]
    late = backend.world_size - 1
    timeout_s = 1.5
    if backend.kind == "sim":

        def fn(comm: Any) -> None:
            x = np.zeros(3 * comm.world_size, np.float32)
            comm.all_reduce(x)
            if comm.rank == late:
                time.sleep(3 * timeout_s)
            comm.reduce_scatter(x)

        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout) as e:
            run_spmd(backend.world_size, fn, timeout_s=timeout_s, schedule=backend.option)
        assert e.value.missing_ranks == [late], str(e.value)
        assert f"ranks that never arrived: [{late}]" in str(e.value)
        assert time.monotonic() - t0 < 10 * timeout_s
        return
    # collective #4 (0-based) of the last rank is the fault loop's second reduce_scatter: it never enters it
    code, _, err, elapsed = _launch(
        backend,
        ["fault", "--timeout", str(timeout_s)],
        env={"ZEROSIM_FAULT": f"hang:rank={late}:call=4"},
        bound_s=90.0,
    )
    lines = _failure_lines(err)
    assert code == 3, f"{backend.name}: exit {code}, not 3:\n{err[-3000:]}"
    assert len(lines) == 1, f"{backend.name}: {len(lines)} failure lines, not one:\n{err[-3000:]}"
    assert (f"CollectiveTimeout: reduce_scatter on group world timed out after {timeout_s:g}s; "
            f"ranks that never arrived: [{late}]") in lines[0], lines[0]
    assert elapsed >= timeout_s


@pytest.mark.parametrize("backend_name", FAULT_PARAMS)
def test_a_failed_rank_ends_every_rank_and_is_named(backend_name: str) -> None:
    backend = BY_NAME[backend_name]
    timeout_s = 60.0  # the peers must be ended by the failure, not by waiting this out
    if backend.kind == "sim":

        def fn(comm: Any) -> None:
            x = np.zeros(2 * comm.world_size, np.float32)
            comm.all_reduce(x)
            if comm.rank == 1:
                raise RuntimeError("rank 1 broke")
            comm.all_gather(x)

        t0 = time.monotonic()
        with pytest.raises(RankFailed) as e:
            run_spmd(backend.world_size, fn, timeout_s=timeout_s, schedule=backend.option)
        assert e.value.rank == 1 and "rank 1 failed: RuntimeError: rank 1 broke" in str(e.value)
        assert time.monotonic() - t0 < 10
        return
    code, _, err, elapsed = _launch(
        backend,
        ["fault", "--timeout", str(timeout_s)],
        env={"ZEROSIM_FAULT": "raise:rank=1:call=4"},
        bound_s=90.0,
    )
    lines = _failure_lines(err)
    assert code == 3, f"{backend.name}: exit {code}, not 3:\n{err[-3000:]}"
    assert len(lines) == 1, f"{backend.name}: {len(lines)} failure lines, not one:\n{err[-3000:]}"
    assert lines[0].startswith("rank 1 failed: RuntimeError: injected fault"), lines[0]
    assert "before reduce_scatter on group world" in lines[0], lines[0]
    assert elapsed < timeout_s


# ---- the suite catches wrong communicators -------------------------------------------------------


class Mutant:
    """A simulator communicator with one collective replaced by a wrong one."""

    def __init__(self, comm: Any, **overrides: Callable[..., Any]):
        self._comm = comm
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name in self._overrides:
            return lambda *a, **k: self._overrides[name](self._comm, *a, **k)
        return getattr(self._comm, name)


def _run_mutant(world: int, case: str, exact: bool = True, **overrides: Callable[..., Any]) -> list[str]:
    per_rank = run_spmd(world, lambda comm: conformance.run_cases(Mutant(comm, **overrides), exact, [case]))
    return conformance._merge(per_rank)[case]


def test_an_average_that_forgot_to_divide_fails_naming_the_collective() -> None:
    fails = _run_mutant(
        3, "all_reduce-float32-avg-7", all_reduce=lambda c, x, op="sum": c.all_reduce(x, "sum")
    )
    assert len(fails) == 3 and "all_reduce float32 avg length 7 over 3 ranks" in fails[0], fails
    assert "not bitwise equal" in fails[0]


def test_a_reduce_scatter_done_as_all_reduce_fails_on_traffic() -> None:
    def via_all_reduce(c: Any, x: Any, op: str = "sum") -> Any:
        n = len(x) // c.world_size
        return c.all_reduce(x, op)[c.rank * n : (c.rank + 1) * n]

    fails = _run_mutant(3, "reduce_scatter-float32-sum-chunk5", reduce_scatter=via_all_reduce)
    assert fails and "traffic differs from the ring model" in fails[0], fails
    assert "world/all_reduce" in fails[0] and "world/reduce_scatter" in fails[0]


def test_a_gather_out_of_rank_order_and_a_broadcast_ignoring_root_fail() -> None:
    def rotated(c: Any, x: Any) -> Any:
        g = c.all_gather(x)
        return np.roll(g, len(x))

    fails = _run_mutant(3, "all_gather-int8-5", all_gather=rotated)
    assert fails and "all_gather int8 length 5" in fails[0] and "first at [0]" in fails[0], fails
    fails = _run_mutant(3, "broadcast-bfloat16-every-root", broadcast=lambda c, x, root=0: c.broadcast(x, 0))
    assert fails and "from root 1" in fails[0], fails


def test_the_reordering_bound_admits_any_summation_order_and_rejects_a_lower_precision() -> None:
    rng = np.random.default_rng(0)
    for dtype in conformance.FLOAT_DTYPES.values():
        xs = [rng.standard_normal(257).astype(np.float32).astype(dtype) for _ in range(7)]
        for order in (list(range(7))[::-1], [3, 0, 6, 1, 5, 2, 4]):
            other = conformance.rank_order([xs[k] for k in order], "avg")
            conformance.check_values(
                "reordered avg", other, conformance.rank_order(xs, "avg"), xs, bitwise=False
            )
    xs = [rng.standard_normal(257).astype(np.float32) for _ in range(7)]
    through_half = conformance.rank_order([x.astype(np.float16) for x in xs], "sum").astype(np.float32)
    with pytest.raises(AssertionError, match="beyond the reordering bound"):
        conformance.check_values(
            "float32 summed in float16", through_half, conformance.rank_order(xs, "sum"), xs, bitwise=False
        )
