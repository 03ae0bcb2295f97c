"""DeepSpeed ZeRO 2 and 3 with the configuration keys that decide their traffic changed.

Under its defaults DeepSpeed trains correctly (C-ZERO-001..003 hold) but does not send what the ZeRO
schedule of its stage sends, so ``zerosim verify deepspeed-2`` and ``deepspeed-3`` fail C-ZERO-005:

- stage 2 averages gradients with bucketed all-reduces (``use_multi_rank_bucket_allreduce``, on by
  default): 2(N-1)/N of the gradient per rank, where ZeRO-2 reduce-scatters (N-1)/N;
- stage 3 keeps the parameters it gathered in forward alive for backward (``stage3_max_reuse_distance``,
  1e9 by default), so it gathers once per step where ZeRO-3 gathers twice: less traffic, more memory.

Each factory below changes what decides it, and verify then finds the traffic of the ZeRO schedule:

    zerosim verify examples.deepspeed_traffic:stage2_reduce_to_owner --world 2   # exit 0
    zerosim verify examples.deepspeed_traffic:stage3_no_reuse --world 2          # exit 1, see below

Stage 3 needs two keys (``stage3_max_reuse_distance`` and ``stage3_prefetch_bucket_size`` at 0: a
prefetched parameter is kept too). It then receives the ZeRO-3 volume on every rank and step except
one: at the second step of each phase rank 1 receives 1,264 bytes (1.3%) more, measured with
DeepSpeed 0.19.8 at world 2.
"""

from __future__ import annotations

from typing import Any

import torch

from zerosim.verify.adapters.deepspeed_zero import DeepSpeedTrainer


def stage2_reduce_to_owner(model: torch.nn.Module, optim: dict[str, Any]) -> DeepSpeedTrainer:
    """ZeRO-2 that reduces each gradient partition to the rank that owns it."""
    return DeepSpeedTrainer(model, optim, 2, {"use_multi_rank_bucket_allreduce": False})


def stage3_no_reuse(model: torch.nn.Module, optim: dict[str, Any]) -> DeepSpeedTrainer:
    """ZeRO-3 that releases every gathered parameter after use and gathers it again for backward."""
    return DeepSpeedTrainer(
        model, optim, 3, {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}
    )
