"""What only MpiCommunicator has, under real mpiexec: ``out=`` buffers and its two traffic counters.

The checks run inside tests/mpi_programs/comm_checks.py (every rank computes the expected result
itself from seeded inputs); these tests launch it and read its verdict. Also: the launcher's
argument forwarding and mpiexec discovery, which need no MPI. The collectives every Communicator
must get right (each collective, dtype, traffic, timeouts) are in tests/test_comm_conformance.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from zerosim.errors import ConfigError
from zerosim.mpi.launch import find_mpiexec, mpi_unavailable_reason, run_mpiexec

PROGRAMS = Path(__file__).parent / "mpi_programs"
REASON = mpi_unavailable_reason()
needs_mpi = pytest.mark.skipif(REASON is not None, reason=f"MPI unavailable: {REASON}")


@pytest.mark.mpi
@needs_mpi
@pytest.mark.parametrize(("ranks", "mode"), [(1, "abort"), (3, "abort"), (4, "raise")])
def test_out_buffers_and_both_traffic_counters(ranks: int, mode: str) -> None:
    result = run_mpiexec(ranks, [str(PROGRAMS / "comm_checks.py"), mode], timeout_s=120)
    assert result.returncode == 0, result.stderr
    lines = set(result.stdout.splitlines())
    for check in ("OK out=", "OK plain counter", "OK traffic"):
        assert check in lines, f"{check!r} missing from {sorted(lines)}"


def test_find_mpiexec_honours_the_override_and_names_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZEROSIM_MPIEXEC", f"{sys.executable} --flag")
    assert find_mpiexec() == [sys.executable, "--flag"]
    monkeypatch.setenv("ZEROSIM_MPIEXEC", "/nonexistent/mpiexec -f hosts")
    with pytest.raises(ConfigError, match="ZEROSIM_MPIEXEC"):
        find_mpiexec()


def test_run_mpiexec_rejects_bad_sizes_and_timeouts() -> None:
    with pytest.raises(ConfigError, match="world_size"):
        run_mpiexec(0, ["x.py"], 10)
    with pytest.raises(ConfigError, match="launch_timeout"):
        run_mpiexec(2, ["x.py"], 0)
