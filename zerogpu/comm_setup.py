"""Setting up torch.distributed for the TorchCommunicator: device, backend, and the per-process job state.

:func:`resolve_device` and :func:`resolve_backend` turn the user's ``--device`` / ``--dist-backend``
into what ``init_process_group`` needs (NCCL for CUDA, gloo for CPU), refusing impossible pairs with
one line that names the field. :class:`Job` is what every communicator of one process shares: the
progress board the watchdog reads (:mod:`zerogpu.progress`), the test-only fault counter
(``ZEROSIM_FAULT``, :mod:`zerosim.comm.fault_plan`), whether the backend has a native
reduce-scatter, and the gloo control group for object collectives. It is rebuilt when a new default
process group appears, and retired when the last trainer holding it is closed (:func:`hold_job`,
:func:`release_job`: its board's thread stopped and joined, so nothing of zerogpu's runs after
``ZeroTrainer.close()``). :func:`pg_count` and :func:`name_hash` serve ``split``'s group naming.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from zerosim.comm.fault_plan import FaultCounter, FaultPlan
from zerosim.errors import ConfigError

from .progress import ProgressBoard

DIST_BACKENDS = ("auto", "gloo", "nccl")


class Job:
    """What the communicators of one process share: progress board, fault counter, control group."""

    def __init__(self, timeout_s: float):
        self.world = dist.group.WORLD
        self.world_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.backend = str(dist.get_backend())
        store = default_store()
        self.board = ProgressBoard(store, self.world_rank)
        self.fault = FaultCounter(FaultPlan.from_env(), self.world_rank)
        self.native_reduce_scatter: bool | None = None  # None: not tried yet
        self.holders = 0  # open trainers using this job (hold_job / release_job)
        # object collectives (control path, not traffic-accounted) run on CPU tensors: gloo
        self.control_group: Any = (dist.group.WORLD if "gloo" in self.backend
                                   else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))


_JOB: Job | None = None


def job(timeout_s: float) -> Job:
    """The process's shared state for the current default process group (built on first use)."""
    global _JOB
    if _JOB is None or _JOB.world is not dist.group.WORLD:  # a new default process group: start afresh
        if _JOB is not None:
            _JOB.board.stop()
        _JOB = Job(timeout_s)
    return _JOB


def hold_job(held: Job) -> None:
    """One more open trainer uses ``held``: the job stays until it is released."""
    held.holders += 1


def release_job(held: Job) -> None:
    """One open trainer less. The last one stops the board's publishing thread (joined, see
    :meth:`zerogpu.progress.ProgressBoard.stop`) and retires the job, so the next communicator starts
    a fresh one; communicators still holding the retired job keep working, without publishing."""
    global _JOB
    held.holders = max(0, held.holders - 1)
    if held.holders:
        return
    held.board.stop()
    if _JOB is held:
        _JOB = None


def current_job() -> Job | None:
    """The process's shared communicator state, if a communicator exists (used by the failure policy)."""
    return _JOB


def default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 - no store, no survey (errors still raise, without names)
        return None


def pg_count() -> int:
    """How many process groups this process registered (torch names local-sync groups by it)."""
    try:
        from torch.distributed.distributed_c10d import _world

        return len(_world.pg_names)
    except Exception:  # noqa: BLE001
        return -1


def name_hash(name: str | None) -> int:
    """A group name as an integer the members of a split can all-gather and compare (-1: no name)."""
    if name is None:
        return -1
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=7).digest(), "little")


def resolve_device(device: str = "auto") -> str:
    """``auto`` -> ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``; validates the rest."""
    if device in (None, "", "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError("device", device, "expected auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return "cpu"
    if dev.type != "cuda":
        raise ConfigError("device", device, "expected auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError("device", device, "CUDA is not available on this machine (torch "
                          f"{torch.__version__}); use --device cpu (gloo)")
    index = dev.index
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count())
    if index >= torch.cuda.device_count():
        raise ConfigError("device", device, f"this machine has {torch.cuda.device_count()} CUDA device(s)")
    return f"cuda:{index}"


def resolve_backend(backend: str, device: str) -> str:
    """``auto`` -> nccl for CUDA, gloo for CPU; NCCL cannot move CPU tensors."""
    if backend not in DIST_BACKENDS:
        raise ConfigError("dist_backend", backend, f"known: {', '.join(DIST_BACKENDS)}")
    if backend == "auto":
        return "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and not device.startswith("cuda"):
        raise ConfigError("dist_backend", backend, "NCCL moves CUDA tensors only; use gloo with --device cpu")
    if backend == "nccl" and not dist.is_nccl_available():
        raise ConfigError("dist_backend", backend, "this torch build has no NCCL")
    return backend


def check_timeout(timeout_s: Any) -> None:
    """A collective timeout must be a positive number of seconds (ConfigError naming ``timeout_s``)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ConfigError("timeout_s", timeout_s, "must be a positive number of seconds")
