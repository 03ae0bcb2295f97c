"""Rank program for tests/test_verify_resources.py: each built-in adapter (and a deliberately wrong one)
steps the built-in GPT twice under a ResourceProbe; rank 0 stores every rank's observations
(zerosim.files.datafile).

Run under torchrun: ``resources_rank.py OUT_FILE ADAPTER[,ADAPTER...]``.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from zerosim.files import datafile
from zerosim.verify.adapters.ddp import DDPTrainer
from zerosim.verify.adapters.fsdp2 import make_grad_op_trainer, make_hybrid_trainer
from zerosim.verify.adapters.fsdp2 import make_trainer as make_fsdp2
from zerosim.verify.adapters.torch_zero import make_trainer as make_torch_zero
from zerosim.verify.model import build_model, micro_batch
from zerosim.verify.resources import ResourceProbe
from zerosim.verify.suite import PHASE_CONFIGS


class FullStateZero1(DDPTrainer):
    """Claims ZeRO-1 but its optimizer keeps state for every tensor: a hidden full copy of the state."""

    declared_strategy = "zero1"
    partition_rule = "zero-redundancy"


def _deepspeed(stage: int):
    def make(model, optim):
        from zerosim.verify.adapters.deepspeed_zero import DeepSpeedTrainer

        return DeepSpeedTrainer(model, optim, stage)

    return make


FACTORIES = {"deepspeed-1": _deepspeed(1), "deepspeed-2": _deepspeed(2), "deepspeed-3": _deepspeed(3),
             "ddp": DDPTrainer, "torch-zero": make_torch_zero, "fsdp2": make_fsdp2,
             "fsdp2-grad-op": make_grad_op_trainer, "fsdp2-hybrid": make_hybrid_trainer,
             "full-state-zero1": FullStateZero1}
STEPS = 2


def main() -> None:
    out, names = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    results = {}
    for name in names:
        for optim_name in ("sgd", "adamw"):
            optim = dict(PHASE_CONFIGS[optim_name])
            if optim_name == "adamw":
                optim["max_grad_norm"] = 0.05
            trainer = FACTORIES[name](build_model("gpt", "float64", 0), optim)
            probe = ResourceProbe(trainer)
            steps = []
            for step in range(1, STEPS + 1):
                inputs, targets = micro_batch(rank, step, 0)
                with probe.counting():
                    trainer.step(inputs, targets)
                steps.append(probe.take())
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, {"info": probe.info, "steps": steps})
            results[(name, optim_name)] = {"optim": optim, "ranks": gathered}
            del trainer
    if rank == 0:
        datafile.save(out, results)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from zerogpu.rank import leave_rank

    main()
    leave_rank(0)
