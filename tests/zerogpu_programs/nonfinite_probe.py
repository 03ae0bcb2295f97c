"""Under torchrun (2 ranks): a non-finite gradient on rank 1 stops the step on every rank, naming rank 1
and the tensor, before any rank steps with it; the next step trains normally.

Uses trainer_probe's model, whose gradients are given: at step 1 rank 1 gives NaN for ``blocks.0.w``.
NO_SHARD, ZeRO-1 and hybrid find it while all-reduces started during backward are under way; ZeRO-3
finds it before the unit's reduce-scatter. Prints one JSON line per strategy from rank 0.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist
from trainer_probe import Probe, gradients

from zerogpu.trainer import ZeroTrainer
from zerosim.errors import NonFiniteGradientError
from zerosim.numerics.optim import OptimizerSpec


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for strategy in ("ddp", "zero1", "zero3", "hybrid"):
        trainer = ZeroTrainer(Probe(), OptimizerSpec("sgd", lr=0.1, momentum=0.9), strategy)
        trainer.step({n: torch.from_numpy(g) for n, g in gradients(rank, 0).items()})
        before = {n: p.clone() for n, p in trainer.full_parameters().items()}
        bad = gradients(rank, 1)
        if rank == 1:
            bad["blocks.0.w"][2, 1] = np.nan
        error = ""
        try:
            trainer.step({n: torch.from_numpy(g) for n, g in bad.items()})
        except NonFiniteGradientError as e:
            error = str(e)
        unchanged = all(torch.equal(before[n], p) for n, p in trainer.full_parameters().items())
        trainer.step({n: torch.from_numpy(g) for n, g in gradients(rank, 2).items()})
        after = torch.cat([p.reshape(-1) for p in trainer.full_parameters().values()])
        gathered = [torch.empty_like(after) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, after)
        if rank == 0:
            print(json.dumps({"strategy": strategy, "error": error, "unchanged": unchanged,
                              "finite_after": bool(torch.isfinite(after).all()),
                              "ranks_agree_after": all(torch.equal(g, gathered[0]) for g in gathered)}),
                  flush=True)
        trainer.schedule.remove_hooks()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from zerogpu.rank import leave_rank

    leave_rank(main())
