"""Trainers that misbehave as processes, for ``tests/test_run_lifecycle.py``.

Each factory builds the correct example trainer (``examples/zero1_trainer.py``) after doing one thing a
real trainer might: start a child process that inherits the rank's standard output, leave the run
early with ``os._exit(0)``, tear the process group down, print tens of MiB. Where a test must find the
processes afterwards, every rank writes its own process id and its child's to
``$ZEROSIM_TEST_PID_DIR`` (``rank<R>.pid``, ``child<R>.pid``).
"""

from __future__ import annotations

import os
import subprocess
import time

import torch
import torch.distributed as dist

from examples.zero1_trainer import Zero1Trainer

PID_DIR_ENV = "ZEROSIM_TEST_PID_DIR"
LOUD_BYTES_ENV = "ZEROSIM_TEST_LOUD_BYTES"
STEP_DELAY_ENV = "ZEROSIM_TEST_STEP_DELAY_S"
EXITING_RANK = 1
EXIT_AT_STEP = 2


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def _record(name: str, pid: int) -> None:
    folder = os.environ.get(PID_DIR_ENV)
    if folder:
        path = os.path.join(folder, name)
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.replace(path + ".tmp", path)  # a reader never sees a half-written id


class SlowTrainer(Zero1Trainer):
    """The example, each step delayed by ``$ZEROSIM_TEST_STEP_DELAY_S`` (so a signal lands mid-run)."""

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        time.sleep(float(os.environ.get(STEP_DELAY_ENV, "0")))
        return super().step(inputs, targets)


def with_child(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """Every rank starts ``sleep 100000``, which inherits the rank's stdout and stderr and outlives it
    unless the launcher ends it; both ids are recorded."""
    child = subprocess.Popen(["sleep", "100000"])
    _record(f"child{_rank()}.pid", child.pid)
    _record(f"rank{_rank()}.pid", os.getpid())
    return SlowTrainer(model, optim)


class ExitsMidRun(Zero1Trainer):
    """Rank 1 leaves with ``os._exit(0)`` at its third step: no exception, no message, status 0."""

    steps_taken = 0

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        if self.rank == EXITING_RANK and self.steps_taken == EXIT_AT_STEP:
            os._exit(0)
        self.steps_taken += 1
        return super().step(inputs, targets)


def exits_mid_run(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    return ExitsMidRun(model, optim)


def destroys_group(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """Builds the trainer, then tears the default process group down (as a trainer's cleanup might)."""
    trainer = Zero1Trainer(model, optim)
    dist.destroy_process_group()
    return trainer


def loud(model: torch.nn.Module, optim: dict) -> Zero1Trainer:
    """Rank 0 writes ``$ZEROSIM_TEST_LOUD_BYTES`` bytes of text to its stdout before training."""
    if _rank() == 0:
        total = int(os.environ.get(LOUD_BYTES_ENV, "0"))
        line = b"x" * 1023 + b"\n"
        fd = 1
        for _ in range(total // len(line)):
            os.write(fd, line)
    return Zero1Trainer(model, optim)
