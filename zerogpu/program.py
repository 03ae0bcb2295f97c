"""What every torchrun rank does for one run: the engine's SPMD program on a TorchCommunicator.

* :func:`rank_program_on_device` runs :func:`zerosim.engine.spmd.rank_program` with the engine's
  arrays on the communicator's device (``cfg.xp == "torch"``: torch tensors on ``cuda:<LOCAL_RANK>``
  under NCCL, on the CPU under gloo; ``cfg.xp == "numpy"``: host numpy, only the collectives on the
  device). Observations are numpy either way, so :func:`zerosim.engine.run_result.evaluate` checks
  C-ZERO-002..005 exactly as for the simulator and the MPI backend.
* :func:`exact_float32_math` turns TF32 off on CUDA: an fp32 run must compute in IEEE fp32, or
  C-ZERO-002's fp32 tolerance would be measuring TF32's 10-bit mantissa, not the engine.
* :func:`gather_observations` ships every rank's observation to rank 0 (the gloo control group,
  not traffic-accounted); :func:`agree_on_exit` gives every rank rank 0's verdict exit status.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from zerosim.engine.config import ResolvedRun
from zerosim.engine.spmd import rank_program
from zerosim.errors import ConfigError
from zerosim.values.observe import RankObservation

_EXIT_KEY = "zerogpu/exit"
EXIT_WAIT_S = 1800.0  # how long ranks wait for rank 0's evaluation (rank 0 dying ends the job sooner)


def require_launcher(world_size: int | None) -> int:
    """The world size torchrun started (``WORLD_SIZE``); ConfigError outside torchrun or on a mismatch."""
    if "WORLD_SIZE" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigError(
            "launcher",
            "no WORLD_SIZE/MASTER_ADDR",
            "run under torchrun (torchrun --nproc-per-node N -m zerogpu ...), "
            "or let zerosim start it: zerosim simulate --backend torch --world-size N",
        )
    size = int(os.environ["WORLD_SIZE"])
    if world_size is not None and world_size != size:
        raise ConfigError("world_size", world_size, f"torchrun started {size} rank(s); run torchrun "
                          f"--nproc-per-node {world_size} or drop --world-size")
    return size


def exact_float32_math(device: str) -> None:
    """No TF32 in fp32 matmuls / convolutions (CUDA's default for convolutions, opt-in for matmul)."""
    import torch

    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def rank_program_on_device(comm: Any, run: ResolvedRun) -> RankObservation:
    """:func:`zerosim.engine.spmd.rank_program`, with torch arrays on ``comm.device`` (not just the CPU)."""
    device = str(comm.device) if run.cfg.xp == "torch" else "cpu"
    obs = rank_program(comm, run, device=device)
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)
    return obs


def gather_observations(comm: Any, observation: RankObservation) -> list[RankObservation] | None:
    """Every rank's observation on rank 0 (rank order), None elsewhere."""
    return comm.gather_object(observation, root=0)


def agree_on_exit(comm: Any, code: int | None) -> int:
    """Rank 0 publishes its exit status (after evaluating, which may take longer than the collective
    timeout); the others wait for it in the job's store. If rank 0 dies instead, torchrun ends the job."""
    import sys

    for stream in (sys.stdout, sys.stderr):  # rank 0's verdicts are out before anyone can exit
        stream.flush()
    store = comm._job.board.store
    if store is None:
        return int(comm.broadcast_object(code, root=0))
    if comm.rank == 0:
        store.set(_EXIT_KEY, str(int(code or 0)))
        return int(code or 0)
    store.wait([_EXIT_KEY], timedelta(seconds=EXIT_WAIT_S))
    return int(store.get(_EXIT_KEY))
